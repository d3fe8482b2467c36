"""Disjoint CPU cores for the CPU islands' processes of one host (plan-less training, issue 17).

On a real heterogeneous cluster every island owns its devices: one island's compute does not take
another's. CPU islands emulated on one machine share its cores instead: two unpinned processes each run
XLA's CPU thread pool over every core, so a profile taken by one process alone (every core free) times a
computation about twice as fast as the same computation while the other island computes (issue 17,
README's main command: PREDICTED/measured 0.52 on 2 cores). Pinning each MPI rank of the host to its own
equal share of the cores (``os.sched_setaffinity``, what ``taskset`` does; XLA's CPU thread pool is
sized by the cores a process may run on) gives every island cores of its own, as a real cluster gives it
devices, and the profile that rank 0 takes afterwards (a child process: it inherits the affinity) is
measured on the cores its island trains on. ``benchmarks/hetero_e2e.py`` pins its two ranks one core
each in the same way (``benchmarks/common.pin_and_limit_threads``).

Pure Python; call :func:`pin_local_rank` before the JAX backend starts (its thread pool is sized then).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence, Tuple

__all__ = ["local_rank_and_size", "island_cores", "pin_local_rank", "pin_threads", "profile_cores"]

#: (local rank, ranks on this host) variables of the MPI launchers: MPICH/Hydra, Open MPI, PMIx
LOCAL_RANK_ENV = (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
                  ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                  ("PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"))


def local_rank_and_size(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, int]]:
    """``(local rank, ranks on this host)`` from the MPI launcher's environment (``env``, default
    ``os.environ``; :data:`LOCAL_RANK_ENV`), or None when no launcher set both of one pair."""
    env = os.environ if env is None else env
    for rank_var, size_var in LOCAL_RANK_ENV:
        r, n = env.get(rank_var, ""), env.get(size_var, "")
        if r.isdigit() and n.isdigit() and 0 <= int(r) < int(n):
            return int(r), int(n)
    return None


def island_cores(local_rank: int, local_size: int, cpus: Sequence[int]) -> Optional[Tuple[int, ...]]:
    """The cores of local rank ``local_rank`` of ``local_size`` ranks on a host whose usable cores are
    ``cpus`` (ids): ``len(cpus) // local_size`` consecutive cores of the sorted ids each, in rank order
    (rank 0 the first share; the remainder, fewer than ``local_size`` cores, unused so that every
    island gets the same share). None when there are more ranks than cores (no disjoint share exists:
    the processes are left unpinned) or a single rank (nothing to share).

    Raises:
      ValueError: if ``local_rank`` is not in ``[0, local_size)``.
    """
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not in [0, {local_size})")
    ids = sorted(set(int(c) for c in cpus))
    if local_size < 2 or len(ids) < local_size:
        return None
    k = len(ids) // local_size
    return tuple(ids[local_rank * k:(local_rank + 1) * k])


def pin_local_rank(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Pins every thread of this process to this MPI rank's share of the host's cores
    (:func:`island_cores`; threads started later, e.g. XLA's pool and a profiling child process,
    inherit it). Returns a line saying what was done, or None when not under a multi-rank launcher.
    Never raises: where affinity cannot be set (not Linux) or there are more ranks than cores, the line
    says the processes share the cores and the PREDICTED step assumes otherwise."""
    where = local_rank_and_size(env)
    if where is None:
        return None
    rank, size = where
    if not hasattr(os, "sched_getaffinity"):
        return (f"local rank {rank}: not pinned (no CPU affinity on this system): the {size} island processes "
                f"share the cores, which the profile does not measure")
    cpus = sorted(os.sched_getaffinity(0))
    cores = island_cores(rank, size, cpus)
    if cores is None:
        return (f"local rank {rank}: not pinned ({size} island processes on {len(cpus)} cores: no disjoint "
                f"share each); they share the cores, which the profile does not measure")
    pin_threads(cores)
    return (f"local rank {rank}: pinned to core{'s' if len(cores) > 1 else ''} "
            f"{','.join(map(str, cores))} of {len(cpus)} (CPU islands of one host get disjoint cores, as "
            f"islands of a real cluster own their devices; the profile is measured on these cores)")


def pin_threads(cores: Sequence[int]) -> None:
    """Pins every thread of this process that exists now (a BLAS pool, MPI's, JAX's if started) and every
    thread or child process started later to ``cores`` (core ids; ``os.sched_setaffinity`` per thread of
    ``/proc/self/task``, since the call itself sets one thread's affinity only).

    Raises:
      OSError: if the calling thread cannot be pinned (no such core; not Linux: ``AttributeError``)."""
    cores = set(int(c) for c in cores)
    tids = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [str(0)]
    for tid in tids:  # every thread already started, not just the calling one
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass
    os.sched_setaffinity(0, cores)


def profile_cores(cpus: Sequence[int]) -> Tuple[int, int]:
    """``(profiler's core, co-run neighbour's core)`` of a profile PINNED as two island processes one core
    each (``python -m hethub_jax.profile --pin``): the first two of the sorted usable cores ``cpus``, as
    ``benchmarks/predictor_accuracy.py --pin`` pins island process ``i`` to core ``i``.

    Raises:
      ValueError: with fewer than 2 usable cores (no second core for the neighbour)."""
    ids = sorted(set(int(c) for c in cpus))
    if len(ids) < 2:
        raise ValueError(f"a pinned profile needs 2 usable cores (one per island process), this process may use "
                         f"{len(ids)}: {ids}")
    return ids[0], ids[1]
