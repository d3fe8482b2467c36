"""Where the seconds of the tail after the pipelines go, per island and part (issue 13).

    PYTHONPATH=. python benchmarks/tail_split.py pp2_1f1b_m4,pp2_dp2_1f1b_m4 [--steps 8] [--json PATH]

Runs configurations of ``benchmarks/predictor_accuracy.py`` (``configs()``) as that benchmark does
(one thread per island, ``LocalCommunicator``, 4 fake CPU devices per island) and splits each island's
tail (from the end of ``PipelineRuntime._run`` to the end of ``train_step``) into the runtime's parts,
in the order it runs them:

- ``host_copy``: ``multiprocess.host_copy`` calls inside ``_reduce_shared`` (the shared gradient to the
  host, float32);
- ``allreduce``: ``Communicator.allreduce_tree`` of the shared gradients over the holders' islands, with
  ``allreduce_wait`` (seconds until the LAST island entered it: waiting for the other island) and
  ``allreduce_own`` (the rest: concatenation, the sum, the copies of ``LocalCommunicator``);
- ``placement``: ``jax.device_put`` calls inside ``_reduce_shared`` (every leaf of every local stage's
  gradient tree back on its sharding), with ``placement_calls``;
- ``reduce_other``: the rest of ``_reduce_shared`` (buckets' join, ``flat`` / ``unflat``, float32 casts);
- ``norm``: each stage's ``sq_norm`` and the read of its scalar (``multiprocess.scalar``);
- ``world``: the world all-reduce of ``[loss, sq, bubble terms]`` (waits for the other island), with
  ``world_wait`` as above, and the loss scalars' reads before it (``loss``);
- ``update_dispatch``: the stages' jitted updates (asynchronous) and emulated waits (``_apply_updates``);
- ``update_block``: ``block_until_ready`` of the parameters (the update's compute not yet done).

Also ``join`` / ``flat`` / ``unflat`` / ``asarray`` (inside ``_reduce_shared``), ``bubble`` (the measured
bubble's terms), ``acc_ready`` (``--sync-acc``: waiting for the accumulated gradients first) and
``update_lock_wait`` (``--serial-update`` / ``--alternate``: the updates one island at a time).
Per part the wall seconds and the island thread's CPU seconds (``time.thread_time``; XLA computes on
its own threads, not counted there). Prints the medians over the timed steps (the first 2 untimed).
Diagnostic only: it wraps private methods of ``hethub_jax.parallel.runtime`` and module functions
(``jax.device_put``, ``multiprocess.host_copy`` / ``scalar``), which a change of the runtime can break.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
import benchmarks.predictor_accuracy as pa  # noqa: E402  (sets the XLA flags first)

PARTS = ("acc_ready", "join", "flat", "asarray", "unflat", "host_copy", "allreduce", "allreduce_wait",
         "allreduce_own", "placement", "reduce_other", "norm", "loss", "world", "world_wait", "update_lock_wait", "update_dispatch", "update_block", "bubble", "tail")


def same_run_profile(cfg, devices, repeats: int) -> dict:
    """The profile's tail figures in this process now (seconds): ``shared_sum`` fit (``c_bytes``,
    ``c_tensor``), ``norm`` line, ``update_cold`` per parameter, ``bridge_8mb`` (2-thread all-reduce of
    the tied embedding's float32 gradient), ``update_first`` / ``update_last`` (pp2's stages 0-2 and
    3-5, back to back, alone) and ``corun_update`` (the update pair factor)."""
    from hethub_jax import profile as P
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    ss = P.measure_shared_sum(cfg, devices[:2], repeats)
    out = {"shared_sum": P.fit_shared_sum([x for x in ss if x["kind"] == "shared_sum"]),
           "norm": P.fit_line([x["params"] for x in ss if x["kind"] == "norm"],
                              [x["seconds"] for x in ss if x["kind"] == "norm"]),
           "update_cold": P.fit_update_cold([x for x in ss if x["kind"] == "update_in_step"]),
           "shared_sum_samples": ss}
    nb = 4 * cfg.vocab_size * cfg.hidden_size
    out["bridge_8mb"] = P.measure_local_bridge([nb], repeats)[0]["seconds"]
    tx, L = make_optimizer(OptimConfig()), cfg.num_hidden_layers
    for name, lo, hi, d in (("update_first", 0, L // 2 - 1, devices[0]), ("update_last", L // 2, L - 1, devices[4])):
        st = PipelineStage(cfg, lo, hi, [d], 1, 1, seed=0, recompute=False, optimizer=tx)
        out[name] = P.measure_update(st, repeats)
        out[name + "_params"] = int(sum(v.size for v in st.flat().values()))
    out["corun_update"] = P.fit_corun_update(P.measure_update_pair(cfg, devices[:2], repeats))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", help="comma-separated names of predictor_accuracy configs()")
    ap.add_argument("--steps", type=int, default=8, help="steps per configuration (the first 2 untimed)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sample")
    ap.add_argument("--sync-acc", action="store_true",
                    help="wait for the accumulated gradients before _reduce_shared (acc_ready: the pipeline's "
                         "computations still running when _run returns)")
    ap.add_argument("--same-run", type=int, default=0, metavar="REPEATS",
                    help="then, in the same process, time what the profile times for the tail (REPEATS each): "
                         "the gradient sums in one island (profile.measure_shared_sum), the 2-thread bridge at the "
                         "tied embedding's bytes, the pp2 stages' updates back to back (alone) and the update pair")
    ap.add_argument("--serial-update", action="store_true",
                    help="the islands' updates one at a time (a lock, each to its result; update_lock_wait): the "
                         "update as the runtime runs it, without the other island's update beside it")
    ap.add_argument("--alternate", action="store_true",
                    help="odd steps as --serial-update, even steps as the runtime runs them (interleaved A/B "
                         "in one process: the update's in-place co-run factor at the same load)")
    ap.add_argument("--json", help="write the per-step parts here")
    args = ap.parse_args()
    if args.steps < 3:
        raise SystemExit("--steps must be >= 3")
    import jax
    import numpy as np

    from hethub_jax.comm import LocalCommunicator
    from hethub_jax.comm.base import Communicator
    from hethub_jax.models.config import get_preset
    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel import multiprocess as mp
    from hethub_jax.parallel import runtime as R
    from hethub_jax.parallel.stage import PipelineStage
    tl = threading.local()
    entries = {}  # (step, call name) -> {rank: entry perf_counter}
    lock = threading.Lock()

    def add(part, wall, cpu):
        if getattr(tl, "parts", None) is not None:
            tl.parts[part][0] += wall
            tl.parts[part][1] += cpu

    def timed(part, fn, inside=None):
        def w(*a, **kw):
            if getattr(tl, "parts", None) is None or (inside and not getattr(tl, inside, False)):
                return fn(*a, **kw)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                add(part, time.perf_counter() - t0, time.thread_time() - c0)
                if part == "placement":
                    tl.parts["placement_calls"][0] += 1
        return w

    def entered(name):
        with lock:
            entries.setdefault((tl.step, name), {})[tl.rank] = time.perf_counter()

    orig = {"run": R.PipelineRuntime._run, "reduce": R.PipelineRuntime._reduce_shared,
            "world": R.PipelineRuntime._allreduce_world, "apply": R.PipelineRuntime._apply_updates,
            "art": Communicator.allreduce_tree, "loss": R.PipelineRuntime._loss_sum}

    def run(self, *a, **kw):
        out = orig["run"](self, *a, **kw)
        if getattr(tl, "parts", None) is not None:
            tl.t_run_end, tl.c_run_end = time.perf_counter(), time.thread_time()
        return out

    def reduce(self, acc):
        t0, c0 = time.perf_counter(), time.thread_time()
        if args.sync_acc:  # the pipeline's last computations still running when _run returns
            jax.block_until_ready(acc)
            add("acc_ready", time.perf_counter() - t0, time.thread_time() - c0)
        tl.in_reduce = True
        try:
            return orig["reduce"](self, acc)
        finally:
            tl.in_reduce = False
            add("reduce_total", time.perf_counter() - t0, time.thread_time() - c0)

    def art(self, tree, *a, **kw):
        if getattr(tl, "parts", None) is None:
            return orig["art"](self, tree, *a, **kw)
        entered("art")
        t0, c0 = time.perf_counter(), time.thread_time()
        out = orig["art"](self, tree, *a, **kw)
        add("allreduce", time.perf_counter() - t0, time.thread_time() - c0)
        tl.art_t0 = t0
        return out

    def world(self, x):
        if getattr(tl, "parts", None) is None:
            return orig["world"](self, x)
        entered("world")
        t0, c0 = time.perf_counter(), time.thread_time()
        out = orig["world"](self, x)
        add("world", time.perf_counter() - t0, time.thread_time() - c0)
        tl.world_t0 = t0
        return out

    def sq(fn):  # a stage's jitted sq_norm, to its result (the runtime reads the scalar at once)
        def w(*a, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            v = jax.block_until_ready(fn(*a, **kw))
            add("norm", time.perf_counter() - t0, time.thread_time() - c0)
            return v
        return w

    upd_lock = threading.Lock()

    def apply(self, *a, **kw):
        # one island's update at a time, to its result: the update without its co-run
        if args.serial_update or (args.alternate and tl.step % 2 == 1):
            w0 = time.perf_counter()
            with upd_lock:
                add("update_lock_wait", time.perf_counter() - w0, 0.0)
                t0, c0 = time.perf_counter(), time.thread_time()
                out = orig["apply"](self, *a, **kw)
                jax.block_until_ready([self._stages[k].params for k in self.local_keys])
        else:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = orig["apply"](self, *a, **kw)
        add("update_dispatch", time.perf_counter() - t0, time.thread_time() - c0)
        tl.t_apply_end, tl.c_apply_end = time.perf_counter(), time.thread_time()
        return out

    def loss(self, *a, **kw):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = orig["loss"](self, *a, **kw)
        add("loss", time.perf_counter() - t0, time.thread_time() - c0)
        return out
    R.PipelineRuntime._run, R.PipelineRuntime._reduce_shared = run, reduce
    R.PipelineRuntime._allreduce_world, R.PipelineRuntime._apply_updates = world, apply
    R.PipelineRuntime._loss_sum = loss
    Communicator.allreduce_tree = art
    mp.host_copy = timed("host_copy", mp.host_copy, inside="in_reduce")
    R.jnp.asarray = timed("asarray", R.jnp.asarray, inside="in_reduce")
    R.PipelineRuntime._join_buckets = timed("join", R.PipelineRuntime._join_buckets, inside="in_reduce")
    PipelineStage.flat = timed("flat", PipelineStage.flat, inside="in_reduce")
    PipelineStage.unflat = timed("unflat", PipelineStage.unflat, inside="in_reduce")
    jax.device_put = timed("placement", jax.device_put, inside="in_reduce")
    R.bubble_terms = timed("bubble", R.bubble_terms)  # the measured bubble's terms from the step's records
    R.bubble_from_terms = timed("bubble", R.bubble_from_terms)
    cfg = get_preset("tiny")
    report = {}
    for name in args.configs.split(","):
        plan, batch = pa.plan_and_batch(name, cfg, args.seq)
        n, gbs, seq = len(plan.islands), plan.global_batch_size, args.seq
        comms = LocalCommunicator.create(n, timeout=600)
        devs, barrier = jax.devices(), threading.Barrier(n)
        res = [[None] * n for _ in range(args.steps)]
        entries.clear()

        def body(rank):
            rt = R.PipelineRuntime(plan, cfg, OptimConfig(), seed=0, comm=comms[rank], rank=rank,
                                   devices=devs[rank * pa.DEVICES_PER_ISLAND:(rank + 1) * pa.DEVICES_PER_ISLAND])
            tl.rank = rank
            for st_ in rt._stages.values():
                st_.sq_norm = sq(st_.sq_norm)
            for i in range(args.steps):
                barrier.wait()
                tl.step = i
                tl.parts = collections.defaultdict(lambda: [0.0, 0.0])
                tl.art_t0 = tl.world_t0 = None
                t0 = time.perf_counter()
                out = rt.train_step(batch)
                t1, c1 = t0 + out.step_time_s, time.thread_time()
                p = tl.parts
                p["update_block"] = [t1 - tl.t_apply_end, c1 - tl.c_apply_end]
                p["tail"] = [t1 - tl.t_run_end, c1 - tl.c_run_end]
                rr = p["reduce_total"]
                p["reduce_other"] = [rr[j] - sum(p[x][j] for x in ("acc_ready", "host_copy", "allreduce", "placement",
                                                                   "asarray", "join", "flat", "unflat"))
                                     for j in (0, 1)]
                res[i][rank] = {"step_s": out.step_time_s, "parts": {k: list(v) for k, v in p.items()},
                                "art_t0": tl.art_t0, "world_t0": tl.world_t0, "run_end": tl.t_run_end}
                tl.parts = None
        threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, row in enumerate(res):  # waits: until the last island entered the collective
            for name_, key in (("art", "allreduce"), ("world", "world")):
                e = entries.get((i, name_))
                for rank, x in enumerate(row):
                    if e and rank in e:
                        wait = max(e.values()) - e[rank]
                        x["parts"][f"{key}_wait"] = [wait, 0.0]
                        x["parts"][f"{key}_own"] = [x["parts"][key][0] - wait, x["parts"][key][1]]
        timed_rows = res[2:]
        if args.alternate:
            import numpy as _np
            for mode, par in (("together", 0), ("one at a time", 1)):
                rows = [row for i, row in enumerate(res) if i >= 2 and i % 2 == par]
                upd = {plan.islands[r].name: float(_np.median([row[r]["parts"]["update_dispatch"][0]
                                                                + row[r]["parts"]["update_block"][0] for row in rows]))
                       for r in range(n)}
                tail = {plan.islands[r].name: float(_np.median([row[r]["parts"]["tail"][0] for row in rows]))
                        for r in range(n)}
                step = float(_np.median([max(x["step_s"] for x in row) for row in rows]))
                print(f"  updates {mode}: step {1e3 * step:.1f} ms, update per island (to its result) "
                      + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in upd.items()) + " ms, tail "
                      + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in tail.items()) + " ms")
                report.setdefault(name + "_alternate", {})[mode] = {"step_s": step, "update_s": upd, "tail_s": tail}
        out = {}
        print(f"{name}: steps " + ", ".join(f"{1e3 * max(x['step_s'] for x in row):.1f}" for row in timed_rows)
              + f" ms (load {os.getloadavg()[0]:.1f})")
        for rank in range(n):
            isl = plan.islands[rank].name
            med = {k: [float(np.median([row[rank]["parts"].get(k, [0.0, 0.0])[j] for row in timed_rows]))
                       for j in (0, 1)] for k in PARTS + ("placement_calls", "reduce_total")}
            out[isl] = med
            print(f"  island {isl}: " + "  ".join(f"{k} {1e3 * v[0]:.2f}/{1e3 * v[1]:.2f}" if k != "placement_calls"
                                                 else f"{k} {v[0]:.0f}" for k, v in med.items()), flush=True)
        report[name] = {"median_ms": {i: {k: [1e3 * v[0], 1e3 * v[1]] for k, v in m.items()} for i, m in out.items()},
                        "steps": [[{k: v for k, v in x.items()} for x in row] for row in timed_rows]}
    if args.same_run:
        report["same_run_profile"] = same_run_profile(cfg, jax.devices(), args.same_run)
        print("same-run profile parts (ms): " + json.dumps(
            {k: round(1e3 * v, 2) if isinstance(v, float) else v for k, v in report["same_run_profile"].items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
