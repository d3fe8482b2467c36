"""The pipeline runtime's training step against a plain `jax.jit` training step (issue 4).

    PYTHONPATH=. python benchmarks/runtime_overhead.py --json runtime_overhead.json

One island, one stage (the whole model on one CPU device): `PipelineRuntime.train_step` against
`hethub_jax.reference.ReferenceTrainer.train_step` (value_and_grad + optax clip + AdamW in one
`jax.jit`), same model, seed, optimizer and real-data batches, in the same process. Both are warmed
up (compiled) first; then the contenders run in interleaved repetitions (the order rotates every
repetition) on the same batch, so that load drifting on a shared machine hits them alike. Times are
wall-clock around the public `train_step` call, which returns host floats on both sides (so both
include the device->host sync of the loss).

Rows: the runtime with 1 microbatch (the same work as the plain step: this row gives the goal figure
`ratio_vs_plain_jit` = median runtime step / median plain step, goal <= 1.05) and with 4 microbatches
(for information: 4 smaller forward/backward calls with gradient accumulation).

`--profile` adds a breakdown of the runtime's step with 1 microbatch (host-side phases timed by
wrapping the runtime's and stage's methods; see `docs/benchmarks.md`).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from benchmarks.common import (command_line, loadavg, machine, median, training_parser,  # noqa: E402
                               write_json)


def make_plan(gbs: int, microbatches: int, layers: int):
    from hethub_jax.parallel.plan import Plan

    return Plan.from_dict({
        "description": "runtime_overhead: one island, one stage, one device",
        "islands": [{"name": "main", "platform": "cpu", "num_processes": 1, "devices_per_process": 1}],
        "stages": [{"island": "main", "dp": 1, "tp": 1, "first_layer": 0, "last_layer": layers - 1}],
        "global_batch_size": gbs, "microbatch_size": gbs // microbatches,
        "schedule": "1f1b", "recompute": "none"})


def profile_runtime(rt, batches, reps: int) -> dict[str, float]:
    """Median seconds per step of the runtime's phases (1 stage), by wrapping its methods."""
    import jax

    st = rt.stages[rt.local_keys[0]]
    acc: dict[str, float] = {}

    def timed(name, fn, sync=False):
        def w(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if sync:
                jax.block_until_ready(out)
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
            return out
        return w

    names = [n for n in ("forward_saving", "forward_backward", "forward_backward_update", "backward_saved",
                         "update", "new_grad_buffer", "place_tokens", "flat") if hasattr(st, n)]
    orig = {n: getattr(st, n) for n in names + ["sq_norm"]}
    orig_rt = {n: getattr(rt, n) for n in ("_run", "_reduce_shared", "_check_batch", "_emulate")}
    # the F/B calls return once enqueued (dispatch only); update and sq_norm are waited for
    for n in names:
        setattr(st, n, timed(n + {"forward_saving": "(dispatch)", "forward_backward": "(dispatch)",
                                  "forward_backward_update": "(dispatch)", "backward_saved": "(dispatch)",
                                  "update": "(dispatch+compute)"}.get(n, ""),
                             orig[n], sync=(n == "update")))
    st.sq_norm = timed("sq_norm(dispatch+compute)", orig["sq_norm"], sync=True)
    # ... and the waits: _emulate blocks on each compute action's result
    rt._emulate = timed("block_until_ready(after F/B)", orig_rt["_emulate"])
    rt._run = timed("_run(total)", orig_rt["_run"])
    rt._reduce_shared = timed("_reduce_shared", orig_rt["_reduce_shared"])
    rt._check_batch = timed("_check_batch", orig_rt["_check_batch"])
    steps, rows = [], []
    try:
        for i in range(reps):
            acc.clear()
            t0 = time.perf_counter()
            rt.train_step(batches[i % len(batches)])
            steps.append(time.perf_counter() - t0)
            rows.append(dict(acc))
    finally:
        for n, f in orig.items():
            setattr(st, n, f)
        for n, f in orig_rt.items():
            setattr(rt, n, f)
    out = {"step(total)": median(steps)}
    for k in sorted({k for r in rows for k in r}):
        out[k] = median([r.get(k, 0.0) for r in rows])
    return out


def main() -> None:
    ap = training_parser(__doc__, batch=8, warmup=3)
    ap.add_argument("--reps", type=int, default=25, help="interleaved timed repetitions per contender")
    ap.add_argument("--microbatches", default="1,4", help="runtime rows: microbatch counts (first: goal row)")
    ap.add_argument("--no-unfused", dest="unfused", action="store_false",
                    help="leave out the row with both fusions (last-stage forward+backward, one-stage "
                         "update) switched off")
    ap.add_argument("--profile", action="store_true", help="also break the 1-microbatch runtime step down")
    args = ap.parse_args()

    import jax
    import numpy as np

    from hethub_jax.data import DataConfig, build_datasets
    from hethub_jax.models.config import PRESETS
    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel.runtime import PipelineRuntime
    from hethub_jax.reference import ReferenceTrainer

    load_start = loadavg()
    config = PRESETS[args.preset]
    optim = OptimConfig(learning_rate=1e-3, warmup_steps=2, decay_steps=1000)
    train, _, _ = build_datasets(DataConfig(seq_len=args.seq))
    it = train.batches(args.batch)
    batches = [next(it) for _ in range(args.reps + args.warmup)]
    mbs = [int(m) for m in args.microbatches.split(",")]

    contenders = {"plain_jit": ReferenceTrainer(config, optim, seed=0)}
    for m in mbs:
        contenders[f"runtime_mb{m}"] = PipelineRuntime(make_plan(args.batch, m, config.num_hidden_layers),
                                                     config, optim, seed=0)
    if args.unfused and hasattr(contenders[f"runtime_mb{mbs[0]}"], "fuse_last_stage"):
        # the same runtime with separate forward (saving vjp residuals) and backward jits on the last stage
        rt = PipelineRuntime(make_plan(args.batch, mbs[0], config.num_hidden_layers), config, optim, seed=0)
        rt.fuse_last_stage = False
        contenders[f"runtime_mb{mbs[0]}_unfused"] = rt

    def step(name, batch):
        c = contenders[name]
        t0 = time.perf_counter()
        if name == "plain_jit":
            loss = c.train_step(batch)[0]
        else:
            loss = c.train_step(batch).loss
        return time.perf_counter() - t0, loss

    compile_s, losses = {}, {n: [] for n in contenders}
    for name in contenders:  # compile + warm-up
        t0 = time.perf_counter()
        step(name, batches[0])
        compile_s[name] = time.perf_counter() - t0
        for i in range(1, args.warmup):
            step(name, batches[i])
    times = {n: [] for n in contenders}
    names = list(contenders)
    for rep in range(args.reps):
        b = batches[args.warmup + rep]
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            dt, loss = step(name, b)
            times[name].append(dt)
            losses[name].append(loss)
    load_end = loadavg()

    tokens = float(args.batch * args.seq)
    plain = median(times["plain_jit"])
    rows = [{"contender": "plain_jit", "microbatches": 1, "median_step_s": plain,
             "min_step_s": min(times["plain_jit"]), "tokens_per_s": tokens / plain, "ratio_vs_plain_jit": 1.0,
             "paired_ratio_median": 1.0, "compile_and_first_step_s": compile_s["plain_jit"],
             "step_times_s": times["plain_jit"]}]
    for n in [c for c in contenders if c != "plain_jit"]:
        m = int(n.split("_mb")[1].split("_")[0])
        t = median(times[n])
        rows.append({"contender": n, "microbatches": m, "median_step_s": t, "min_step_s": min(times[n]),
                     "tokens_per_s": tokens / t, "ratio_vs_plain_jit": t / plain,
                     "paired_ratio_median": median([a / b for a, b in zip(times[n], times["plain_jit"])]),
                     "compile_and_first_step_s": compile_s[n], "step_times_s": times[n]})
    # sanity: both train the same model on the same batches (same losses up to fp reordering)
    loss_gap = max(abs(a - b) for a, b in zip(losses["plain_jit"], losses[f"runtime_mb{mbs[0]}"]))
    goal_row = rows[1]
    figures = {
        "ratio_vs_plain_jit": round(goal_row["ratio_vs_plain_jit"], 4),
        "goal": 1.05,
        "goal_met": goal_row["ratio_vs_plain_jit"] <= 1.05,
        "paired_ratio_median": round(goal_row["paired_ratio_median"], 4),
        "ratio_of_min_step": round(goal_row["min_step_s"] / rows[0]["min_step_s"], 4),
        "runtime_median_step_s": goal_row["median_step_s"],
        "plain_jit_median_step_s": plain,
        "runtime_tokens_per_s": goal_row["tokens_per_s"],
        "plain_jit_tokens_per_s": tokens / plain,
        **{f"ratio_vs_plain_jit_{r['contender'][8:]}": round(r["ratio_vs_plain_jit"], 4) for r in rows[2:]},
        "max_abs_loss_gap_runtime_vs_plain": loss_gap,
    }
    result = {
        "benchmark": "runtime_overhead",
        "command": command_line(),
        "machine": dict(machine(), loadavg_start=load_start, loadavg_end=load_end),
        "config": {"preset": args.preset, "model": config.to_dict() if hasattr(config, "to_dict") else repr(config),
                   "global_batch": args.batch, "seq_len": args.seq, "tokens_per_step": int(tokens),
                   "reps": args.reps, "warmup": args.warmup, "microbatches": mbs, "data": "real corpus (train split)",
                   "devices": 1, "schedule": "1f1b", "recompute": "none",
                   "timing": "wall clock around train_step, interleaved, order rotating per repetition"},
        "figures": figures,
        "rows": rows,
    }
    if args.profile:
        for n in [c for c in contenders if c != "plain_jit"]:
            result["profile_" + n[8:]] = profile_runtime(contenders[n], batches, max(5, args.reps // 2))
    write_json(args.json, result)

    print(f"runtime_overhead: {args.preset} model, batch {args.batch} x seq {args.seq}, 1 CPU device, "
          f"{args.reps} interleaved reps; load avg {load_start} -> {load_end}")
    print(f"{'contender':<22} {'mb':>3} {'median s':>9} {'min s':>8} {'tokens/s':>9} {'ratio':>6} {'paired':>6}")
    for r in rows:
        print(f"{r['contender']:<22} {r['microbatches']:>3} {r['median_step_s']:>9.4f} {r['min_step_s']:>8.4f} "
              f"{r['tokens_per_s']:>9.0f} {r['ratio_vs_plain_jit']:>6.3f} {r['paired_ratio_median']:>6.3f}")
    print(f"ratio_vs_plain_jit (1 microbatch) = {figures['ratio_vs_plain_jit']:.4f} "
          f"(goal <= 1.05: {'met' if figures['goal_met'] else 'NOT met'}); max |loss gap| {loss_gap:.2e}")
    for key in [k for k in result if k.startswith("profile_")]:
        print(f"{key} (median seconds per step):")
        for k, v in result[key].items():
            print(f"  {k:<32} {v * 1e3:8.2f} ms")
    del jax, np


if __name__ == "__main__":
    main()
