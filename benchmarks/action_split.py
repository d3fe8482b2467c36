"""Where the wall seconds of each pipeline action go, per island, stage and action kind (issue 13).

    PYTHONPATH=. python benchmarks/action_split.py pp2_1f1b_m4,pp2_slow2_1f1b_m4 [--steps 5]

Runs configurations of ``benchmarks/predictor_accuracy.py`` (``configs()``) as that benchmark does
(one thread per island, ``LocalCommunicator``, 4 fake CPU devices per island) and splits every
action's record (``ActionRecord``: from before its dispatch to after its result and emulated wait)
into: ``thread_cpu`` (CPU seconds of the island's Python thread during it, ``time.thread_time``:
dispatch and bookkeeping; the computation runs on XLA's worker threads, not counted here),
``block`` (seconds waiting for the result, ``jax.block_until_ready`` in ``PipelineRuntime._emulate``),
``sleep req`` / ``sleep act`` (the emulated wait asked for and taken, ``runtime.emulated_wait``) and,
by difference, ``wait`` = wall - thread_cpu - block - sleep act: seconds the Python part of the action
waited for a core or the interpreter lock (other threads of the process, other processes). Prints the
sums of the fastest timed step (the first two steps are untimed: compilation, warm-up).

Diagnostic only: it wraps private methods of ``hethub_jax.parallel.runtime`` (``_StepExecutor._execute``,
``PipelineRuntime._emulate``, ``emulated_wait``), which a change of the runtime can break.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
import benchmarks.predictor_accuracy as pa  # noqa: E402  (sets the XLA flags first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", help="comma-separated names of predictor_accuracy configs()")
    ap.add_argument("--steps", type=int, default=5, help="steps per configuration (the first 2 untimed)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sample")
    args = ap.parse_args()
    if args.steps < 3:
        raise SystemExit("--steps must be >= 3")
    import jax
    import numpy as np

    from hethub_jax.comm import LocalCommunicator
    from hethub_jax.models.config import get_preset
    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel import runtime as R
    from hethub_jax.planner.accuracy import action_kind
    tl = threading.local()
    orig_wait, orig_emulate, orig_exec = R.emulated_wait, R.PipelineRuntime._emulate, R._StepExecutor._execute

    def wait(x):
        t0 = time.perf_counter()
        orig_wait(x)
        tl.sleep.append((x, time.perf_counter() - t0))

    def emulate(self, k, out, t0, bg0=None):
        w0 = time.perf_counter()
        jax.block_until_ready(out)
        tl.block += time.perf_counter() - w0
        return orig_emulate(self, k, out, t0, bg0)

    def execute(self, k, a, nxt):
        tl.sleep, tl.block, c0 = [], 0.0, time.thread_time()
        orig_exec(self, k, a, nxt)
        r = self.records[-1]
        tl.recs.append({"key": f"{r.island}/{r.stage}/{action_kind(r.action)}", "wall": r.end_s - r.start_s,
                        "thread_cpu": time.thread_time() - c0, "block": tl.block,
                        "sleep_req": sum(x for x, _ in tl.sleep), "sleep_act": sum(d for _, d in tl.sleep)})
    R.emulated_wait, R.PipelineRuntime._emulate, R._StepExecutor._execute = wait, emulate, execute
    cfg = get_preset("tiny")
    for name in args.configs.split(","):
        plan, batch = pa.plan_and_batch(name, cfg, args.seq)
        n, gbs, seq = len(plan.islands), plan.global_batch_size, args.seq
        comms = LocalCommunicator.create(n, timeout=600)
        devs, barrier = jax.devices(), threading.Barrier(n)
        res = [[None] * n for _ in range(args.steps)]

        def body(rank):
            rt = R.PipelineRuntime(plan, cfg, OptimConfig(), seed=0, comm=comms[rank], rank=rank,
                                   devices=devs[rank * pa.DEVICES_PER_ISLAND:(rank + 1) * pa.DEVICES_PER_ISLAND])
            for i in range(args.steps):
                barrier.wait()
                tl.recs = []
                out = rt.train_step(batch)
                res[i][rank] = (out.step_time_s, list(tl.recs))
        threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        timed = res[2:]
        best = min(timed, key=lambda row: max(x[0] for x in row))
        agg = collections.defaultdict(lambda: collections.defaultdict(float))
        for x in best:
            for r in x[1]:
                d = agg[r["key"]]
                d["n"] += 1
                for f in ("wall", "thread_cpu", "block", "sleep_req", "sleep_act"):
                    d[f] += r[f]
        print(f"{name}: steps " + ", ".join(f"{1e3 * max(x[0] for x in row):.1f}" for row in timed) + " ms")
        for key in sorted(agg):
            d = agg[key]
            other = d["wall"] - d["thread_cpu"] - d["block"] - d["sleep_act"]
            ms = {f: 1e3 * v for f, v in d.items()}
            print(f"  {key:12s} x{int(d['n']):<2d} wall {ms['wall']:7.2f}  thread_cpu {ms['thread_cpu']:6.2f}  "
                  f"block {ms['block']:7.2f}  sleep req {ms['sleep_req']:6.2f} act {ms['sleep_act']:6.2f}"
                  f"  wait {1e3 * other:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
