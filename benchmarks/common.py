"""Helpers shared by the benchmarks: relaunch under mpiexec, machine description, load average,
medians, JSON output. Imports no JAX (the MPI benchmarks pin cores before JAX starts)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
from typing import Any, Sequence

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine() -> dict[str, Any]:
    """Host, CPU count, platform and library versions (imports jax: call after any env set-up)."""
    import jax
    import numpy as np

    out = {"host": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform(),
           "python": platform.python_version(), "numpy": np.__version__, "jax": jax.__version__,
           "jax_devices": [str(d) for d in jax.devices()], "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
           "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        out["cpu_model"] = names[0] if names else ""
    except OSError:
        pass
    return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def command_line() -> str:
    return "python " + os.path.relpath(sys.argv[0], ROOT) + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")


def write_json(path: str, result: dict[str, Any]) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CHILD_ENV = "HETHUB_BENCH_CHILD"  # set in the ranks started by relaunch_under_mpiexec


def mpi_rank_from_env() -> int | None:
    """This process's MPI rank from the launcher's environment, or None outside mpiexec."""
    for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if k in os.environ:
            return int(os.environ[k])
    return None


def relaunch_under_mpiexec(script: str, argv: list[str], n: int = 2) -> None:
    """Replaces this process with `mpiexec -n n python script argv...` (mpiexec next to the Python
    executable, else on PATH), the repository on PYTHONPATH. Exits with a message if none is found."""
    exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = exe if os.path.exists(exe) else shutil.which("mpiexec")
    if exe is None:
        sys.exit("mpiexec not found next to the Python executable nor on PATH")
    env = dict(os.environ, **{CHILD_ENV: "1"})
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    os.execve(exe, [exe, "-n", str(n), sys.executable, os.path.abspath(script), *argv], env)


def bridge_world(n: int, what: str = "this benchmark") -> tuple[Any, Any, int, Any]:
    """Under mpiexec, for a benchmark of exactly ``n`` ranks: ``(MPI, comm, rank, bridge)`` = mpi4py's
    ``MPI`` module, ``MPI.COMM_WORLD``, this rank, and an ``MPIHostBridge`` over a duplicate of the
    world (120 s deadlines), so that the bridge's messages never match raw mpi4py ones on ``comm``.
    Exits with a message naming ``what`` when the job has another number of ranks."""
    from mpi4py import MPI

    from hethub_jax.comm.mpi import MPIHostBridge

    comm = MPI.COMM_WORLD
    if comm.Get_size() != n:
        sys.exit(f"{what} runs with exactly {n} ranks, not {comm.Get_size()}")
    return MPI, comm, comm.Get_rank(), MPIHostBridge(comm.Dup(), timeout=120)


XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"


def pin_and_limit_threads(rank: int) -> int | None:
    """Pins this process to core `rank`, asks XLA/OpenMP/BLAS for one thread and sets the steady host
    allocator (``hethub_jax.host_allocator``: one glibc arena, which must precede the JAX backend's
    threads), all before JAX starts."""
    from hethub_jax.host_allocator import steady_host_allocator
    steady_host_allocator()
    core = None
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        core = cpus[rank % len(cpus)]
        os.sched_setaffinity(0, {core})
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + XLA_ONE_THREAD).strip()
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(k, "1")
    return core


def start_pinned_rank(script: str, n: int = 2) -> tuple[int, int | None]:
    """Run by hand: relaunches ``script`` (with this process's arguments) under ``mpiexec -n n``.
    Under mpiexec: pins this rank to its own core (:func:`pin_and_limit_threads`) and returns
    ``(rank, core)``. Call before JAX is imported."""
    rank = mpi_rank_from_env()
    if os.environ.get(CHILD_ENV) is None and rank is None:
        relaunch_under_mpiexec(script, sys.argv[1:], n=n)
    rank = rank or 0
    return rank, pin_and_limit_threads(rank)


def training_parser(doc: str, *, batch: int, warmup: int, json_help: str = "output path"
                    ) -> argparse.ArgumentParser:
    """Argument parser with the flags every training benchmark shares: --json, --preset, --batch
    (global batch, rows), --seq (tokens per row), --warmup (untimed steps after compiling)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--json", required=True, help=json_help)
    ap.add_argument("--preset", default="tiny", help="model preset (hethub_jax.models.config.PRESETS)")
    ap.add_argument("--batch", type=int, default=batch, help="global batch size (rows)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length (tokens per row)")
    ap.add_argument("--warmup", type=int, default=warmup, help="untimed steps per contender after compiling")
    return ap


def time_reduce_shared(runtimes: Sequence[Any]) -> dict[str, float]:
    """Wraps each ``PipelineRuntime._reduce_shared`` (the gradient sums after the backward: the
    cross-replica all-reduce) so that its wall seconds add up in the returned ``{"t": seconds}``; the
    caller sets ``["t"] = 0.0`` before a step and reads it after."""
    import time
    acc_s = {"t": 0.0}
    for rt in runtimes:
        orig = rt._reduce_shared

        def timed(acc, _orig=orig):
            t0 = time.perf_counter()
            out = _orig(acc)
            acc_s["t"] += time.perf_counter() - t0
            return out
        rt._reduce_shared = timed
    return acc_s
