"""Token cache: the corpus tokenized into one int32 stream, ``[BOS] + ids + [EOS]`` per document,
cached on disk under a key of the text, the tokenizer file and the cache format. See docs/data.md."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from hethub_jax.data._common import log
from hethub_jax.data.corpus import Document
from hethub_jax.data.tokenizer import Tokenizer

CACHE_ENV = "HETHUB_CACHE_DIR"
# Bump when the token stream layout or text normalisation changes, so old caches are not reused.
_CACHE_FORMAT = 1


def default_cache_dir() -> Path:
    """``$HETHUB_CACHE_DIR`` if set, else ``~/.cache/hethub_jax``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path("~/.cache/hethub_jax").expanduser()


def _corpus_key(docs: Sequence[Document], tokenizer: Tokenizer) -> str:
    h = hashlib.sha256()
    h.update(f"hethub-tokens-v{_CACHE_FORMAT}\0{tokenizer.sha256}\0{len(docs)}\0".encode())
    for d in docs:
        b = d.text.encode("utf-8")
        h.update(f"{len(b)}\0".encode())
        h.update(b)
    return h.hexdigest()


def _save_atomic(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def tokenize_corpus(
    docs: Sequence[Document],
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> np.ndarray:
    """The corpus as one token stream: ``[BOS] + encode(doc.text) + [EOS]`` for each document, in order.

    The stream is cached as ``tokens-<key>.npy`` under ``cache_dir`` (default
    :func:`default_cache_dir`), where the key hashes the documents' text (after Markdown
    conversion), the tokenizer file and the cache format; the file is written atomically (temporary
    file + ``os.replace``). A cache that cannot be read or written is ignored with a message.

    Returns:
      int32 array ``[num_tokens]``.

    Raises:
      ValueError: ``docs`` is empty.
    """
    if not docs:
        raise ValueError("tokenize_corpus: no documents")
    cache_path = None
    if use_cache:
        cache_path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        cache_path = cache_path / f"tokens-{_corpus_key(docs, tokenizer)[:32]}.npy"
        stream = _read_cache(cache_path, docs, tokenizer)
        if stream is not None:
            return stream
    stream = _encode_documents(docs, tokenizer)
    if cache_path is not None:
        try:
            _save_atomic(cache_path, stream)
        except OSError as e:
            log(f"could not write cache file {cache_path}: {e}")
    return stream


def _read_cache(cache_path: Path, docs: Sequence[Document], tokenizer: Tokenizer) -> np.ndarray | None:
    """The cached stream if ``cache_path`` holds a well-formed one (int32, 1-D, ids in the vocabulary,
    one BOS per document), else None (a malformed or unreadable file is reported and ignored)."""
    if not cache_path.is_file():
        return None
    try:
        stream = np.load(cache_path, allow_pickle=False)
        if (
            stream.dtype == np.int32
            and stream.ndim == 1
            and stream.size > 0
            and 0 <= int(stream.min())
            and int(stream.max()) < tokenizer.vocab_size
            and int(np.count_nonzero(stream == tokenizer.bos_id)) == len(docs)
        ):
            return stream
        log(f"ignoring malformed cache file {cache_path}")
    except (OSError, ValueError) as e:
        log(f"ignoring unreadable cache file {cache_path}: {e}")
    return None


def _encode_documents(docs: Sequence[Document], tokenizer: Tokenizer) -> np.ndarray:
    """``[BOS] + encode(doc.text) + [EOS]`` of every document, concatenated: int32 ``[num_tokens]``.
    Encodes eight documents per call and reports progress on stderr."""
    n_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
    log(f"tokenizing {len(docs)} documents ({n_bytes / 2**20:.1f} MiB) with {tokenizer.path.name}...")
    t0 = time.perf_counter()
    parts: list[np.ndarray] = []
    step = 8
    for i in range(0, len(docs), step):
        for ids in tokenizer.encode_batch([d.text for d in docs[i : i + step]]):
            parts.append(np.asarray([tokenizer.bos_id, *ids, tokenizer.eos_id], dtype=np.int32))
        if len(docs) > step:
            log(f"  {min(i + step, len(docs))}/{len(docs)} documents")
    stream = np.concatenate(parts)
    log(f"tokenized {stream.size:,} tokens in {time.perf_counter() - t0:.1f} s")
    return stream
