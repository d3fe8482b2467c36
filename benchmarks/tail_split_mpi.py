"""Where the seconds of the tail after the pipeline go with the islands as PROCESSES (issue 13, diagnostic).

    PYTHONPATH=. mpiexec -n 2 python benchmarks/tail_split_mpi.py pp2_1f1b_m4 [--steps 8] [--sync-acc]

Runs one configuration of ``benchmarks/predictor_accuracy.py`` (``configs()``) as that benchmark measures it
with ``--islands processes`` (:func:`benchmarks.predictor_accuracy.measure_steps_mpi`: rank i runs island i, the
MPI host bridge between them, its waits sleeping: spin 0) and splits each island's tail (from the end of
``PipelineRuntime._run`` to the end of ``train_step``) into the runtime's parts, in the order it runs them:
``acc_ready`` (``--sync-acc``: the pipeline's last computations still running when ``_run`` returns),
``reduce`` (``_reduce_shared``: the tied embedding's gradient sum over the bridge), ``bridge`` (its
``allreduce_tree`` calls inside it, from entry; ``bridge_wait``: until the LAST island entered, on the one
``perf_counter`` clock of the host), ``norm`` (each stage's ``sq_norm`` and the read of its scalar), ``loss``,
``world`` (the world all-reduce of loss and squared norm; ``world_wait`` as above), ``update`` (``_apply_updates``:
the jitted updates, emulated waits and ZeRO-1's parameter exchange) and ``block`` (``block_until_ready`` of the
parameters after it). Wall seconds, medians over the timed steps. Wraps private methods of
``hethub_jax.parallel.runtime`` (a change of the runtime can break it): a diagnostic, not a benchmark figure.
Compare with the predictor's ``allreduce_s`` (sums + norm + bridge) and ``update_s``, printed beside.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
import benchmarks.predictor_accuracy as pa  # noqa: E402  (sets the XLA flags and the host allocator first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", help="a predictor_accuracy configs() name")
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the compiling one")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--sync-acc", action="store_true", help="wait for the accumulated gradients before _reduce_shared")
    ap.add_argument("--profile", default=None, help="a profile JSON: print the PREDICTED tail parts beside")
    args = ap.parse_args()
    import jax
    import numpy as np
    from mpi4py import MPI

    from hethub_jax.comm.base import Communicator
    from hethub_jax.models.config import get_preset
    from hethub_jax.parallel import multiprocess as mp
    from hethub_jax.parallel import runtime as R
    from hethub_jax.parallel.plan import Plan
    world = MPI.COMM_WORLD
    steps = []  # per train_step: {part: seconds} and entry stamps
    cur = {}
    orig = {"run": R.PipelineRuntime._run, "reduce": R.PipelineRuntime._reduce_shared,
            "world": R.PipelineRuntime._allreduce_world, "apply": R.PipelineRuntime._apply_updates,
            "art": Communicator.allreduce_tree, "loss": R.PipelineRuntime._loss_sum,
            "train_step": R.PipelineRuntime.train_step, "scalar": mp.scalar}

    def add(part, t):
        cur[part] = cur.get(part, 0.0) + t

    def train_step(self, batch):
        cur.clear()
        t0 = time.perf_counter()
        out = orig["train_step"](self, batch)
        t1 = time.perf_counter()
        add("tail", t1 - cur.get("run_end", t1))
        if "apply_end" in cur:
            add("block", t1 - cur["apply_end"])
        cur["t0"], cur["t1"] = t0, t1
        steps.append(dict(cur))
        return out

    def run(self, *a, **kw):
        out = orig["run"](self, *a, **kw)
        cur["run_end"] = time.perf_counter()
        return out

    def reduce(self, acc):
        t0 = time.perf_counter()
        if args.sync_acc:
            jax.block_until_ready(acc)
            add("acc_ready", time.perf_counter() - t0)
        t1 = time.perf_counter()
        out = orig["reduce"](self, acc)
        add("reduce", time.perf_counter() - t1)
        cur["norm_t0"] = time.perf_counter()
        return out

    def art(self, tree, *a, **kw):
        t0 = time.perf_counter()
        cur.setdefault("bridge_entries", []).append(t0)
        out = orig["art"](self, tree, *a, **kw)
        add("bridge", time.perf_counter() - t0)
        return out

    def loss(self, *a, **kw):
        t0 = time.perf_counter()
        add("norm", t0 - cur.pop("norm_t0", t0))  # sq_norm of every stage and its scalar's read, before the loss
        out = orig["loss"](self, *a, **kw)
        add("loss", time.perf_counter() - t0)
        return out

    def world_(self, x):
        t0 = time.perf_counter()
        cur["world_entry"] = t0
        out = orig["world"](self, x)
        add("world", time.perf_counter() - t0)
        return out

    def apply(self, *a, **kw):
        t0 = time.perf_counter()
        out = orig["apply"](self, *a, **kw)
        add("update", time.perf_counter() - t0)
        cur["apply_end"] = time.perf_counter()
        return out

    R.PipelineRuntime.train_step, R.PipelineRuntime._run = train_step, run
    R.PipelineRuntime._reduce_shared, R.PipelineRuntime._allreduce_world = reduce, world_
    R.PipelineRuntime._apply_updates, R.PipelineRuntime._loss_sum = apply, loss
    Communicator.allreduce_tree = art
    cfg = get_preset("tiny")
    plan = Plan.from_dict(pa.configs()[args.config]).validate(cfg)
    res = pa.measure_steps_mpi(plan, cfg, args.seq, args.steps, args.warmup, "median", spin_s=0.0)
    timed = steps[-args.steps:]
    both = world.gather(timed, root=0)
    if world.Get_rank() != 0:
        return
    names = [i.name for i in plan.islands]
    for s in range(args.steps):  # waits: until the last island entered the collective (one host clock)
        ent = [both[r][s].get("world_entry") for r in range(len(both))]
        br = [both[r][s].get("bridge_entries") or [] for r in range(len(both))]
        for r in range(len(both)):
            if None not in ent:
                both[r][s]["world_wait"] = max(ent) - ent[r]
            if all(len(b) == len(br[0]) and b for b in br):
                both[r][s]["bridge_wait"] = sum(max(b[j] for b in br) - br[r][j] for j in range(len(br[0])))
    parts = ("acc_ready", "reduce", "bridge", "bridge_wait", "norm", "loss", "world", "world_wait", "update",
             "block", "tail")
    step_ms = [1e3 * max(both[r][s]["t1"] - min(both[q][s]["t0"] for q in range(len(both))) for r in range(len(both)))
               for s in range(args.steps)]
    print(f"{args.config}: step median {np.median(step_ms):.1f} ms (load {os.getloadavg()[0]:.1f}; "
          f"measure_steps_mpi {1e3 * res['statistic_s']:.1f} ms)")
    for r, name in enumerate(names):
        med = {p: 1e3 * float(np.median([st.get(p, 0.0) for st in both[r]])) for p in parts}
        end = 1e3 * float(np.median([st["run_end"] - min(both[q][i]["t0"] for q in range(len(both)))
                                     for i, st in enumerate(both[r])]))
        print(f"  island {name}: pipeline end {end:.1f} ms; " + "  ".join(f"{p} {v:.2f}" for p, v in med.items()))
    if args.profile:  # the predictor's tail parts with the profile's bridge line (fits.bridge, else host_copy)
        from hethub_jax.planner.costs import DeviceCosts
        from hethub_jax.planner.predictor import predict
        costs = DeviceCosts.from_profile(args.profile).on_shared_host("this host")
        bridge = costs.bridge_link or costs.host_link
        p = predict(cfg, plan, {i.name: costs for i in plan.islands}, seq_len=args.seq, bridge=bridge)
        print(f"  PREDICTED (profile {args.profile}, bridge {'fits.bridge' if costs.bridge_link else 'host_copy'} "
              f"line): step {1e3 * p.step_time_s:.1f} ms, allreduce_s (sums + norm + bridge) "
              f"{1e3 * p.allreduce_s:.2f} ms, update_s {1e3 * p.update_s:.2f} ms")

if __name__ == "__main__":
    main()
