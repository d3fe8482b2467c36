"""Per-phase timings of one heterogeneous-DP step on each rank (diagnostic for issue 17.5).

    PYTHONPATH=. python benchmarks/hetero_dp_phases.py --json hetero_dp_phases.json   # mpiexec -n 2

The set-up of `benchmarks/hetero_dp.py` (two CPU islands pinned to one core each, island `slow`
EMULATED 3x slower by sleeping 2x each compute action's measured time, `tiny`, global batch 16 in
microbatches of 4, shares 12/4). Configurations, interleaved step by step:
  - `unbucketed`: the all-reduce after the whole backward (training's default);
  - `bucketed`: the last backward in layer buckets, their all-reduce in a background thread
    (each bucket first waits, sleeping, until both replicas have it);
  - `bucketed_spin`: the same, the thread spinning (`spin_s`) from the start of each wait;
  - `chunked_deferred`: the same chunked last microbatch, but every bucket's reduction runs on the
    main thread after the backward (no background thread): separates the cost of chunking from the
    cost of the background thread's interference;
  - `alone`: each island alone on the rows of its share (as `hetero_dp.py`'s (c)), both at once.
Phases per rank and step (seconds, medians): `fb` (F/B actions, sleep included), `sleep` (emulated
wait), `compute` = fb - sleep, `d2h` (device->host copies of gradients), `bridge` (all-reduce calls),
`bg_cpu` (CPU time of the bucket thread), `cpu_process` / `cpu_main_thread` (CPU time of the
step), `reduce` (the runtime's `_reduce_shared`, after the
backward), `update` (optimizer update, emulated slowdown included), `step`.
"""

from __future__ import annotations

import os
import sys
import threading

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from benchmarks.common import start_pinned_rank, training_parser  # noqa: E402


class _Lazy:
    """A future that runs its function when its result is asked for (on the asking thread)."""

    def __init__(self, fn, args):
        self.fn, self.args, self.done, self.value = fn, args, False, None

    def result(self):
        if not self.done:
            self.value, self.done = self.fn(*self.args), True
        return self.value


class DeferredPool:
    def submit(self, fn, *args):
        return _Lazy(fn, args)


