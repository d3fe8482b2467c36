"""Tokenizer: a SentencePiece model (default: the 32,000-token Llama-2-kind ``tokenizer.model.v1``
shipped by the PyPI package ``mistral-common``, loaded with plain ``sentencepiece``). See docs/data.md."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from hethub_jax.data._common import package_dir

DEFAULT_TOKENIZER_FILE = "tokenizer.model.v1"


def default_tokenizer_path() -> Path:
    """Path of ``tokenizer.model.v1`` inside the installed ``mistral-common`` package (not imported).

    Raises:
      FileNotFoundError: ``mistral-common`` is not installed or the file is missing.
    """
    pkg = package_dir("mistral_common")
    if pkg is None:
        raise FileNotFoundError(
            "tokenizer_path: the default tokenizer is data/tokenizer.model.v1 of the PyPI package "
            "'mistral-common', which is not installed; install it or pass a SentencePiece .model file "
            "as tokenizer_path"
        )
    path = pkg / "data" / DEFAULT_TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer_path: expected the SentencePiece model {path} inside the installed "
            "'mistral-common' package; pass a SentencePiece .model file as tokenizer_path"
        )
    return path


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Tokenizer:
    """A SentencePiece tokenizer with the ids the datasets need.

    ``encode`` adds no BOS/EOS; the datasets add them. With the default model, ordinary text
    round-trips exactly, ``decode(encode(s)) == s`` (the model has byte fallback, so no character
    becomes ``<unk>``; whitespace is kept).

    Attributes:
      path: the ``.model`` file.
      vocab_size: number of ids (32000 for the default model).
      bos_id, eos_id: SentencePiece's BOS/EOS ids (1 and 2 for the default model).
      pad_id: SentencePiece's pad id if the model defines one (>= 0); otherwise the ``<unk>`` id
        (0 for the default model), which a byte-fallback model never emits for text. Pads always
        carry loss_mask 0, so the choice does not affect the loss.
      sha256: hex digest of the model file (part of the cache key).

    Raises (constructor):
      FileNotFoundError: the model file does not exist.
      ValueError: the file is not a SentencePiece model, or it lacks a BOS or EOS id.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        import sentencepiece as spm

        self.path = default_tokenizer_path() if path is None else Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(
                f"tokenizer_path: {self.path} does not exist; expected a SentencePiece .model file"
            )
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise ValueError(
                f"tokenizer_path: {self.path} could not be loaded as a SentencePiece model: {e}"
            ) from e
        self.vocab_size: int = int(self._sp.vocab_size())
        self.bos_id: int = int(self._sp.bos_id())
        self.eos_id: int = int(self._sp.eos_id())
        self.unk_id: int = int(self._sp.unk_id())
        sp_pad = int(self._sp.pad_id())
        self.pad_id: int = sp_pad if sp_pad >= 0 else self.unk_id
        if self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(
                f"tokenizer_path: {self.path} defines no BOS or EOS id (bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}); documents need both to mark their boundaries"
            )
        if self.pad_id in (self.bos_id, self.eos_id):
            raise ValueError(
                f"tokenizer_path: {self.path} has pad_id={self.pad_id} equal to BOS/EOS; padding must be "
                "distinguishable from document boundaries"
            )
        self.sha256: str = _file_sha256(self.path)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return list(self._sp.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of several texts (SentencePiece encodes them on several threads)."""
        return [list(ids) for ids in self._sp.encode(list(texts))]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of token ids. BOS/EOS (control tokens) and ``pad_id`` are dropped.

        Raises:
          ValueError: an id is outside ``[0, vocab_size)``.
        """
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside [0, vocab_size={self.vocab_size})")
        return self._sp.decode([i for i in ids if i != self.pad_id])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"
