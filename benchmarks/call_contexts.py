"""The pp2 row's stage calls in three contexts, interleaved in one process (issue 13, diagnostic).

    PYTHONPATH=. python benchmarks/call_contexts.py [--rounds 5] [--steps 3]

The calls of ``benchmarks/predictor_accuracy.py``'s ``pp2_1f1b_m4`` (tiny model, seq 64, microbatch 1; first stage
layers 0-2 F and B, last stage 3-5 fused F+B), per call, in each round:

* ``alone``: as the profiler times them (``hethub_jax.profile.measure_stage``, ``--repeats`` calls back to back,
  the median);
* ``one island``: the records of a ONE-island ``PipelineRuntime`` running the same two stages (one thread, two
  devices, no second island, nothing co-runs);
* ``two islands``: the records of the benchmark's two-island run (one thread per island, ``LocalCommunicator``).

Per round the median step's mean record seconds per call of each kind (F of the first stage, B of the first stage,
fused F+B of the last stage), and each context over ``alone`` of the same round. If the one-island records are
above ``alone`` by as much as the two-island ones, the missing seconds are in the runtime's calls, not in the
co-run. Diagnostic only; wall times, so compare the ratios within a round on a loaded machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
import benchmarks.predictor_accuracy as pa  # noqa: E402  (XLA flags and the steady allocator first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per runtime and round")
    ap.add_argument("--repeats", type=int, default=7, help="alone calls per kind and round")
    args = ap.parse_args()
    import jax

    from hethub_jax import profile
    from hethub_jax.comm import LocalCommunicator
    from hethub_jax.models.config import get_preset
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.runtime import PipelineRuntime
    from hethub_jax.parallel.stage import PipelineStage
    from hethub_jax.planner.accuracy import action_kind
    cfg, seq, devs = get_preset("tiny"), 64, jax.devices()
    tx = make_optimizer(OptimConfig())
    first = PipelineStage(cfg, 0, 2, [devs[0]], 1, 1, seed=0, recompute=False, optimizer=tx)
    last = PipelineStage(cfg, 3, 5, [devs[1]], 1, 1, seed=0, recompute=False, optimizer=tx)
    plan2, batch = pa.plan_and_batch("pp2_1f1b_m4", cfg, seq)
    one = dict(pa.configs()["pp2_1f1b_m4"])
    one["islands"] = one["islands"][:1]
    one["stages"] = [dict(s, island="a") for s in one["stages"]]
    plan1 = Plan.from_dict(one).validate(cfg)
    rt1 = PipelineRuntime(plan1, cfg, OptimConfig(), seed=0, devices=devs[:4])
    comms = LocalCommunicator.create(2, timeout=600)
    rt2 = [None, None]

    def build(r):  # the runtimes' constructors meet in a collective: one thread each
        rt2[r] = PipelineRuntime(plan2, cfg, OptimConfig(), seed=0, comm=comms[r], rank=r,
                                 devices=devs[4 * r:4 * r + 4])
    ts = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()

    def per_call(records) -> dict:
        acc = {}
        for r in records:
            kind = action_kind(r.action)
            key = {("0", "F"): "first_F", ("0", "B"): "first_B", ("1", "F"): "last_FB"}.get((str(r.stage), kind))
            if key:
                acc.setdefault(key, []).append(r.end_s - r.start_s)
        return {k: sum(v) / len(v) for k, v in acc.items()}

    def two_step():
        out = [None, None]

        def body(r):
            out[r] = rt2[r].train_step(batch)
        ts = [threading.Thread(target=body, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return max(o.step_time_s for o in out), out[0].records + out[1].records

    def one_step():
        res = rt1.train_step(batch)
        return res.step_time_s, res.records
    for _ in range(2):  # compile, warm up
        one_step()
        two_step()
    kinds = ("first_F", "first_B", "last_FB")
    rows = []
    for rnd in range(args.rounds):
        alone = {"first_F": profile.measure_stage(first, cfg, 1, seq, args.repeats)["F"],
                 "first_B": profile.measure_stage(first, cfg, 1, seq, args.repeats)["B"],
                 "last_FB": profile.measure_stage(last, cfg, 1, seq, args.repeats)["B_recompute"]}
        ctx = {}
        for name, fn in (("one island", one_step), ("two islands", two_step)):
            steps = sorted((fn() for _ in range(args.steps)), key=lambda x: x[0])
            ctx[name] = (steps[(len(steps) - 1) // 2][0], per_call(steps[(len(steps) - 1) // 2][1]))
        rows.append((alone, ctx))
        print(f"round {rnd + 1} (load {os.getloadavg()[0]:.2f}): step one island {1e3 * ctx['one island'][0]:.1f} ms, "
              f"two islands {1e3 * ctx['two islands'][0]:.1f} ms", flush=True)
        for k in kinds:
            a = alone[k]
            print(f"  {k:8s} alone {1e3 * a:6.2f} ms   one island {1e3 * ctx['one island'][1][k]:6.2f} "
                  f"({ctx['one island'][1][k] / a:4.2f}x)   two islands {1e3 * ctx['two islands'][1][k]:6.2f} "
                  f"({ctx['two islands'][1][k] / a:4.2f}x)", flush=True)
    med = lambda xs: sorted(xs)[(len(xs) - 1) // 2]
    print("median over rounds of the ratio to alone:")
    for k in kinds:
        print(f"  {k:8s} one island {med([c['one island'][1][k] / a[k] for a, c in rows]):4.2f}x   two islands "
              f"{med([c['two islands'][1][k] / a[k] for a, c in rows]):4.2f}x")


if __name__ == "__main__":
    main()
