"""Diagnostic (issue 17): the profile's whole-stage F and B seconds against the same stage's F and B
actions in a training step, in one process on one pinned core (same-run ratios; a loaded machine's
wall seconds are compared only inside one run, with each call's minor page faults beside them, ``getrusage``).

    PYTHONPATH=. python benchmarks/stage_shape_vs_run.py --json OUT.json [--core 1] [--mb 8] [--m 6]
        [--layers 0-7] [--schedule gpipe] [--rounds 3] [--allocator early|late] [--others N]

Variants, measured in interleaved rounds on the SAME ``PipelineStage`` (the runtime's own stage):
  ``profile``  ``hethub_jax.profile.measure_stage`` (what ``--stage-shapes`` records: each call alone,
               the residuals of one forward dropped before the next, B on one saved set into a fresh
               gradient buffer);
  ``run``      ``PipelineRuntime.train_step`` of a one-island, one-stage plan (``--schedule``, ``--m``
               microbatches of ``--mb``): each F and B action's record (``ActionRecord``);
  ``held``     the stage's jitted calls in GPipe order without the runtime: ``m`` forwards keeping
               every residual set alive, then ``m`` backwards accumulating into one donated buffer
               (what a GPipe step holds and does);
  ``alone``    the same calls one microbatch at a time (F then B, one residual set alive), the
               accumulator donated as in ``held``.
``--allocator late`` reproduces the conditions before session 12 (glibc arenas per XLA thread: every
backward re-faulted ~37,000 pages at microbatch 8; docs/benchmarks.md issue 17).
Output: per variant and phase the median wall seconds and minor page faults per call (``run``: faults per step), and per action index
(F0..F{m-1}, B0..B{m-1}) for ``run`` and ``held``. Seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

MODEL = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512,
         "tie_word_embeddings": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--core", type=int, default=None, help="pin to this core (default: no pinning)")
    ap.add_argument("--mb", type=int, default=8, help="microbatch size (rows)")
    ap.add_argument("--m", type=int, default=6, help="microbatches per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", default="0-7", help="the stage's layers FIRST-LAST")
    ap.add_argument("--schedule", default="gpipe")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="profile,run,held,alone")
    ap.add_argument("--others", type=int, default=0,
                    help="also hold N other one-stage runtimes of the model (alternately 1F1B and GPipe at a global "
                         "batch of 8 microbatches, as hetero_e2e's alone contenders) and run one step of each before "
                         "every measured variant: the benchmark's process interleaves its contenders' steps")
    ap.add_argument("--allocator", choices=("early", "late"), default="early",
                    help="early: hethub_jax.host_allocator's steady settings before JAX starts (as the profiler, "
                         "training and the benchmarks' ranks do); late: only PipelineRuntime's call, after the "
                         "backend started, when glibc's per-thread arenas are already taken (before session 12)")
    args = ap.parse_args()
    if args.allocator == "early":
        from hethub_jax.host_allocator import steady_host_allocator
        steady_host_allocator()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import jax
    import jax.numpy as jnp
    import numpy as np
    jax.devices()  # the backend starts here (its threads take their glibc arenas)

    from hethub_jax.data import DataConfig, build_datasets
    from hethub_jax.models.config import LlamaConfig
    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.runtime import PipelineRuntime
    from hethub_jax.parallel.stage import StageInputs
    from hethub_jax.profile import _inputs, measure_stage

    cfg = LlamaConfig(**MODEL)
    fl, ll = (int(x) for x in args.layers.split("-"))
    plan = Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu", "num_processes": 1,
                                        "devices_per_process": 1}],
                           "stages": [{"island": "fast", "first_layer": fl, "last_layer": ll}],
                           "global_batch_size": args.mb * args.m, "microbatch_size": args.mb,
                           "schedule": args.schedule, "seq_len": args.seq})
    train, _, _ = build_datasets(DataConfig(seq_len=args.seq))
    rt = PipelineRuntime(plan, cfg, OptimConfig(learning_rate=1e-3, warmup_steps=2, decay_steps=1000), seed=0)
    st = rt.stages[(0, 0)]
    others = []
    for j in range(args.others):
        other = dict(plan.to_dict(), schedule=("1f1b", "gpipe")[j % 2], global_batch_size=args.mb * 8)
        other.pop("description", None)
        others.append(PipelineRuntime(Plan.from_dict(other), cfg, OptimConfig(learning_rate=1e-3, warmup_steps=2,
                                                                               decay_steps=1000), seed=0))
    other_batch = next(train.batches(args.mb * 8)) if others else None
    it = train.batches(args.mb * args.m)
    batch = next(it)
    no = np.bool_(False)
    tokens, pos_h, mask, x_dev = _inputs(st, cfg, args.mb, args.seq)

    def inputs():
        x = st.place_tokens(tokens) if st.is_first else x_dev
        extra = (st.place_tokens(tokens), st.place_tokens(mask)) if st.is_last else (None, None)
        return StageInputs(x, st.place_tokens(pos_h), *extra)
    g = jnp.ones((), jnp.float32) if st.is_last else jax.device_put(
        jnp.ones((args.mb, args.seq, cfg.hidden_size), cfg.dtype), st.act_sharding)

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def timed(fn):
        f0, w0 = faults(), time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        return out, time.perf_counter() - w0, faults() - f0

    def held():
        """GPipe order on the stage's calls: m forwards holding residuals, m backwards into one acc."""
        rec, saved, acc = [], [], st.new_grad_buffer()
        for i in range(args.m):
            (out, res), w, c = timed(lambda: st.forward_saving(st.params, inputs()))
            saved.append(res)
            rec.append((f"F{i}", w, c))
        for i in range(args.m):
            gr, w, c = timed(lambda: st.backward_saved(saved[i], g, acc, np.bool_(i == 0)))
            acc = gr.acc
            saved[i] = None
            rec.append((f"B{i}", w, c))
        return rec

    def alone():
        """One microbatch at a time: F then B (one residual set alive), one donated accumulator."""
        rec, acc = [], st.new_grad_buffer()
        for i in range(args.m):
            (out, res), w, c = timed(lambda: st.forward_saving(st.params, inputs()))
            rec.append((f"F{i}", w, c))
            gr, w, c = timed(lambda: st.backward_saved(res, g, acc, np.bool_(i == 0)))
            acc = gr.acc
            del res
            rec.append((f"B{i}", w, c))
        return rec

    def run():
        f0 = faults()
        res = rt.train_step(batch)
        return [(r.action, r.end_s - r.start_s, None) for r in res.records
                if r.action[:1] in ("F", "B")] + [("step", res.step_time_s, faults() - f0)]

    def profile():
        f0 = faults()
        out = measure_stage(st, cfg, args.mb, args.seq, 3)
        return [(k, v, None) for k, v in out.items()] + [("profile_total", 0.0, faults() - f0)]

    variants = {"profile": profile, "run": run, "held": held, "alone": alone}
    chosen = [v for v in args.variants.split(",") if v]
    for o in others:
        o.train_step(other_batch)
    for v in chosen:  # compile and warm every call once
        variants[v]()
    got = {v: [] for v in chosen}
    for r in range(args.rounds):
        for v in chosen[r % len(chosen):] + chosen[:r % len(chosen)]:
            for o in others:
                o.train_step(other_batch)
            got[v].append(variants[v]())
            print(f"round {r} {v}: " + " ".join(f"{k}={w:.3f}" + (f"/{c}flt" if c is not None else "") for k, w, c in got[v][-1]), flush=True)
    summary = {}
    for v, rounds in got.items():
        by = {}
        for rec in rounds:
            for k, w, c in rec:
                by.setdefault(k, []).append((w, c))
        per = {k: {"wall_s": float(np.median([w for w, _ in xs])),
                   "minor_faults": (float(np.median([c for _, c in xs])) if xs[0][1] is not None else None)}
               for k, xs in by.items()}
        for ph in ("F", "B"):
            keys = [k for k in by if k[:1] == ph and k[1:].isdigit()]
            if keys:
                per[f"mean_{ph}"] = {"wall_s": float(np.mean([per[k]["wall_s"] for k in keys])),
                                     "minor_faults": (float(np.mean([per[k]["minor_faults"] for k in keys]))
                                                      if per[keys[0]]["minor_faults"] is not None else None)}
        summary[v] = per
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    out = {"benchmark": "stage_shape_vs_run", "args": vars(args), "loadavg_end": load,
           "note": "one pinned core; loaded shared machine: compare variants of this run only", "summary": summary}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    for v, per in summary.items():
        print(v, {k: round(x["wall_s"], 4) for k, x in per.items() if k.startswith(("mean", "F", "B", "step"))})


if __name__ == "__main__":
    main()
