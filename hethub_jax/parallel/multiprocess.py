"""Host access to arrays of a stage whose mesh spans several processes of one island (issue 15).

An island of several processes is one ``jax.distributed`` runtime (``hethub_jax.cluster.start``);
a stage's ``Mesh(('dp', 'tp'))`` may then hold devices of several processes, and its arrays are not
fully addressable: ``np.asarray`` / ``jax.device_get`` of them raise. These helpers read what this
process holds (its addressable shards) and build global arrays from per-process data, so no process
places the whole batch on every device. Every function here also works on fully addressable arrays
(one process), where it equals the plain host copy or ``device_put``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np


def spans_processes(devices: Sequence[Any]) -> bool:
    """True if ``devices`` belong to more than one JAX process."""
    return len({d.process_index for d in devices}) > 1


def host_copy(x: Any) -> np.ndarray:
    """The whole value of ``x`` as a numpy array, from this process's addressable shards.

    For a parameter or gradient of a multi-process stage (replicated over ``dp``, TP inside each
    process) every process holds every element. Raises ValueError if this process's shards do not
    cover the whole array (e.g. a batch-sharded activation: use ``local_rows``)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    out = np.empty(x.shape, x.dtype)
    seen = np.zeros(x.shape, bool) if x.ndim else np.zeros((), bool)
    for s in x.addressable_shards:
        out[s.index] = np.asarray(s.data)
        seen[s.index] = True
    if not seen.all():
        raise ValueError(f"this process holds only part of an array of shape {x.shape} "
                         f"(sharding {x.sharding}); read its rows with local_rows")
    return out


def local_rows(x: Any, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` (first dimension) of ``x`` that this process holds, C-contiguous.

    Raises:
      ValueError: if this process's shards do not cover those rows.
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.ascontiguousarray(np.asarray(jax.device_get(x))[start:stop])
    out = np.empty((stop - start,) + tuple(x.shape[1:]), x.dtype)
    seen = np.zeros(stop - start, bool)
    for s in x.addressable_shards:
        r = s.index[0]
        lo, hi = r.start or 0, x.shape[0] if r.stop is None else r.stop
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            out[a - start:b - start] = np.asarray(s.data)[a - lo:b - lo]
            seen[a - start:b - start] = True
    if not seen.all():
        raise ValueError(f"this process does not hold rows {start}:{stop} of an array of shape {x.shape}")
    return out


def place_rows(local: np.ndarray, start: int, global_shape: tuple, sharding: Any) -> jax.Array:
    """A global array of ``global_shape`` on ``sharding`` (split on the first dimension) from the
    rows ``[start, start + len(local))`` this process holds: each addressable device gets its slice of
    ``local`` only (``jax.make_array_from_callback``).

    Raises:
      ValueError: if a device of this process needs rows outside ``local``.
    """
    n = local.shape[0]

    def piece(index: tuple) -> np.ndarray:
        r = index[0]
        lo, hi = r.start or 0, global_shape[0] if r.stop is None else r.stop
        if lo < start or hi > start + n:
            raise ValueError(f"a device needs rows {lo}:{hi}; this process holds {start}:{start + n}")
        return local[(slice(lo - start, hi - start),) + tuple(index[1:])]
    return jax.make_array_from_callback(tuple(global_shape), sharding, piece)


def place_global(x: np.ndarray, sharding: Any) -> jax.Array:
    """``x`` (the same whole value on every process) on ``sharding``; each device receives only its
    own slice (``jax.make_array_from_callback``)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def scalar(x: Any) -> float:
    """A replicated scalar's value (one addressable copy when the array spans processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return float(np.asarray(x.addressable_data(0)))
    return float(x)


class PartsReceive:
    """Receives of the parts of one message (rows from several processes) into one buffer.

    Args:
      buf: the receive buffer of this process's rows.
      handles: the communicator's receive handles, each writing a row slice of ``buf``.

    ``test()`` is True once every part arrived; ``wait()`` waits for all and returns ``buf``.
    """

    def __init__(self, buf: np.ndarray, handles: list):
        self.buf, self.handles = buf, list(handles)

    def test(self) -> bool:
        return all(h.test() for h in self.handles)

    def wait(self, timeout: float | None = None) -> np.ndarray:
        for h in self.handles:
            h.wait(timeout) if timeout is not None else h.wait()
        return self.buf


def warm_up_collectives(mesh: Any) -> None:
    """Create now the CPU collectives' (gloo) communicators of a stage mesh that spans processes.

    Gloo makes the communicator of a group of devices at the group's first collective and waits at
    most 30 s for every process of the group to arrive there (the key-value lookup in XLA's gloo
    collectives; JAX 0.10 exposes no setting for it). Inside a training step the processes of an
    island can reach that first collective far apart: each waits for its own pipeline input, and on
    a busy machine compiles at its own pace. Every process of the island therefore runs this small
    program right after building its stages (same order on all of them, SPMD; the caller puts a
    barrier before it): a sum over the whole ``(dp, tp)`` mesh and one over ``dp`` alone, so that
    the groups the stage programs use exist before the first step. XLA reuses a communicator for the
    same group of devices in later programs.

    Args:
      mesh: the stage's ``Mesh(('dp', 'tp'))``.
    """
    from jax.sharding import NamedSharding, PartitionSpec as P

    dp, tp = mesh.devices.shape
    x = jax.make_array_from_callback((dp, tp), NamedSharding(mesh, P("dp", "tp")),
                                     lambda index: np.ones((1, 1), np.float32))
    sums = jax.jit(lambda a: (a.sum(), a.sum(axis=0)),
                   out_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("tp"))))
    jax.block_until_ready(sums(x))

