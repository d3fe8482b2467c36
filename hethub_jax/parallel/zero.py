"""Host-side collectives of the sharded (ZeRO-1) optimizer update across data-parallel replicas.

ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, section 5.1, P_os) partitions the optimizer update over the data-parallel
replicas: each parameter tensor has one owner replica (`hethub_jax.parallel.plan.zero1_owners`),
which alone needs the tensor's summed gradient and alone updates it; the updated tensor then goes
from the owner to the other replicas. The gradient all-reduce becomes a reduce to the owners
(`reduce_to_owners`, a reduce-scatter at tensor granularity) and the parameters come back with
`gather_from_owners` (an all-gather). With float32 parameters each rank sends and receives in total
as many bytes as a reduce-scatter + all-gather implementation of the all-reduce does (ZeRO section 7.1:
P_os keeps DP's communication volume); with uneven ownership the larger owner receives more gradients
and sends more parameters, so the busier direction of a rank carries up to ``(p - 1) x`` its owned
fraction of each.

Both functions run over a group communicator (`hethub_jax.comm` contract) whose ranks are the
replicas (one process each), with point-to-point messages: one flat buffer per (peer, dtype).
Everything here is host numpy; the callers move arrays between host and devices.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

#: Tags of the two exchanges on a group communicator (it carries nothing else meanwhile).
REDUCE_TAG, GATHER_TAG = 11, 12


def _by_dtype(names: list[str], arrays: Mapping[str, np.ndarray]) -> dict[np.dtype, list[str]]:
    out: dict[np.dtype, list[str]] = {}
    for n in names:
        out.setdefault(np.dtype(arrays[n].dtype), []).append(n)
    return {d: out[d] for d in sorted(out, key=lambda d: d.name)}


def _pack(names: list[str], arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ascontiguousarray(arrays[n]).reshape(-1) for n in names])


def _unpack(buf: np.ndarray, names: list[str], like: Mapping[str, Any], out: dict) -> None:
    off = 0
    for n in names:
        size = int(np.prod(like[n].shape))
        out[n] = buf[off:off + size].reshape(like[n].shape)
        off += size


def reduce_to_owners(comm: Any, local: Mapping[str, np.ndarray], owner: Callable[[str], int],
                     tag: int = REDUCE_TAG, timeout: float | None = None) -> dict[str, np.ndarray | None]:
    """Sums each array over the group's ranks at its owner only (a reduce-scatter by tensor).

    Args:
      comm: the group communicator; every rank passes the same names, shapes and dtypes.
      local: name -> this rank's float32 (or any dtype) host array.
      owner: name -> group rank that receives the sum.
      tag: message tag (the same on every rank of one call).
      timeout: seconds to wait for a peer (None: the communicator's default).

    Returns:
      name -> the sum over the group's ranks (in group-rank order) for names this rank owns, None
      for the others.

    Raises:
      the communicator's CommError / CommTimeoutError.
    """
    me, size = comm.rank, comm.size
    names = sorted(local)
    mine = [n for n in names if owner(n) == me]
    sends = []
    for dst in range(size):
        if dst == me:
            continue
        theirs = [n for n in names if owner(n) == dst]
        for _, ns in _by_dtype(theirs, local).items():
            sends.append(comm.isend(_pack(ns, local), dst, tag))
    out: dict[str, np.ndarray | None] = {n: None for n in names}
    for _, ns in _by_dtype(mine, local).items():
        parts = {}
        for src in range(size):
            if src != me:
                buf = np.empty(sum(int(np.prod(local[n].shape)) for n in ns), local[ns[0]].dtype)
                parts[src] = comm.irecv(src, tag, out=buf)
        total = None
        for src in range(size):  # group-rank order: the same sum on any owner
            part = _pack(ns, local) if src == me else parts[src].wait(timeout)
            # both buffers are this call's own (a fresh pack or receive buffer): the first is the running
            # sum itself, the others are added into it in place (the same additions in the same order)
            if total is None:
                total = part
            else:
                total += part
        _unpack(total, ns, local, out)
    for s in sends:
        s.wait(timeout)
    return out


def gather_from_owners(comm: Any, owned: Mapping[str, np.ndarray], like: Mapping[str, Any],
                       owner: Callable[[str], int], tag: int = GATHER_TAG,
                       timeout: float | None = None) -> dict[str, np.ndarray]:
    """Every rank gets every array from its owner (an all-gather by tensor).

    Args:
      comm: the group communicator.
      owned: name -> host array, for the names this rank owns (``owner(name) == comm.rank``).
      like: name -> anything with ``shape`` and ``dtype``, for EVERY name (the same on every rank).
      owner: name -> owning group rank.
      tag, timeout: as `reduce_to_owners`.

    Returns:
      name -> the owner's array, for the names this rank does not own.

    Raises:
      ValueError: if ``owned`` is not exactly this rank's names.
      the communicator's CommError / CommTimeoutError.
    """
    me, size = comm.rank, comm.size
    names = sorted(like)
    mine = [n for n in names if owner(n) == me]
    if sorted(owned) != mine:
        raise ValueError(f"rank {me} owns {mine[:4]}... ({len(mine)}), was given {sorted(owned)[:4]}... "
                         f"({len(owned)})")
    sends = [comm.isend(_pack(ns, owned), dst, tag)
             for dst in range(size) if dst != me for _, ns in _by_dtype(mine, owned).items()]
    out: dict[str, np.ndarray] = {}
    for src in range(size):
        if src == me:
            continue
        theirs = [n for n in names if owner(n) == src]
        dtypes = {n: np.dtype(like[n].dtype) for n in theirs}
        for dt in sorted(set(dtypes.values()), key=lambda d: d.name):
            ns = [n for n in theirs if dtypes[n] == dt]
            buf = np.empty(sum(int(np.prod(like[n].shape)) for n in ns), dt)
            _unpack(comm.irecv(src, tag, out=buf).wait(timeout), ns, like, out)
    for s in sends:
        s.wait(timeout)
    return out
