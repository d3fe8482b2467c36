"""Datasets: the train and validation splits of the token stream, cut into windows or document
chunks and served as seeded, resumable batches; :func:`build_datasets` builds both. See docs/data.md."""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

import numpy as np

from hethub_jax.data._common import check_positive_int
from hethub_jax.data.batches import Batch, collate_rows, pad_rows, windows_to_batch
from hethub_jax.data.config import DataConfig
from hethub_jax.data.corpus import load_corpus
from hethub_jax.data.token_cache import tokenize_corpus
from hethub_jax.data.tokenizer import Tokenizer

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
        self.seq_len = check_positive_int("seq_len", seq_len)
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
        return windows_to_batch(self.windows(indices), None, eos_id=self.eos_id, bos_id=self.bos_id)

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
        batch_size = check_positive_int("batch_size", batch_size)
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
        batch_size = check_positive_int("batch_size", batch_size)
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
            check_positive_int("max_batches", max_batches)

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
                batch = pad_rows(batch, batch_size, self.pad_id)
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
        width = self.seq_len if seq_len is None else check_positive_int("seq_len", seq_len)
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