def main() -> None:
    ap = training_parser(__doc__, batch=16, warmup=2, json_help="output path (written by rank 0)")
    ap.add_argument("--microbatch", type=int, default=4)
    ap.add_argument("--slowdown", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--configs", default="unbucketed,bucketed,bucketed_spin,chunked_deferred")
    args = ap.parse_args()
    rank, core = start_pinned_rank(__file__)
    import time

    import jax

    from benchmarks.common import loadavg, median, write_json
    from benchmarks.hetero_dp import dp_plan, dp_setup
    from hethub_jax.parallel import buckets as bk
    from hethub_jax.parallel import multiprocess as mp
    from hethub_jax.parallel import runtime as rtm
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.runtime import PipelineRuntime

    load0 = loadavg()
    world, comm, config, optim, it = dp_setup(args)
    L = config.num_hidden_layers
    n_steps = args.warmup + args.steps + 1
    batches = [next(it) for _ in range(n_steps)]
    plan = Plan.from_dict(dp_plan(L, args.batch, args.microbatch, args.slowdown, throughputs=[args.slowdown, 1.0]))
    names = args.configs.split(",")
    rts = {n: PipelineRuntime(plan, config, optim, seed=0, comm=comm, rank=rank) for n in names if n != "alone"}
    shares = plan.batch_shares()
    if "alone" in names:  # this rank's island alone on its share's rows (as hetero_dp.py's (c))
        from benchmarks.hetero_dp import ISLANDS, alone_plan
        isl = dict(ISLANDS[rank], slowdown=1.0 if rank == 0 else args.slowdown)
        rts["alone"] = PipelineRuntime(Plan.from_dict(alone_plan(L, isl, shares[rank], args.microbatch)),
                                       config, optim, seed=0)
    for n in names:
        if n != "unbucketed":
            rts[n].set_grad_buckets(args.bucket_mb)
        if n == "bucketed_spin":
            rts[n].bucket_arrival_sleeps = False
    if "chunked_deferred" in rts:
        rts["chunked_deferred"]._bucket_pool = DeferredPool()

    ph = {}
    main_thread = threading.main_thread()

    def add(key, dt):
        t = "" if threading.current_thread() is main_thread else "bg_"
        ph[t + key] = ph.get(t + key, 0.0) + dt

    orig_wait = rtm.emulated_wait

    def wait(s):
        add("sleep", s)
        orig_wait(s)
    rtm.emulated_wait = wait
    orig_copy = mp.host_copy

    def host_copy(x):
        t0 = time.perf_counter()
        out = orig_copy(x)
        add("d2h", time.perf_counter() - t0)
        return out
    mp.host_copy = host_copy
    orig_reduce = bk.BucketedReduction._reduce

    def reduce(self, flats, raws):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        flats2 = []
        for f in flats:
            t = time.perf_counter()
            flats2.append({n: np.asarray(v) for n, v in f.items()})
            add("d2h", time.perf_counter() - t)
        out = orig_reduce(self, flats2, raws)
        add("bucket_job", time.perf_counter() - t0)
        add("cpu", time.thread_time() - c0)
        return out
    import numpy as np
    bk.BucketedReduction._reduce = reduce
    orig_tree = type(comm).allreduce_tree

    def allreduce_tree(self, tree, op="sum", **kw):
        t0 = time.perf_counter()
        out = orig_tree(self, tree, op, **kw)
        add("bridge", time.perf_counter() - t0)
        return out
    type(comm).allreduce_tree = allreduce_tree

    lo = sum(shares[:rank])
    alone_batches = [{k: v[lo:lo + shares[rank]] for k, v in b.items()} for b in batches]
    for n, rt in rts.items():
        for st in rt.stages.values():
            orig_sq = st.sq_norm

            def sq_norm(*a, _o=orig_sq):
                t0 = time.perf_counter()
                out = jax.block_until_ready(_o(*a))
                add("sq_norm", time.perf_counter() - t0)
                return out
            st.sq_norm = sq_norm
        for meth in ("_run", "_reduce_shared", "_forward_backward", "_allreduce_world", "_loss_sum"):
            orig = getattr(rt, meth)

            def timed(*a, _o=orig, _m=meth, **k):
                t0 = time.perf_counter()
                out = _o(*a, **k)
                add(_m, time.perf_counter() - t0)
                return out
            setattr(rt, meth, timed)

    results = {n: [] for n in names}
    for i in range(n_steps):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            ph.clear()
            world.Barrier()
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            res = rts[n].train_step(alone_batches[i] if n == "alone" else batches[i])
            step = time.perf_counter() - t0
            cpu, cpu_main = time.process_time() - c0, time.thread_time() - m0
            fb = sum(r.end_s - r.start_s for r in res.records if r.action[0] in "FB")
            d = dict(ph)
            d.update(step=step, fb=fb, cpu_process=cpu, cpu_main_thread=cpu_main, compute=fb - d.get("sleep", 0.0),
                     update=step - d.get("_forward_backward", 0.0))
            if i > args.warmup:
                results[n].append(d)
    load1 = loadavg()
    keys = sorted({k for rs in results.values() for r in rs for k in r})
    mine = {n: {k: median([r.get(k, 0.0) for r in rs]) for k in keys} for n, rs in results.items()}
    allr = world.gather(mine, root=0)
    if rank != 0:
        return
    print(f"load avg {load0} -> {load1}; medians of {args.steps} steps, seconds")
    print(f"{'phase':<18}" + "".join(f"{n[:10] + '/' + r[0]:>13}" for n in names for r in ("fast", "slow")))
    for k in keys:
        print(f"{k:<18}" + "".join(f"{allr[r][n].get(k, 0.0):>13.4f}" for n in names for r in (0, 1)))
    write_json(args.json, {"benchmark": "hetero_dp_phases", "loadavg": [load0, load1],
                           "figures": {n: {"fast": allr[0][n], "slow": allr[1][n]} for n in names}})


if __name__ == "__main__":
    main()
