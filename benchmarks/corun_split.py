"""A stage call beside the other island's call: neighbour as a THREAD of this process against a separate PROCESS
(issue 13, diagnostic).

    PYTHONPATH=. python benchmarks/corun_split.py --neighbour thread [--repeats 20]
    PYTHONPATH=. python benchmarks/corun_split.py --neighbour process [--repeats 20]

The calls of ``benchmarks/predictor_accuracy.py``'s ``pp2_1f1b_m4`` (tiny model, seq 64, microbatch 1): the first
stage (layers 0-2, embedding) F and B on one fake CPU device (``hethub_jax.profile._stage_call``, as the profiler
times them), each timed alternately alone and beside the neighbour: the last stage (layers 3-5, LM head) fused
F+B, started when the timed call starts (a pipeline's phase, docs/benchmarks.md issue 13 session 12 s12-corun),
run by a second thread of this process (``thread``: as the benchmark's islands) or by a second process (``process``:
as islands under mpiexec; a pipe carries the start and end; both processes unpinned, sharing the cores), or only
the runtime's idle loop (``poll``: a thread sleeping 0.2 ms between checks, as ``PipelineRuntime``'s executor waits
when no stage can advance). And
the neighbour's fused F+B timed the other way round (beside the first stage's F then B started with it). Prints
medians of wall seconds alone / beside and their ratio, and the CPU seconds of this process per timed call
(``time.process_time``) alone / beside (in ``process`` mode the neighbour's CPU is not included). The steady
host allocator is set at import (``HETHUB_HOST_ALLOCATOR=default`` for glibc's own). Diagnostic only.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
                           " --xla_cpu_multi_thread_eigen=false").strip()
from hethub_jax import host_allocator  # noqa: E402

host_allocator.steady_host_allocator()


def _stages(layers: int = 3):
    import jax

    from hethub_jax.models.config import get_preset
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    from hethub_jax.profile import _stage_call
    cfg, tx = get_preset("tiny"), make_optimizer(OptimConfig())
    d = jax.devices()
    L = cfg.num_hidden_layers
    first = PipelineStage(cfg, 0, layers - 1, [d[0]], 1, 1, seed=0, recompute=False, optimizer=tx)
    last = PipelineStage(cfg, L - layers, L - 1, [d[1]], 1, 1, seed=0, recompute=False, optimizer=tx)
    return {"first_F": _stage_call(first, cfg, 64, "F"), "first_B": _stage_call(first, cfg, 64, "B")}, \
        {"last_FB": _stage_call(last, cfg, 64, "B_recompute")}


def child() -> None:
    """The neighbour process: runs the requested call on b'L' (last_FB) / b'S' (first F then B), answers b'd'."""
    small, large = _stages(int(os.environ.get("CORUN_SPLIT_LAYERS", "3")))
    for f in (*small.values(), *large.values()):
        f()
    sys.stdout.buffer.write(b"r")
    sys.stdout.flush()
    while True:
        c = sys.stdin.buffer.read(1)
        if not c or c == b"q":
            return
        for f in (large.values() if c == b"L" else small.values()):
            f()
        sys.stdout.buffer.write(b"d")
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--neighbour", choices=("thread", "process", "poll"), default="thread")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers", type=int, default=3,
                    help="layers per stage (3: the pipeline's pp2 stages; 1: the profiler's measure_corun stages)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child()
    os.environ["CORUN_SPLIT_LAYERS"] = str(args.layers)
    small, large = _stages(args.layers)
    for f in (*small.values(), *large.values()):
        f()
    if args.neighbour == "poll":
        # the idle island of the runtime: PipelineRuntime's _StepExecutor._wait sleeps 0.2 ms between checks of its
        # awaited messages while no stage can advance (threads of one process: it wakes on these cores)
        polling, box = threading.Event(), {"n": 0}

        def loop():
            while True:
                polling.wait()
                if box.get("quit"):
                    return
                time.sleep(0.0002)
                box["n"] += 1  # the check (a few attribute reads in the runtime)
        th = threading.Thread(target=loop, daemon=True)
        th.start()

        def start(kind):
            if kind == b"q":
                box["quit"] = True
            polling.set()

        def wait():
            polling.clear()
    elif args.neighbour == "process":
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT))
        assert p.stdout.read(1) == b"r"

        def start(kind):
            p.stdin.write(kind)
            p.stdin.flush()

        def wait():
            assert p.stdout.read(1) == b"d"
    else:
        go, done, box = threading.Event(), threading.Event(), {}

        def loop():
            while True:
                go.wait()
                go.clear()
                k = box["k"]
                if k == b"q":
                    return
                for f in (large.values() if k == b"L" else small.values()):
                    f()
                done.set()
        th = threading.Thread(target=loop, daemon=True)
        th.start()

        def start(kind):
            box["k"] = kind
            done.clear()
            go.set()

        def wait():
            done.wait()
    wall, cpu = {}, {}
    for i in range(2 * args.repeats):
        busy = i % 2 == 1
        for timed, nb in ((small, b"L"), (large, b"S")):
            for name, fn in timed.items():
                if busy:
                    start(nb)
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall.setdefault((name, busy), []).append(time.perf_counter() - t0)
                cpu.setdefault((name, busy), []).append(time.process_time() - c0)
                if busy:
                    wait()
                time.sleep(0.002)
    start(b"q")
    if args.neighbour == "process":
        p.wait(10)
    med = lambda xs: sorted(xs)[(len(xs) - 1) // 2]
    if args.neighbour == "poll":
        print(f"poll wake-ups {box['n']} over the beside calls")
    print(f"layers per stage {args.layers}, neighbour {args.neighbour}, allocator "
          f"{os.environ.get(host_allocator.ENV, 'steady')}, repeats "
          f"{args.repeats}, load {os.getloadavg()[0]:.2f}:")
    for name in (*small, *large):
        a, b = med(wall[(name, False)]), med(wall[(name, True)])
        print(f"  {name:8s} wall alone {1e3 * a:6.2f} beside {1e3 * b:6.2f} ms = {b / a:4.2f}x   "
              f"CPU alone {1e3 * med(cpu[(name, False)]):6.2f} beside {1e3 * med(cpu[(name, True)]):6.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
