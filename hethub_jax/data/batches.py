"""Batches: token rows to ``tokens`` / ``targets`` / ``loss_mask`` arrays, padding. See docs/data.md."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from hethub_jax.data._common import check_positive_int

Batch = dict[str, np.ndarray]


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
    seq_len = check_positive_int("seq_len", seq_len)
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
    return windows_to_batch(window, lengths, eos_id=eos_id, bos_id=bos_id, pad_id=pad_id)


def windows_to_batch(
    windows: np.ndarray, lengths: np.ndarray | None, *, eos_id: int, bos_id: int, pad_id: int = 0
) -> Batch:
    """:data:`Batch` ``[B, S]`` from token windows int32 ``[B, S + 1]``: ``tokens = w[:, :-1]``,
    ``targets = w[:, 1:]``, ``loss_mask`` 0.0 where the input is ``eos_id`` or the target ``bos_id``.
    With ``lengths`` (int ``[B]``), positions ``>= lengths[b]`` of row ``b`` become ``pad_id`` with
    loss_mask 0.0."""
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
    seq_len = check_positive_int("seq_len", seq_len)
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


def pad_rows(batch: Batch, rows: int, pad_id: int) -> Batch:
    """``batch`` ``[b, S]`` grown to ``[rows, S]`` (``rows >= b``) by rows of ``pad_id`` with
    loss_mask 0.0."""
    b, s = batch["tokens"].shape
    out: Batch = {}
    for key, fill in (("tokens", pad_id), ("targets", pad_id), ("loss_mask", 0.0)):
        a = np.full((rows, s), fill, dtype=batch[key].dtype)
        a[:b] = batch[key]
        out[key] = a
    return out
