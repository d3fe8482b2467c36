"""Islands as threads of one process against islands as separate processes (issue 13, diagnostic).

    PYTHONPATH=. python benchmarks/island_modes.py pp2_1f1b_m4 --mode threads [--steps 8] [--json OUT]
    PYTHONPATH=. python benchmarks/island_modes.py pp2_1f1b_m4 --mode processes [--steps 8] [--json OUT]

Runs configurations of ``benchmarks/predictor_accuracy.py`` (``configs()``) with the real
``PipelineRuntime``, 4 fake CPU devices per island, one XLA compute thread per computation, the steady
host allocator (``hethub_jax.host_allocator``; ``HETHUB_HOST_ALLOCATOR=default`` for glibc's own):

* ``--mode threads``: as ``predictor_accuracy.measure_steps`` (one thread per island in this process,
  ``LocalCommunicator``);
* ``--mode processes``: one process per island under ``mpiexec -n 2`` (re-launched), NOT pinned (both
  processes may use both cores, as the threads do), joined by the MPI host bridge
  (``hethub_jax.comm.mpi.MPIHostBridge``, its waits polling without sleeping for ``--bridge-spin-s``, default its
  own 0.05 s) as ``hethub_jax.train`` runs islands: ``predictor_accuracy.measure_steps_mpi``, the benchmark's
  own islands-as-processes measurement.

Prints, per configuration, every timed step's slowest island (seconds), their minimum and median, the
CPU seconds of the island processes per timed step (``getrusage``, user + system: a count of work, less
moved by other processes on the machine than wall time), the minor page faults and the voluntary context
switches per step (``ru_nvcsw``: a thread that blocks, e.g. on a contended lock, counts one).
``ISLAND_MODES_ARENA_MAX=N`` sets glibc's ``M_ARENA_MAX`` to N after the steady settings (16: the settings
before session 12, threads with arenas of their own).
With ``--json`` the figures are written (rank 0). Diagnostic only: not a benchmark of record.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from benchmarks.common import CHILD_ENV, loadavg, mpi_rank_from_env, relaunch_under_mpiexec  # noqa: E402


def _cpu() -> tuple:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt, r.ru_nvcsw


#: ``ISLAND_MODES_ARENA_MAX=N``: M_ARENA_MAX N after the steady settings (before JAX starts its threads)
_ARENA_MAX = int(os.environ.get("ISLAND_MODES_ARENA_MAX", "0"))


def _kinds(records) -> dict:
    """Seconds per ``island/stage/kind`` (F, B, SEND, RECV) summed over one step's records."""
    from hethub_jax.planner.accuracy import action_kind
    out = {}
    for r in records:
        k = f"{r.island}/{r.stage}/{action_kind(r.action)}"
        out[k] = out.get(k, 0.0) + (r.end_s - r.start_s)
    return out


def _merge(dicts) -> dict:
    out = {}
    for d in dicts:
        out.update(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", help="comma-separated names of predictor_accuracy configs()")
    ap.add_argument("--mode", choices=("threads", "processes"), required=True)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the compiling one")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bridge-spin-s", type=float, default=0.05,
                    help="--mode processes: seconds the MPI bridge's waits poll without sleeping (MPIHostBridge.with_spin; "
                         "its default 0.05)")
    args = ap.parse_args()
    if args.mode == "processes" and mpi_rank_from_env() is None and os.environ.get(CHILD_ENV) is None:
        relaunch_under_mpiexec(__file__, sys.argv[1:], n=2)
    if args.mode == "processes":
        # each process holds one island's 4 devices (before predictor_accuracy sets 8)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=4").strip()
    import benchmarks.predictor_accuracy as pa  # noqa: F401  (XLA flags, steady allocator before JAX)
    if _ARENA_MAX:  # e.g. 16: the steady settings without the one-arena limit (the runtime before session 12)
        import ctypes
        assert ctypes.CDLL("libc.so.6").mallopt(-8, _ARENA_MAX) == 1  # M_ARENA_MAX
    import jax

    from hethub_jax.models.config import get_preset
    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel.runtime import PipelineRuntime
    cfg = get_preset("tiny")
    out = {}
    for name in args.configs.split(","):
        plan, batch = pa.plan_and_batch(name, cfg, args.seq)
        n_steps = 1 + args.warmup + args.steps
        if args.mode == "threads":
            from hethub_jax.comm import LocalCommunicator
            comms = LocalCommunicator.create(2, timeout=600)
            devs, barrier = jax.devices(), threading.Barrier(2)
            res = [[None] * 2 for _ in range(n_steps)]
            marks = {}

            def body(rank):
                rt = PipelineRuntime(plan, cfg, OptimConfig(), seed=0, comm=comms[rank], rank=rank,
                                     devices=devs[rank * 4:(rank + 1) * 4])
                for i in range(n_steps):
                    barrier.wait()
                    if rank == 0:
                        marks.setdefault(i, _cpu())
                    r = rt.train_step(batch)
                    res[i][rank] = (r.step_time_s, _kinds(r.records))
                barrier.wait()
                if rank == 0:
                    marks[n_steps] = _cpu()
            ts = [threading.Thread(target=body, args=(r,)) for r in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            c0, c1 = marks[1 + args.warmup], marks[n_steps]
            cpu_s, faults, vcsw = c1[0] - c0[0], c1[1] - c0[1], c1[2] - c0[2]
            timed = res[1 + args.warmup:]
            steps = [max(x[0] for x in row) for row in timed]
            kinds = [_merge(x[1] for x in row) for row in timed]
        else:  # one process per island: predictor_accuracy's islands as processes
            r = pa.measure_steps_mpi(plan, cfg, args.seq, args.steps, args.warmup, spin_s=args.bridge_spin_s,
                                     all_records=True)
            if r is None:
                continue
            rank, steps, kinds = 0, r["steps_s"], [_kinds(x) for x in r["steps_records"]]
            cpu_s, faults, vcsw = (r[k] * args.steps for k in ("cpu_s_per_step", "faults_per_step",
                                                               "voluntary_switches_per_step"))
        s = sorted(steps)
        row = {"mode": args.mode, "steps_s": steps, "min_s": s[0], "median_s": s[(len(s) - 1) // 2],
               "cpu_s_per_step": cpu_s / args.steps, "faults_per_step": faults / args.steps,
               "voluntary_switches_per_step": vcsw / args.steps, "arena_max": _ARENA_MAX,
               "loadavg": loadavg(), "allocator": os.environ.get("HETHUB_HOST_ALLOCATOR", "steady"),
               "time": time.strftime("%H:%M:%S", time.gmtime()),
               # per island/stage/action kind: the median over timed steps of the step's summed record seconds
               "kinds_ms": {k: 1e3 * sorted(d.get(k, 0.0) for d in kinds)[(len(kinds) - 1) // 2]
                            for k in sorted(set().union(*kinds))}}
        out[name] = row
        print(f"{name} {args.mode} [{row['allocator']}]: min {1e3 * row['min_s']:.1f} median "
              f"{1e3 * row['median_s']:.1f} ms  cpu/step {1e3 * row['cpu_s_per_step']:.1f} ms  faults/step "
              f"{row['faults_per_step']:.0f}  vol. switches/step {row['voluntary_switches_per_step']:.0f}  arenas "
              f"{_ARENA_MAX or 'steady'}  steps " + " ".join(f"{1e3 * x:.0f}" for x in steps)
              + f"  load {row['loadavg']}\n    " + "  ".join(f"{k} {v:.1f}" for k, v in row["kinds_ms"].items()),
              flush=True)
    if args.json and (args.mode == "threads" or mpi_rank_from_env() == 0):
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
