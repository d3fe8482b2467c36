"""End to end: the planner's plan on two CPU islands (one EMULATED 3x slower) against the upper bound (issue 17).

    PYTHONPATH=. python benchmarks/hetero_e2e.py --json hetero_e2e.json [--profiles DIR] [--timeline-png P]
    # re-launches itself: mpiexec -n 2 (rank 0 = island "fast", rank 1 = island "slow")

Two MPI ranks, each pinned to its own core (``os.sched_setaffinity``, what ``taskset`` does, before JAX
starts) with one XLA compute thread. Island "slow" carries ``"slowdown": 3.0``: an EMULATED speed
difference (DESIGN.md section 9), not two real accelerator types. The model (default) is Llama-shaped with
d_model 256, 8 layers, 4 heads / 4 KV heads, SwiGLU 768, vocabulary 32000 (tied): 15.0 M parameters, of
which 6.8 M in the layers; at 128-token sequences a microbatch's activation message between the islands
is 128 KiB per sample, small against its compute (compute dominates).

Measured in one run, interleaved step by step (rotating order, a barrier before every step; warm-up
steps excluded; medians):
  (a) ``alone``: each island trains alone (no communicator, both at once on their own cores) at its best
      homogeneous plan (the planner on that island alone) and, when it differs, at its best 1F1B plan
      (``alone1f1b``: every forward fused with its backward; the profile times each call on its own, so the
      planner's ranking of fused against unfused schedules can be off) and at its best plan at the
      planned plan's microbatch size (``alonemb``: the profile's lines cannot follow a per-token cost
      that rises with the size on a CPU core, so the planner's alone choice can be the slower one); the
      sum over the islands of each island's fastest measured variant is the upper bound;
  (b) ``planned``: the planner's best plan for the two islands (``hethub_jax.planner.search``);
  (c) ``uniform``: a pipeline with the layers split evenly (fast island first, the planner's microbatch,
      schedule and recompute for pipelines);
  (d) ``hetero_dp``: the planner's best heterogeneous data-parallel plan (one replica per island), its
      optimizer update sharded over the islands (ZeRO-1, the plan's default ``optimizer_sharding: auto``);
  (e) ``hetero_dp_replicated``: the same plan with ``optimizer_sharding: replicated`` (every island
      updates every parameter, the slow one EMULATED 3x: the path before session 10).
Costs for the planner and the prediction: ``--profile-islands``: each rank profiles its own island after
the pinning (``python -m hethub_jax.profile`` on this benchmark's model and sequence length, one device,
no emulated slowdown: the predictor applies the island's slowdown; one rank after the other, the other
waiting, since two at once ran out of host memory under one glibc arena; ``--profile-concurrently``: both
at once, as they train),
the whole model also measured as one stage (``--stage-shapes``: the shape of every one-stage replica,
predicted from those measured seconds; a stage's seconds per layer on a CPU core rise with its layers, which
the per-layer fits measured on 1- and 2-layer stages miss), the other rank's pid given (``--job-pids``: a
concurrent profile is not counted as other processes' load),
at microbatch sizes spanning every size the planner may choose (``--profile-mbs auto``: 1, 2, each power
of two below the global batch and the global batch, so no plan is predicted by extrapolating the fitted
lines beyond the profiled sizes), and the profiles are exchanged; else ``--profiles DIR``
(``<DIR>/cpu.json`` for both islands, made under the same pinning); else the device catalog's ``cpu``
entry (an assumption; said in the output and the JSON). A contender whose microbatch lies outside the
profiled sizes is said in the output (``EXTRAPOLATED``) and in ``figures.extrapolated``.
Since session 13, before planning: with ``--profile-islands --pool-stage-shapes`` both islands take the
mean of the two ranks' whole-stage figures (``pool_stage_shapes``: two cores of one type; default: each its
own); the two cores' co-run slowdown is MEASURED (``--corun measure``, default: each rank's whole-model
fused F+B alone and beside the other rank's, ``_measure_corun``) and both islands' costs are put on one
shared host with it (``DeviceCosts.on_shared_host``, ``corun_factor``), so that the predictor slows the part
of each compute action that overlaps the other island's compute (the profiles are taken one rank after the
other, beside an idle core); since session 14 the same pair also times the whole model's optimizer update
(``corun_update_factor``: the islands' updates run together after the loss all-reduce, the slow island's
EMULATED wait after its own); the two ranks' MPI bridge is measured and recorded, and used for the link
between the islands with ``--bridge measure`` (default ``assumed``: 50 us + bytes / 1 GB/s).

The gradient all-reduce of the two-island runtimes (heterogeneous-DP plans) is chosen as training chooses it
(``--bucket-mb auto``, the default since session 17, training's ``train.grad_bucket_mb: auto``): before the
timed steps each runtime runs training's own warm-up decision (``hethub_jax.train.warm_up_grad_allreduce``:
the step's forward/backward with the all-reduce in 25 MiB buckets overlapped with the last backward and after
the whole backward, on the training set's first global batch, the slowest rank's seconds, each path's fastest
of 3; bucketed kept only when faster by more than 2%, ``plan.keeps_bucketed_allreduce``). The headline figures
(``fraction_of_upper_bound``, ``prediction_error``, the ``planned`` row) are the planner's plan on the path
KEPT by that warm-up measurement (not the faster of the timed rows); ``grad_allreduce_kept``,
``grad_allreduce_decided_by`` and ``grad_allreduce_warm_up`` (both MEASURED warm-up seconds) say which and
why. When the plan can bucket, the same plan also runs on the OTHER path in the same interleaved loop
(``planned_unbucketed`` or ``planned_bucketed``: an in-run comparison, secondary figures
``fraction_of_upper_bound_bucketed`` / ``_unbucketed``, ``prediction_error_bucketed`` / ``_unbucketed``).
``--bucket-mb N`` (MiB > 0) forces every runtime bucketed, the plan's unbucketed row beside it (sessions 9-16:
``--bucket-mb 25``), ``--bucket-mb 0`` turns it off. The plan is PREDICTED on both paths
(``hethub_jax.planner.predict_buckets``: the chunked last microbatch at the profile's measured ratio,
``fits.chunked_last``; 1.0 for profiles without it, said in ``predicted_buckets.ratio_source``), and its
PREDICTED step, as training's, first on the path the predictor expects ``auto`` to keep, then on the path the
warm-up kept (``train_predict.prediction_on_kept_path``, training's ``_predict_kept_path``). The figures
give each rank's bucket count, overlap and exposed wait, and the seconds spent in the gradient sums after the
backward. ``--profile-islands`` measures the chunked ratio (``--chunked-mbs``, since session 17 by default at
the planner's smallest and largest microbatch size up to 16, as plan-less training's brief profile: 1 and 16
at batch 64, the predictor interpolating linearly in tokens between them; sessions 15-16 measured every
profiled size up to 16 and each island profile took ~490 s instead of ~350 s; late in session 15 it was
skipped because it lifted each rank's profile peak from 9.8 to 11.4-11.9 GB and the two ranks were OOM-killed
on the 23 GB machine; those GB were free heap pages the steady host allocator kept resident, now given back:
``profile.release_host_memory``).

Memory and time per phase (session 17): ``figures.memory_per_rank`` gives, per rank, each phase's wall
seconds and the process's peak resident set (VmHWM) at its end and how much the phase raised it
(``profile.PhaseLog``): the bridge, the island profile, the co-run pair, the plan, building the runtimes, the
gradient all-reduce warm-up, the timed steps; and the island profile's own phases (the profile JSON's
``phases``: compute fits, stage shapes, chunked last microbatch, ...), printed per rank after the profiles and
at the end (a quiet run's peak rose from 9.99 to 14.97 GB in session 16 without a phase to blame).

Default global batch 64 (rows of ``--seq`` tokens; it was 16 before session 9, and the recorded runs used
8 and 32): heterogeneous DP with a replicated update pays it on each island (the slow one's EMULATED 3x),
and all-reduces 60 MB of gradients per step, while each island alone (the upper bound) pays one update
per global batch (the sharded update, (b)/(d), pays about one in all: each island its owned share); at 64 rows these per-step costs are a few % of the step (compute dominates, as the
issue asks) and microbatch 8 or 16 still splits the rows 48/16 between the islands.

Figures: ``fraction_of_upper_bound`` = (b) / (a_fast + a_slow), ``planned_over_uniform`` = (b) / (c),
``prediction_error`` = |predicted - measured| / measured median step time of (b);
``prediction_error_per_contender`` the same for every contender (alone: each island's own step);
``predicted_parts_s``: the PREDICTED (pipeline, gradient sums + norm, update) seconds of (b), (d) and (e);
``fraction_of_upper_bound_hetero_dp_replicated`` = (e) / (a_fast + a_slow), ``hetero_dp_over_replicated``
= (d) / (e); ``faults_per_step_planned_per_rank``: each rank's minor page faults per timed step of (b)
(``getrusage``; the host allocator's settings, ``hethub_jax.host_allocator``, set before JAX starts), and
``faults_per_step_per_contender_per_rank`` the same for every contender;
``parts_planned_last_step``: per island the planned plan's last step part by part, measured against PREDICTED
(compute actions, the last one apart, pipeline, the rest of the step split: ``_parts_compare``);
``corun``: the measured co-run slowdown; ``bridge_link``: the link used and the measured one.
``prediction_error`` compares the PREDICTED step on the path the planner's plan trained on (session 17: the
path ``auto``'s warm-up kept; sessions 15-16: the forced bucketed one) with the measured one
(``prediction_error_search_model``: the planner's own ranking figure); ``predicted_step_s_planned_bucketed`` /
``_unbucketed``, ``predicted_faster_grad_allreduce``, ``predicted_auto_keeps``, ``predicted_buckets`` (the
bucketed path's terms); when the plan buckets, each path's ``fraction_of_upper_bound_<path>``,
``measured_step_s_planned_<path>`` and ``prediction_error_<path>`` (measured in the same run) and
``planned_bucketed_over_unbucketed`` (tokens/s).
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from benchmarks.common import start_pinned_rank, training_parser  # noqa: E402

MODEL = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512,
         "tie_word_embeddings": True}


#: the link between the two ranks when it is not measured (``--bridge assumed``): 50 us + bytes / 1 GB/s,
#: an assumption (MPI over TCP between hosts); the benchmark's two ranks share one machine's memory
ASSUMED_BRIDGE = (50.0e-6, 1.0e9)


def cluster(slowdown: float, only: str | None = None, bridge: tuple | None = None) -> dict:
    """The two-island cluster (or island ``only`` alone); ``bridge``: the link's ``(latency s, bytes/s)``
    (None: :data:`ASSUMED_BRIDGE`)."""
    groups = [{"name": "fast", "device": "cpu", "nodes": 1, "devices_per_node": 1},
              {"name": "slow", "device": "cpu", "nodes": 1, "devices_per_node": 1, "slowdown": slowdown}]
    groups = [g for g in groups if only in (None, g["name"])]
    lat, bw = bridge or ASSUMED_BRIDGE
    links = [] if only else [{"between": ["fast", "slow"], "bandwidth": float(bw), "latency_s": float(lat)}]
    return {"name": f"hetero-e2e{'-' + only if only else ''}", "groups": groups, "links": links}


def plans(cfg, args, costs) -> dict:
    """Per contender, ``(plan, predicted step s or None)``; the alone plans per island."""
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.planner import SearchOptions, cluster_from_dict, search
    both = cluster_from_dict(cluster(args.slowdown, bridge=args.bridge_link))
    res = search(cfg, both, args.batch, args.seq, costs=costs, options=SearchOptions(top_k=200))
    best = res.best
    pipe = next(c for c in res.candidates if c.kind == "pipeline")
    hdp = next(c for c in res.candidates if c.kind == "hetero-dp")
    L = cfg.num_hidden_layers
    p = pipe.plan.to_dict()
    p["stages"] = [{"island": "fast", "first_layer": 0, "last_layer": L // 2 - 1},
                   {"island": "slow", "first_layer": L // 2, "last_layer": L - 1}]
    p["description"] = "uniform layer split"
    p.pop("replicas", None)
    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search import bridge_for
    uniform = Plan.from_dict(p)
    pred_u = predict(cfg, uniform, {i.name: costs[i.name] for i in uniform.islands}, seq_len=args.seq,
                     bridge=bridge_for(both, [("fast", "slow")])).step_time_s
    rep = hdp.plan.replace(optimizer_sharding="replicated")
    pred_r = predict(cfg, rep, {i.name: costs[i.name] for i in rep.islands}, seq_len=args.seq,
                     bridge=bridge_for(both, [("fast", "slow")])).step_time_s
    # the planner's plan PREDICTED as training predicts it (--bucket-mb as train.grad_bucket_mb: "auto", the path
    # the predictor expects auto to keep; main re-predicts it on the path the warm-up MEASURED and kept), both
    # gradient all-reduce paths of a heterogeneous-DP plan beside each other (planner.predict_buckets)
    pred_b = predict(cfg, best.plan, {i.name: costs[i.name] for i in best.plan.islands}, seq_len=args.seq,
                     bridge=bridge_for(both, [("fast", "slow")]), grad_bucket_mb=runtime_grad_buckets(args.bucket_mb))
    args.planned_prediction, args.planned_search_step_s = pred_b, best.step_time_s
    args.planned_prediction_before_warm_up = pred_b
    out = {"planned": (best.plan, pred_b.step_time_s), "uniform": (uniform, pred_u),
           "hetero_dp": (hdp.plan, hdp.step_time_s), "hetero_dp_replicated": (rep, pred_r)}
    for isl in ("fast", "slow"):
        one = cluster_from_dict(cluster(args.slowdown, isl))
        alone = search(cfg, one, args.batch, args.seq, costs={isl: costs[isl]}, options=SearchOptions(top_k=1)).best
        out[f"alone_{isl}"] = (alone.plan, alone.step_time_s)
        # also the island's best 1F1B plan (every forward fused with its backward, and the update with the
        # last one): the profile times each call on its own, so its ranking of fused against unfused
        # schedules can be off (session 9); the bound takes the faster of the two measured
        alt = search(cfg, one, args.batch, args.seq, costs={isl: costs[isl]},
                     options=SearchOptions(top_k=1, schedules=("1f1b",))).best
        out[f"alone1f1b_{isl}"] = (alt.plan, alt.step_time_s)
        # and the island's best plan at the planned plan's microbatch size: the profile's fitted lines
        # cannot follow a per-token cost that rises with the size on a CPU core, so the planner's alone
        # choice (often the largest microbatch) can be slower than the size the planned plan runs at
        # (session 9: hetero DP over both islands measured faster than the two alone plans summed)
        mb = best.plan.microbatch_size
        same_mb = search(cfg, one, args.batch, args.seq, costs={isl: costs[isl]},
                         options=SearchOptions(top_k=1, microbatch_sizes=(mb,))).best
        out[f"alonemb_{isl}"] = (same_mb.plan, same_mb.step_time_s)
    return out


#: the alone variants measured per island (the bound takes each island's fastest measured one)
ALONE_VARIANTS = ("alone", "alone1f1b", "alonemb")


def _bucket_mb(text: str):
    """``--bucket-mb``: ``"auto"`` or a number of MiB >= 0 (0: off).

    Raises:
      argparse.ArgumentTypeError: for anything else."""
    import argparse
    import math
    if text.strip().lower() == "auto":
        return "auto"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bucket-mb must be auto or a number of MiB >= 0, got {text!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"--bucket-mb must be auto or a number of MiB >= 0, got {text!r}")
    return v


def runtime_grad_buckets(bucket_mb):
    """``--bucket-mb`` as ``PipelineRuntime.set_grad_buckets`` takes it: ``"auto"``, MiB, or None (0: off)."""
    return bucket_mb if bucket_mb == "auto" else (float(bucket_mb) if bucket_mb > 0 else None)


def chunked_sizes(spec: str, batch: int) -> str:
    """``--chunked-mbs`` as the island profile's ``--chunked-mbs``: ``auto``: the planner's smallest and
    largest microbatch size up to 16 (``train_predict.chunked_microbatch_sizes_to_profile`` of
    ``planner_microbatch_sizes(batch)``: what plan-less training measures); ``profiled``: the profiler's own
    ``auto`` (every profiled size up to 16); ``none`` or sizes: passed on."""
    spec = spec.strip().lower()
    if spec == "auto":
        from hethub_jax.train_predict import chunked_microbatch_sizes_to_profile, planner_microbatch_sizes
        return ",".join(map(str, chunked_microbatch_sizes_to_profile(planner_microbatch_sizes(batch))))
    return "auto" if spec == "profiled" else spec


def parser():
    """The benchmark's command-line parser (no JAX import)."""
    ap = training_parser(__doc__, batch=64, warmup=1, json_help="output path (written by rank 0)")
    ap.add_argument("--slowdown", type=float, default=3.0, help="EMULATED slowdown of the slow island")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per contender")
    ap.add_argument("--profiles", default=None, help="directory with cpu.json (python -m hethub_jax.profile)")
    ap.add_argument("--profile-islands", action="store_true",
                    help="each rank profiles its pinned island first (measured costs for the plan and the prediction)")
    ap.add_argument("--profile-concurrently", action="store_true",
                    help="with --profile-islands: both ranks profile at the same time (before 2026-12-03 the "
                         "default). Default: one rank after the other, each on its own pinned core while the "
                         "other waits; with one glibc arena (hethub_jax.host_allocator) a profile's whole-model "
                         "calls at microbatch 64 peaked at 11.6 GiB of RSS, and two at once were OOM-killed on "
                         "this 23 GiB machine (docs/benchmarks.md, issue 17, session 12)")
    ap.add_argument("--profile-mbs", default="auto",
                    help="microbatch sizes for --profile-islands (auto: 1, 2, every power of two below the "
                         "global batch and the global batch: every size the planner may choose is then "
                         "interpolated between profiled sizes, not extrapolated)")
    ap.add_argument("--chunked-mbs", default="auto",
                    help="with --profile-islands: microbatch sizes at which each island's profile times the bucketed "
                         "all-reduce's chunked last microbatch (fits.chunked_last). auto (default, since session 17): "
                         "the planner's smallest and largest size up to 16, as plan-less training's brief profile "
                         "(train_predict.chunked_microbatch_sizes_to_profile; the predictor interpolates the ratio "
                         "linearly in tokens between them); profiled: every profiled size up to 16 (sessions 15-16: "
                         "1, 2, 4, 8, 16 at batch 64); none; or comma-separated sizes")
    ap.add_argument("--bucket-mb", type=_bucket_mb, default="auto",
                    help="gradient all-reduce of the two-island runtimes, as training's train.grad_bucket_mb. auto "
                         "(default, training's default): each runtime's warm-up MEASURES the all-reduce in buckets of "
                         "25 MiB and after the backward and keeps the faster (hethub_jax.train.warm_up_grad_allreduce, "
                         "the code training runs); the headline figures are the planner's plan on the path kept, the "
                         "other path measured beside it in the same run. A number of MiB > 0: every runtime bucketed "
                         "at that size (forced, as before session 17; the planner's plan also measured unbucketed); "
                         "0: off, the all-reduce after the whole backward")
    ap.add_argument("--timeline-png", default=None, help="Gantt chart of the planned plan's last step")
    ap.add_argument("--pool-stage-shapes", action="store_true",
                    help="with --profile-islands: both islands take the mean of the two ranks' whole-stage figures of "
                         "each shape, phase and microbatch size (pool_stage_shapes: two cores of one type, three calls "
                         "each). Default: each island its own profile's (re-predicting session 12's two quiet runs, "
                         "pooling was better in one and worse in the other: not a default)")
    ap.add_argument("--corun", choices=("measure", "off"), default="measure",
                    help="measure (default): before planning, each rank times the whole model's fused forward + "
                         "backward alone and while the other rank runs the same call on its core; the mean of the "
                         "two ranks' busy / alone medians is both islands' co-run slowdown (DeviceCosts.corun_factor "
                         "on one shared host: the predictor slows the part of each compute action that overlaps the "
                         "other island's compute); since session 14 also the whole model's optimizer update alone and "
                         "beside the other rank's (DeviceCosts.corun_update_factor: the islands' updates start "
                         "together after the loss all-reduce). off: the islands are predicted as if "
                         "on hardware of their own (before session 13; the profiles are taken one rank after the "
                         "other, the other core idle)")
    ap.add_argument("--bridge", choices=("measure", "assumed"), default="assumed",
                    help="the link between the islands for the planner and the prediction: assumed (default: 50 us + "
                         "bytes / 1 GB/s; it PREDICTS hetero DP's ZeRO-1 exchange at 0.091 s a step) or measure (round "
                         "trips of 64 KiB to 32 MiB over the two ranks' MPIHostBridge before the profiles, fitted as "
                         "latency + bytes / bandwidth: 8.3 GB/s in a loaded check, 0.011 s for the same exchange). "
                         "The measured link is recorded either way (figures.bridge_link). Not yet the default: "
                         "re-predicting the quiet session-13 runs with session 14's update terms, the step's "
                         "prediction_error is larger with it (0.08-0.09 against 0.06-0.07), the compute actions "
                         "being PREDICTED 4-8%% low and 0.03 s of the slow island's update unexplained, which the "
                         "assumed link's 0.08 s too much hides; docs/benchmarks.md, issue 17, session 14")
    return ap


def main() -> None:
    args = parser().parse_args()
    rank, core = start_pinned_rank(__file__)
    import jax  # noqa: F401  (JAX starts here, after the pinning)
    from mpi4py import MPI

    from hethub_jax.comm.mpi import MPIHostBridge
    from hethub_jax.models.config import LlamaConfig
    from hethub_jax.parallel.runtime import PipelineRuntime
    from hethub_jax.planner.search import group_costs
    from hethub_jax.profile import PhaseLog
    from hethub_jax.train_predict import cluster_costs
    from hethub_jax.optim import OptimConfig

    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        sys.exit("run with exactly 2 ranks (one per island)")
    # this rank's phases: wall seconds and peak / resident memory (figures.memory_per_rank; issue 17, session 17)
    args.memory = PhaseLog()
    comm = MPIHostBridge(world, timeout=900)
    cfg = LlamaConfig(**MODEL)
    # the two ranks' MPI bridge, measured and recorded always (both ranks take part; well under a second),
    # used for the planner and the prediction with --bridge measure
    with args.memory.phase("bridge"):
        measured_link, args.bridge_samples = _measure_bridge()
    args.bridge_measured = measured_link
    args.bridge_link = measured_link if args.bridge == "measure" else None
    spec = cluster(args.slowdown, bridge=args.bridge_link)
    prof = os.path.join(args.profiles, "cpu.json") if args.profiles else None
    from hethub_jax.planner import cluster_from_dict
    if args.profile_mbs == "auto":
        from hethub_jax.train_predict import microbatch_sizes_to_profile, planner_microbatch_sizes
        args.profile_mbs = ",".join(map(str, microbatch_sizes_to_profile(planner_microbatch_sizes(args.batch),
                                                                         every_power_of_two=True)))
    args.chunked_mbs_profile = chunked_sizes(args.chunked_mbs, args.batch)
    args.canary_cfg, args.canary_profile = cfg, []
    args.profile_phases = None
    if args.profile_islands:  # the machine's speed when the profiles are taken (the yardstick, _canary_round)
        args.canary_profile.append(_canary_round(world, rank, cfg, args))
    if args.profile_islands:
        pids = world.allgather(os.getpid())  # this job's ranks: not "other processes" in the profile's note
        others = [p for p in pids if p != os.getpid()]
        with args.memory.phase("profile"):
            if args.profile_concurrently:
                mine = _profile_island(args, rank, others)
            else:  # one rank at a time: each profile's whole-model calls at microbatch 64 peak at ~11.6 GiB RSS
                mine = None  # under the steady host allocator (one glibc arena), two at once exceeded 23 GiB
                for r in range(world.Get_size()):
                    if r == rank:
                        mine = _profile_island(args, rank, others)
                    world.Barrier()
        args.profile_phases = mine.get("phases")
        print(f"hetero_e2e rank {rank} (island {('fast', 'slow')[rank]}) profile by phase: "
              + "; ".join(_phase_brief(x) for x in args.profile_phases or ()), flush=True)
        profs = world.allgather(mine)
        args.canary_profile.append(_canary_round(world, rank, cfg, args))
        if args.pool_stage_shapes:
            profs = pool_stage_shapes(profs)
        profiles = {"fast": profs[0], "slow": profs[1]}
        costs = cluster_costs(cluster_from_dict(spec), profiles)
        chunked = profs[0].get("chunked_microbatch_sizes")
        source = (f"profiles of the pinned islands, measured by each rank before the run, "
                  f"{'both at once' if args.profile_concurrently else 'one rank after the other'} (microbatch sizes "
                  f"{args.profile_mbs}; the chunked last microbatch at "
                  + (f"{', '.join(map(str, chunked))}" if chunked else "no size")
                  + (": the planner's smallest and largest up to 16, as plan-less training's profile, the ratio "
                     "interpolated linearly in tokens between them" if args.chunked_mbs.strip().lower() == "auto"
                     else "") + ")")
    else:
        profiles = {"fast": _load(prof), "slow": _load(prof)} if prof else {"fast": None, "slow": None}
        costs = (cluster_costs(cluster_from_dict(spec), profiles) if prof
                 else group_costs(cluster_from_dict(spec)))
        source = f"profile {prof}" if prof else "catalog 'cpu' entry (assumption, not measured)"
    corun = None
    if args.corun == "measure":  # both ranks take part: each one's call alone and beside the other's
        with args.memory.phase("corun"):
            corun = _measure_corun(cfg, args, world, rank)
        from dataclasses import replace
        # the pinned pair's factor just measured, not a profile's size-ratio relation (that models
        # unpinned processes, planner.costs.CORUN_BY_SIZE_DEFAULT)
        costs = {i: replace(c.on_shared_host("machine", corun_by_size=False), corun_factor=corun["factor"],
                            corun_update_factor=corun["update_factor"]) for i, c in costs.items()}
        source += (f"; co-run slowdown of the two cores MEASURED {corun['factor']:.3f} (compute), "
                   f"{corun['update_factor']:.3f} (optimizer update)")
    args.corun_measured = corun
    with args.memory.phase("plan"):
        contenders = plans(cfg, args, costs)
    optim = OptimConfig(learning_rate=1e-3, warmup_steps=2, decay_steps=1000)
    isl = ("fast", "slow")[rank]
    same = contenders["planned"][0].to_dict() == contenders["hetero_dp"][0].to_dict()

    def two_island_runtime(plan):
        return PipelineRuntime(plan, cfg, optim, seed=0, comm=comm, rank=rank)
    with args.memory.phase("runtimes"):
        runtimes = {n: two_island_runtime(p) for n, (p, _) in contenders.items()
                    if not n.startswith("alone") and not (same and n == "hetero_dp")}
        for rt in runtimes.values():  # as training does (train.grad_bucket_mb; default auto): hetero-DP plans
            rt.set_grad_buckets(runtime_grad_buckets(args.bucket_mb))
        seen = {i: [] for i in ("fast", "slow")}
        for v in ALONE_VARIANTS:  # a variant is measured when it differs on either island (the same decision
            new = [contenders[f"{v}_{i}"][0].to_dict() not in seen[i] for i in ("fast", "slow")]  # on both ranks)
            for i in ("fast", "slow"):
                seen[i].append(contenders[f"{v}_{i}"][0].to_dict())
            if v == "alone" or any(new):
                runtimes[v] = PipelineRuntime(contenders[f"{v}_{isl}"][0], cfg, optim, seed=0)
    if rank == 0:
        print(f"hetero_e2e: 2 CPU islands pinned to one core each; model {cfg.num_params() / 1e6:.1f} M params "
              f"(d {cfg.hidden_size}, {cfg.num_hidden_layers} layers), seq {args.seq}, global batch {args.batch}; "
              f"EMULATED slowdown {args.slowdown:g}x on island slow; planner costs: {source}", flush=True)
    batches = _batches(args)
    # the gradient all-reduce path of each two-island runtime, decided as training decides it (the warm-up on
    # the first batch); the planner's plan's other path added as a secondary row; the PREDICTED steps follow
    with args.memory.phase("grad_allreduce_warm_up"):
        grad_allreduce_paths(args, cfg, costs, runtimes, contenders, batches[0], rank, two_island_runtime, same)
    from hethub_jax.train_predict import extrapolation_note
    notes = {n: extrapolation_note(p, profiles) for n, (p, _) in contenders.items()}
    if rank == 0:
        for n, note in notes.items():
            if note:
                print(f"  {n}: {note}", flush=True)
    result = _measure(args, world, rank, core, runtimes, contenders, batches)
    if rank == 0:
        _report(args, cfg, contenders, result, costs, source, notes)


#: the two-island contenders whose runtimes the gradient all-reduce setting applies to (heterogeneous-DP plans)
TWO_ISLAND = ("planned", "uniform", "hetero_dp", "hetero_dp_replicated")


def _runtime_path(rt) -> dict:
    """The gradient all-reduce path runtime ``rt`` runs now: ``{"path": "bucketed" | "unbucketed",
    "bucket_mb": MiB or None, "off_reason": None or why not bucketed}``."""
    why = rt.grad_bucket_off_reason()
    return {"path": "unbucketed" if why else "bucketed",
            "bucket_mb": None if why else rt.grad_bucket_bytes / 2**20, "off_reason": why}


def grad_allreduce_paths(args, cfg, costs, runtimes, contenders, batch, rank, make_runtime, same=False) -> dict:
    """Each two-island runtime's gradient all-reduce path, decided as training decides it, and the planner's
    plan's other path added. Collective (both ranks, same order).

    1. ``--bucket-mb auto`` (training's default ``train.grad_bucket_mb: auto``): each runtime of
       :data:`TWO_ISLAND` runs ``hethub_jax.train.warm_up_grad_allreduce`` (the code training runs: the
       step's forward/backward with the all-reduce in 25 MiB buckets and after the backward on ``batch``, the
       training set's first global batch as in training; bucketed kept only when MEASURED faster by more than
       2%). The
       planner's plan ("planned": the headline figures) then trains on the path KEPT; a number (forced) or 0
       (off) times nothing.
    2. When the planner's plan can bucket, the same plan on the OTHER path becomes one more contender,
       ``planned_bucketed`` or ``planned_unbucketed`` (a runtime of its own, forced to that path: the
       in-run comparison; secondary figures).
    3. The PREDICTED steps follow the runtimes' paths: the planner's plan's by
       ``train_predict.prediction_on_kept_path`` (training's re-prediction on the kept path) into
       ``args.planned_prediction`` and ``contenders["planned"]``, the other row at the other path's
       PREDICTED step; every other two-island contender ``predict``-ed on its runtime's path.

    Sets ``args.grad_paths`` (per two-island runtime: :func:`_runtime_path` plus ``"warm_up"``, the warm-up's
    record or None) and ``args.grad_mode`` (``"auto"``, ``"forced"`` or ``"off"``); returns
    ``args.grad_paths``."""
    from hethub_jax.planner import cluster_from_dict
    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search import bridge_for
    from hethub_jax.train import warm_up_grad_allreduce
    from hethub_jax.train_predict import prediction_on_kept_path
    args.grad_mode = "auto" if args.bucket_mb == "auto" else ("forced" if args.bucket_mb > 0 else "off")
    choices = {n: warm_up_grad_allreduce(runtimes[n], batch, log=rank == 0 and n == "planned", emulated=True)
               for n in TWO_ISLAND if n in runtimes}
    plan, rt, c = contenders["planned"][0], runtimes["planned"], choices.get("planned")
    other = ("unbucketed" if rt.grad_bucket_off_reason() is None
             else "bucketed" if c and c.get("path") == "unbucketed" else None)
    if other:  # the in-run comparison: the same plan on the path not kept
        runtimes[f"planned_{other}"] = make_runtime(plan)
        runtimes[f"planned_{other}"].set_grad_buckets(None if other == "unbucketed" else c["bucket_mb"])
    bridge = bridge_for(cluster_from_dict(cluster(args.slowdown, bridge=args.bridge_link)), [("fast", "slow")])
    of = lambda p: {i.name: costs[i.name] for i in p.islands}  # noqa: E731
    args.planned_prediction = p = prediction_on_kept_path(cfg, plan, args.planned_prediction, of(plan), args.seq,
                                                          bridge, c)
    contenders["planned"] = (plan, p.step_time_s)
    if other:
        contenders[f"planned_{other}"] = (plan, getattr(p, f"step_time_{other}_s"))
    for n in ("uniform", "hetero_dp", "hetero_dp_replicated"):
        if n in runtimes:
            q = contenders[n][0]
            contenders[n] = (q, predict(cfg, q, of(q), seq_len=args.seq, bridge=bridge,
                                        grad_bucket_mb=_runtime_path(runtimes[n])["bucket_mb"]).step_time_s)
    if same:  # the planner's plan is the hetero-DP one: measured once, PREDICTED as it ran
        contenders["hetero_dp"] = contenders["planned"]
    args.grad_paths = {n: dict(_runtime_path(r), warm_up=choices.get(n)) for n, r in runtimes.items()
                       if n in TWO_ISLAND or n.startswith("planned_")}
    return args.grad_paths


def _batches(args) -> list:
    """The global batches of the run: warm-up, timed and one spare (``--warmup + --steps + 1``), the training
    set's first ones (``batches[0]``: the batch training's warm-up decides the all-reduce path on)."""
    from hethub_jax.data import DataConfig, build_datasets
    train, _, _ = build_datasets(DataConfig(seq_len=args.seq))
    it = train.batches(args.batch)
    return [next(it) for _ in range(args.warmup + args.steps + 1)]


def _phase_brief(rec) -> str:
    """``NAME S s, peak X GiB (+R)`` for a ``profile.PhaseLog`` record."""
    gib = lambda b: "?" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    return (f"{rec['phase']} {rec['seconds']:.0f} s, peak {gib(rec.get('peak_rss_bytes'))} GiB "
            f"(+{gib(rec.get('peak_rss_rise_bytes'))})")


def _profile_island(args, rank: int, job_pids=()) -> dict:
    """This rank's island profiled in place (pinned core, one device, no emulation, no bridge), with the
    whole model measured as one stage too (``--stage-shapes 0-(L-1)``: the shape of every one-stage
    replica, hetero DP's and the alone plans'; predicted from these measured seconds, not from the
    per-layer fits, whose seconds per layer a stage of 8 layers exceeds on a CPU core). ``job_pids``:
    the other ranks of this job, profiling their own cores at the same time (not counted as other
    processes' load in the profile's note)."""
    import json
    import tempfile

    from hethub_jax import profile
    tmp = tempfile.mkdtemp(prefix=f"hethub-e2e-profile-{rank}-")
    model = os.path.join(tmp, "model.json")
    with open(model, "w") as f:
        json.dump(MODEL, f)
    return profile.main(["--out", os.path.join(tmp, "cpu.json"), "--model", model, "--seq-len", str(args.seq),
                         "--microbatch-sizes", args.profile_mbs, "--repeats", "3", "--corun", "off",
                         "--no-bridge", "--no-runtime", "--no-progress",
                         "--stage-shapes", f"0-{MODEL['num_hidden_layers'] - 1}",
                         # the chunked-last-microbatch measurement (fits.chunked_last) at --chunked-mbs: since
                         # session 17 by default the planner's smallest and largest size up to 16 (1 and 16 at
                         # batch 64), as plan-less training's profile; sessions 15-16 measured every profiled
                         # size up to 16 (1, 2, 4, 8, 16), and the profiles took ~490 s instead of ~350 s.
                         # Session 15 skipped it (one profile peaked at 11.35 GB with it, 9.84 GB without; two
                         # ranks OOM-killed on the 23 GB machine); session 16 found the +1.5 GB to be the steady
                         # allocator's kept free pages (measure_chunked_last now gives them back first, and
                         # profile.main at its end): docs/benchmarks.md, issue 17, sessions 16-17
                         "--chunked-mbs", args.chunked_mbs_profile,
                         "--job-pids", ",".join(map(str, job_pids))])


def pool_stage_shapes(profiles):
    """The profiles with each ``"stage_shape"`` sample's seconds replaced by the mean over the profiles of
    the samples of the same shape, mesh, phase and microbatch size (``first_layer``, ``last_layer``,
    ``dp``, ``tp``, ``phase``, ``microbatch_size``); a shape missing from a profile is left as it is. Input
    profiles are not modified (copies are returned, in order).

    Why: hetero_e2e's two islands are two cores of one machine (the slow one EMULATED), each profiled with
    three timed calls per figure (median); in the four quiet session-12 profiles the same whole-model call
    varied between ranks by 1-2.5% (standard deviation; fused forward + backward at microbatch 8: 0.468 to
    0.490 s), and each island's prediction inherited its own rank's draw. The mean of the two ranks'
    figures (six calls) halves that variance, but re-predicting the two quiet runs it was closer in one
    and further in the other, so it is opt-in (``--pool-stage-shapes``; docs/benchmarks.md, issue 17,
    session 13)."""
    import copy
    key = lambda x: (x.get("first_layer"), x.get("last_layer"), x.get("dp"), x.get("tp"), x.get("phase"),  # noqa: E731
                     x.get("microbatch_size"))
    sums = {}
    for p in profiles:
        for x in (p or {}).get("samples", ()):
            if x.get("kind") == "stage_shape":
                sums.setdefault(key(x), []).append(float(x["seconds"]))
    out = []
    for p in profiles:
        q = copy.deepcopy(p)
        for x in (q or {}).get("samples", ()):
            if x.get("kind") == "stage_shape":
                vals = sums[key(x)]
                x["seconds"] = sum(vals) / len(vals)
                x["pooled_over_profiles"] = len(vals)
        out.append(q)
    return out


#: message sizes of the measured bridge (bytes): hetero DP's ZeRO-1 exchange moves 45 MB a step each way
BRIDGE_SIZES = (64 * 1024, 1024 * 1024, 8 * 1024 * 1024, 32 * 1024 * 1024)


def _measure_bridge():
    """The two ranks' MPI bridge measured (``hethub_jax.profile.measure_bridge``: round trips halved, the
    median of 5 after one untimed) at :data:`BRIDGE_SIZES` and fitted as ``seconds = latency + bytes /
    bandwidth`` (``profile.fit_line``, least squares). Returns ``((latency_s, bytes_per_s), samples)``;
    every rank gets rank 0's figures (both take part in every round trip). Raises ValueError when the fit
    is not a positive bandwidth."""
    from mpi4py import MPI

    from hethub_jax.profile import fit_line, measure_bridge
    samples = measure_bridge(list(BRIDGE_SIZES), 5)
    samples = MPI.COMM_WORLD.bcast(samples, root=0)
    fit = fit_line([x["bytes"] for x in samples], [x["seconds"] for x in samples])
    if not fit["c1"] > 0:
        raise ValueError(f"measured bridge has no positive per-byte time: {samples}")
    return (max(fit["c0"], 0.0), 1.0 / fit["c1"]), samples


#: co-run measurement (``--corun measure``): microbatch size of the timed call (capped at the global batch
#: over 4), rounds of (alone, busy) per rank, timed calls per round
CORUN_MB, CORUN_ROUNDS, CORUN_REPEATS = 8, 2, 3
#: timed updates per rank, round and condition in the update pair (an update is ~0.1 s: cheap)
CORUN_UPDATE_REPEATS = 5


def _measure_corun(cfg, args, world, rank) -> dict:
    """The two pinned cores' co-run slowdown: the whole model as one stage (the planned hetero-DP replica's
    shape), its fused forward + backward (``PipelineStage.forward_backward``, the runtime's 1F1B call) at
    microbatch ``min(CORUN_MB, batch // 4)``. Each rank in turn times ``CORUN_REPEATS`` calls after one
    untimed, in ``CORUN_ROUNDS`` rounds of: alone (the other rank waits) and busy (the other rank runs the
    same call in a loop until told the timed calls are done). Per rank ``busy / alone`` of the medians of
    the process's CPU seconds (``ratio``; a pinned one-thread call's CPU seconds are its wall seconds on a
    quiet machine, and they leave out the time slices other jobs take on a shared one: in a LOADED check
    the wall ratios were 0.99 and 1.15, the CPU ratios 1.026 and 1.038) and of the wall seconds
    (``wall_ratio``, recorded); ``factor``: the mean of ``ratio`` over the two ranks (the same core type: hetero_e2e's islands are
    two cores of one machine, the slow one EMULATED). Why: with the profiles taken one rank after the
    other, each profiled call ran beside an idle core, while in training the islands compute at the
    same time on cores that share the machine's last-level cache and memory bandwidth (the quiet
    session-12 runs: the slow island, which always computes beside the fast one, ran its actions 3-7%
    above its profile, the fast island 1-3%; docs/benchmarks.md, issue 17, session 13). Returns
    ``{"factor" (at least 1), "per_rank": [{"alone_s", "busy_s", "wall_ratio", "alone_cpu_s", "busy_cpu_s",
    "ratio"}], "microbatch_size", "update_factor" (at least 1), "update_per_rank", "statistic"}`` (seconds).

    Since session 14 the same pair (:func:`_pair_ratios`) also times the whole model's optimizer update
    (``PipelineStage.update``, AdamW over every parameter, ``CORUN_UPDATE_REPEATS`` calls back to back, as
    the profile's ``update`` fit times it) alone and beside the other rank's update loop: ``update_factor``
    (``DeviceCosts.corun_update_factor``): the islands update at the same time after the loss all-reduce (the
    quiet session-13 runs' slow island spent 0.081-0.084 s in its update and EMULATED wait against 3 x 0.0124 s
    PREDICTED then; islands as threads of one process measured 1.7-2.1 for the pair in session 12, while the
    LOADED pairs of two processes here read 1.02-1.04: docs/benchmarks.md, issue 17, session 14)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage, StageInputs
    from hethub_jax.profile import _inputs
    mb = max(1, min(CORUN_MB, args.batch // 4))
    L = cfg.num_hidden_layers
    st = PipelineStage(cfg, 0, L - 1, jax.devices()[:1], 1, 1, seed=0, recompute=False,
                       optimizer=make_optimizer(OptimConfig()))
    tokens, pos, mask, _ = _inputs(st, cfg, mb, args.seq)
    no = np.bool_(False)

    def call():
        x = StageInputs(st.place_tokens(tokens), st.place_tokens(pos), st.place_tokens(tokens), st.place_tokens(mask))
        jax.block_until_ready(st.forward_backward(st.params, x, st.new_grad_buffer(), no))
    per = _pair_ratios(call, world, rank)

    def update():  # the update as the profile times it (PipelineStage.update, zero gradients, back to back)
        st.params, st.opt_state = st.update(st.params, st.opt_state, grads, inv, norm)
        jax.block_until_ready(st.params)
    grads, inv, norm = st.new_grad_buffer(), jnp.float32(1e-3), jnp.float32(1.0)
    per_update = _pair_ratios(update, world, rank, repeats=CORUN_UPDATE_REPEATS)
    del st, grads
    return {"factor": max(1.0, float(np.mean([x["ratio"] for x in per]))), "per_rank": per, "microbatch_size": mb,
            "update_factor": max(1.0, float(np.mean([x["ratio"] for x in per_update]))),
            "update_per_rank": per_update,
            "statistic": "process CPU seconds (time.process_time), busy / alone medians, mean over the ranks"}


def _pair_ratios(call, world, rank, repeats: int = None) -> list:
    """Each rank in turn times ``repeats`` (default ``CORUN_REPEATS``) calls of ``call`` after one untimed,
    in ``CORUN_ROUNDS`` rounds of: alone (the other rank waits) and busy (the other rank runs its own
    ``call`` in a loop until told the timed calls are done). Returns, gathered on every rank, per rank
    ``{"alone_s", "busy_s", "wall_ratio", "alone_cpu_s", "busy_cpu_s", "ratio"}`` (medians, seconds;
    ``ratio``: busy / alone of the CPU seconds). Collective: both ranks call it."""
    import time

    import numpy as np
    repeats = repeats or CORUN_REPEATS
    call()
    other, mine = 1 - rank, {"alone": [], "busy": [], "alone_cpu": [], "busy_cpu": []}
    for measurer in (0, 1):
        for _ in range(CORUN_ROUNDS):
            for cond in ("alone", "busy"):
                world.Barrier()
                if rank == measurer:
                    call()
                    for _ in range(repeats):
                        t0, c0 = time.perf_counter(), time.process_time()
                        call()
                        mine[cond].append(time.perf_counter() - t0)
                        mine[cond + "_cpu"].append(time.process_time() - c0)
                    world.send(True, dest=other, tag=91)
                elif cond == "busy":
                    req = world.irecv(source=measurer, tag=91)
                    while not req.Test():
                        call()
                    req.wait()
                else:
                    world.recv(source=measurer, tag=91)
    med = {k: float(np.median(v)) for k, v in mine.items()}
    return world.allgather({"alone_s": med["alone"], "busy_s": med["busy"], "wall_ratio": med["busy"] / med["alone"],
                            "alone_cpu_s": med["alone_cpu"], "busy_cpu_s": med["busy_cpu"],
                            "ratio": med["busy_cpu"] / med["alone_cpu"]})


def _load(path):
    import json
    with open(path) as f:
        return json.load(f)


def _measure(args, world, rank, core, runtimes, contenders, batches):
    """Interleaved timed steps of every contender on ``batches`` (:func:`_batches`); gathered on rank 0."""
    import time

    from benchmarks.common import loadavg, machine, time_reduce_shared
    n_steps = len(batches)
    names, load0 = list(runtimes), loadavg()
    times = {n: [] for n in names}
    tokens, records = {n: [] for n in names}, None
    reduce_s = time_reduce_shared(list(runtimes.values()))  # seconds in the gradient sums after the backward
    update_s = _time_apply_updates(list(runtimes.values()))  # seconds in the updates (+ ZeRO-1 gather)
    reduce, buckets = {n: [] for n in names}, {n: [] for n in names}
    tail = {n: [] for n in names}  # per timed step: step start/end (perf_counter), update and gather seconds
    faults = {n: [] for n in names}  # minor page faults of this rank per timed step (getrusage)
    import resource
    canary_steps = [_canary_round(world, rank, args.canary_cfg, args)]  # the yardstick before the timed steps
    with args.memory.phase("timed_steps"):  # this rank's seconds and peak memory while the contenders train
        for i in range(n_steps):
            order = names[i % len(names):] + names[:i % len(names)]
            for n in order:
                reduce_s["t"] = update_s["t"] = 0.0
                runtimes[n].last_bucket_stats = None
                world.Barrier()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                res = runtimes[n].train_step(batches[i])
                dt = time.perf_counter() - t0
                if i > args.warmup:
                    times[n].append(dt)
                    faults[n].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                    tokens[n].append(res.num_tokens)
                    reduce[n].append(reduce_s["t"])
                    buckets[n].append(runtimes[n].last_bucket_stats)
                    tail[n].append({"t0": t0, "t1": t0 + dt, "apply_updates_s": update_s["t"],
                                    "param_exchange_s": getattr(runtimes[n], "last_exchange_s", 0.0)})
                if n == "planned":
                    records = res.records
    canary_steps.append(_canary_round(world, rank, args.canary_cfg, args))  # and after them
    return world.gather({"canary_profile_s": args.canary_profile, "canary_steps_s": canary_steps,
                         "memory_phases": args.memory.phases, "profile_phases": args.profile_phases,
                         "rank": rank, "core": core, "times": times, "tokens": tokens, "records": records,
                         "reduce_s": reduce, "buckets": buckets, "faults": faults, "tail": tail,
                         "bucket_off": {n: getattr(rt, "grad_bucket_off_reason", lambda: None)()
                                        for n, rt in runtimes.items()},
                         "machine": machine(), "load": (load0, loadavg())}, root=0)


_CANARY: dict = {}


def _canary_round(world, rank, cfg, args) -> float:
    """This rank's canary (seconds), the ranks one after the other (a barrier between), each on its own pinned
    core while the other waits, as the profiles are taken: two fixed small stage calls, one sample each
    (``hethub_jax.profile.measure_stage``: a first stage's (layer 0) B and a last stage's (last layer) fused
    F+B, median of 5 calls after one untimed), summed: a yardstick of the machine's speed. Timed before and
    after the profiles and before and after the timed steps; ``figures.drift`` = steps / profile per rank
    (the machine running the same calls faster (< 1) or slower (> 1) during the timed steps than during the
    profile, which ``prediction_error`` cannot tell from a predictor error; session 14's two quiet runs had
    errors of opposite signs). About 0.1 s per round on this model."""
    import jax

    from hethub_jax import profile
    from hethub_jax.host_allocator import steady_host_allocator
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    # the allocator the profile and the runtimes set (idempotent): without it the first canary, before the
    # profile, ran 3x slower (XLA:CPU's buffers mmapped and faulted in again per call; LOADED check, session 15)
    steady_host_allocator()
    if not _CANARY:
        tx, L, dev = make_optimizer(OptimConfig()), cfg.num_hidden_layers, jax.devices()[0]
        _CANARY["stages"] = [PipelineStage(cfg, a, a, [dev], 1, 1, seed=0, recompute=False, optimizer=tx)
                             for a in (0, L - 1)]
    first, last = _CANARY["stages"]
    out = 0.0
    for r in range(world.Get_size()):
        if r == rank:
            out = (profile.measure_stage(first, cfg, 1, args.seq, 5)["B"]
                   + profile.measure_stage(last, cfg, 1, args.seq, 5)["B_recompute"])
        world.Barrier()
    return out


def _drift(g, pred, measured) -> dict:
    """``figures.drift``: per rank the canary seconds (:func:`_canary_round`) around the profiles and around
    the timed steps, ``per_rank`` = median(steps) / median(profile) (None without --profile-islands), their
    mean ``mean``, and ``prediction_error_rescaled``: |PREDICTED x mean - measured| / measured, the step
    PREDICTED at the timed steps' machine speed. RESCALED, beside ``prediction_error`` (never instead of
    it): the canary is two small calls, not the step's."""
    from benchmarks.common import median
    per = [median(x["canary_steps_s"]) / median(x["canary_profile_s"]) if x.get("canary_profile_s") else None
           for x in g]
    mean = sum(per) / len(per) if per and all(d is not None for d in per) else None
    return {"canary_profile_s_per_rank": [x.get("canary_profile_s") for x in g],
            "canary_steps_s_per_rank": [x.get("canary_steps_s") for x in g], "per_rank": per, "mean": mean,
            "prediction_error_rescaled": (None if mean is None or not measured
                                          else round(abs(pred * mean - measured) / measured, 4)),
            "note": "canary = steps / profile: > 1 the machine ran slower during the timed steps than during the "
                    "profiles; prediction_error_rescaled is RESCALED by it, not the benchmark's figure"}


def _report(args, cfg, contenders, gathered, costs, source, notes) -> None:
    from benchmarks.common import command_line, median, write_json
    from benchmarks.hetero_dp import bucket_figures
    g = sorted(gathered, key=lambda x: x["rank"])

    def tps(n, ranks=(0, 1)):
        ts = [max(xs) for xs in zip(*(g[r]["times"][n] for r in ranks))]
        return median([t / s for t, s in zip(g[ranks[0]]["tokens"][n], ts)]), median(ts)
    rows = {}
    for n in ("planned", "uniform", "hetero_dp", "hetero_dp_replicated"):
        rows[n] = tps(n if n in g[0]["times"] else "planned")  # the planner's plan may be the hetero-DP one
    for n in ("planned_bucketed", "planned_unbucketed"):  # the planner's plan on the path not kept, same run
        if n in g[0]["times"]:
            rows[n] = tps(n)
    measured = {v: [tps(v, (r,)) for r in (0, 1)] for v in ALONE_VARIANTS if v in g[0]["times"]}
    best_v = [max(measured, key=lambda v: measured[v][r][0]) for r in (0, 1)]
    alone = [measured[v][r] for r, v in enumerate(best_v)]  # each island's fastest measured plan
    upper = alone[0][0] + alone[1][0]
    pred = contenders["planned"][1]
    figures = {"emulated": True, "slowdown": args.slowdown,
               "fraction_of_upper_bound": round(rows["planned"][0] / upper, 4),
               "planned_over_uniform": round(rows["planned"][0] / rows["uniform"][0], 4),
               "fraction_of_upper_bound_hetero_dp_replicated": round(rows["hetero_dp_replicated"][0] / upper, 4),
               "hetero_dp_over_replicated": round(rows["hetero_dp"][0] / rows["hetero_dp_replicated"][0], 4),
               "optimizer_sharding": {n: ("zero1" if contenders[n][0].sharded_update() else "replicated")
                                      for n in ("planned", "hetero_dp", "hetero_dp_replicated")},
               "prediction_error": round(abs(pred - rows["planned"][1]) / rows["planned"][1], 4),
               "predicted_step_s_planned": pred, "measured_step_s_planned": rows["planned"][1],
               # the gradient all-reduce path the planner's plan trained on (session 17: kept by training's
               # auto warm-up), both paths PREDICTED (planner.predict_buckets) and measured in the same run
               **_bucket_figures(args, rows, upper),
               # the machine's speed during the timed steps over that during the profiles (canary calls)
               "drift": _drift(g, pred, rows["planned"][1]),
               "tokens_per_s": {n: r[0] for n, r in rows.items()},
               "tokens_per_s_alone": {"fast": alone[0][0], "slow": alone[1][0]}, "upper_bound_tokens_per_s": upper,
               "alone_bound_plan": {i: {"alone": "planner", "alone1f1b": "1f1b",
                                        "alonemb": "planned microbatch size"}[v] for i, v in zip(("fast", "slow"), best_v)},
               "planned_is_hetero_dp": "hetero_dp" not in g[0]["times"],
               # every contender's PREDICTED against measured median step (alone: each island's own)
               "prediction_error_per_contender": {
                   **{n: _err(contenders[n][1], rows[n][1]) for n in rows},
                   **{f"{v}_{i}": _err(contenders[f"{v}_{i}"][1], a[1])
                      for v, rs in measured.items() for i, a in zip(("fast", "slow"), rs)}},
               "extrapolated": {n: note for n, note in notes.items() if note},
               "bucket_mb": args.bucket_mb,
               # why the hetero-DP contender's all-reduce is not bucketed (None: it is)
               "hetero_dp_bucketing_off_reason": g[0].get("bucket_off", {}).get(
                   "hetero_dp", g[0].get("bucket_off", {}).get("planned")),
               "hetero_dp_buckets_per_rank": [bucket_figures(x["buckets"].get("hetero_dp", x["buckets"]["planned"]))
                                              for x in g],
               "hetero_dp_reduce_after_backward_s_per_rank": [
                   median(x["reduce_s"].get("hetero_dp", x["reduce_s"]["planned"])) for x in g],
               "predicted_parts_s": {n: _parts(n, contenders[n][0], cfg, costs, args)
                                     for n in ("planned", "hetero_dp", "hetero_dp_replicated")},
               # per rank, its phases' seconds and peak / resident memory (profile.PhaseLog), and its island
               # profile's phases (session 17: a quiet run's peak rose to 14.97 GB, the phase unknown)
               "memory_per_rank": [{"rank": x["rank"], "phases": x.get("memory_phases"),
                                    "profile_phases": x.get("profile_phases")} for x in g],
               "parts_planned_last_step": _parts_compare(args, cfg, contenders, g, costs),
               # minor page faults per timed step of the planner's plan, per rank (hethub_jax.host_allocator:
               # about 300,000 a step before session 12's one-arena setting, none after; issue 17)
               "faults_per_step_planned_per_rank": [x.get("faults", {}).get("planned") for x in g],
               # the same for every contender (session 18: alone1f1b_slow ran 2.2x its prediction; a one-stage
               # step at microbatch 32 faulted ~250,000 pages a call while the heap's top was trimmed at 1 GiB)
               "faults_per_step_per_contender_per_rank": {n: [x.get("faults", {}).get(n) for x in g]
                                                          for n in g[0].get("faults", {})},
               # the link between the islands used by the planner and the prediction (--bridge)
               # the two cores' MEASURED co-run slowdown used by the planner and the prediction (--corun)
               "corun": args.corun_measured,
               "bridge_link": {"used": "measured" if args.bridge_link else "assumed",
                               "latency_s": (args.bridge_link or ASSUMED_BRIDGE)[0],
                               "bandwidth_bytes_per_s": (args.bridge_link or ASSUMED_BRIDGE)[1],
                               "measured_latency_s": args.bridge_measured[0],
                               "measured_bandwidth_bytes_per_s": args.bridge_measured[1],
                               "measured_samples": args.bridge_samples}}
    result = {"benchmark": "hetero_e2e", "command": command_line(),
              "machine": dict(g[0]["machine"], cores_per_rank=[x["core"] for x in g],
                              loadavg_per_rank=[x["load"] for x in g]),
              "config": {"model": cfg.to_dict(), "num_params": cfg.num_params(), "seq_len": args.seq,
                         "global_batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                         "costs": source, "emulated": True,
                         "plans": {n: p.to_dict() for n, (p, _) in contenders.items()},
                         "predicted_step_s": {n: s for n, (_, s) in contenders.items()}},
              "figures": figures,
              "rows": [{"config": n, "tokens_per_s": r[0], "median_step_s": r[1],
                        "times_s_per_rank": [x["times"].get(n, x["times"]["planned"]) for x in g]}
                       for n, r in rows.items()]
              + [{"config": f"{v}_{i}", "tokens_per_s": a[0], "median_step_s": a[1]}
                 for v, rs in measured.items() for i, a in zip(("fast", "slow"), rs)]}
    write_json(args.json, result)
    errs = figures["prediction_error_per_contender"]
    for r in result["rows"]:
        e = errs.get(r["config"])
        print(f"  {r['config']:<10} {r['tokens_per_s']:>9.1f} tokens/s  step {r['median_step_s']:.3f} s"
              + (f"  (PREDICTED error {e:.3f})" if e is not None else ""))
    b = figures["hetero_dp_buckets_per_rank"]
    exposed = ", ".join(f"{x['bucket_exposed_s'] * 1e3:.0f} ms" for x in b)
    after = ", ".join(f"{x * 1e3:.0f} ms" for x in figures["hetero_dp_reduce_after_backward_s_per_rank"])
    off = figures["hetero_dp_bucketing_off_reason"]
    hdp_mb = args.grad_paths.get("hetero_dp", args.grad_paths["planned"])["bucket_mb"]
    print(f"hetero DP: " + (f"gradient all-reduce NOT bucketed ({off})" if off else
                            f"{b[0]['num_buckets']} gradient buckets of {hdp_mb:g} MiB, exposed wait per rank "
                            f"{exposed}") + f", all-reduce after the backward per rank {after}; PREDICTED (pipeline, "
          f"all-reduce + norm, update) {figures['predicted_parts_s']['hetero_dp']}, replicated update "
          f"{figures['predicted_parts_s']['hetero_dp_replicated']}")
    print(grad_allreduce_summary(figures))
    print(f"hetero DP sharded (ZeRO-1) over replicated update: {figures['hetero_dp_over_replicated']:.3f}; "
          f"replicated fraction_of_upper_bound {figures['fraction_of_upper_bound_hetero_dp_replicated']:.3f}")
    for isl, d in figures["parts_planned_last_step"].items():
        m, p = d["measured"], d["PREDICTED"]
        if m and p:
            print(f"  planned, island {isl}, last step: {m['compute_actions']} compute actions of {m['mean_compute_s']:.3f} s "
                  f"own compute (PREDICTED {p['compute_actions']} of {p['mean_compute_s']:.3f} s), pipeline "
                  f"{m['pipeline_s']:.3f} s (PREDICTED {p['pipeline_s']:.3f} s), rest of step {m['rest_of_step_s']:.3f} s "
                  f"(PREDICTED {p['rest_of_step_s']:.3f} s)")
            if m.get("mean_compute_s_before_last") is not None:
                print(f"    compute: last action {m['last_compute_s']:.3f} s, the others {m['mean_compute_s_before_last']:.3f} s "
                      f"on average (PREDICTED {p['last_compute_s']:.3f} / {p['mean_compute_s_before_last']:.3f} s)")
            if m.get("tail"):
                t, q = m["tail"], p["tail"]
                print("    rest of step, measured: " + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in t.items())
                      + " s; PREDICTED: " + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in q.items()) + " s")
    d = figures["drift"]
    print("drift (canary, timed steps / profiles) per rank: "
          + (", ".join(f"{x:.3f}" for x in d["per_rank"]) if d["mean"] is not None else "not measured (no --profile-islands)")
          + (f"; prediction_error RESCALED by the mean drift {d['prediction_error_rescaled']:.3f} (not the figure)"
             if d["prediction_error_rescaled"] is not None else ""))
    for m in figures["memory_per_rank"]:
        print(f"rank {m['rank']} by phase (seconds, peak RSS so far, its rise): "
              + "; ".join(_phase_brief(x) for x in m["phases"] or ()))
    print(f"upper bound {upper:.1f} tokens/s; fraction_of_upper_bound {figures['fraction_of_upper_bound']:.3f}, "
          f"planned_over_uniform {figures['planned_over_uniform']:.3f}, prediction_error "
          f"{figures['prediction_error']:.3f} (predicted {pred:.3f} s from {source}) on the "
          f"{figures['grad_allreduce_kept']} gradient all-reduce ({figures['grad_allreduce_decided_by']}) [EMULATED]")
    if args.timeline_png:
        _timeline(args, cfg, contenders, g, costs)


def _err(pred, measured):
    """|PREDICTED - measured| / measured (None without a prediction)."""
    return None if pred is None or not measured else round(abs(pred - measured) / measured, 4)


def _bucket_figures(args, rows, upper) -> dict:
    """The gradient all-reduce path of the planner's plan (session 17) and its two paths side by side.

    ``grad_allreduce_kept``: the path the headline figures (``fraction_of_upper_bound``, ``prediction_error``,
    the "planned" row) trained on; ``grad_allreduce_decided_by``: how (``--bucket-mb auto``: training's warm-up
    measurement, :func:`grad_allreduce_paths`; a number: forced; 0 / a plan that cannot bucket: unbucketed);
    ``grad_allreduce_warm_up``: the warm-up's record (``bucketed_s`` and ``unbucketed_s``: MEASURED seconds of
    the step's forward/backward + all-reduce per path, the fastest of ``steps``; ``bucket_mb``; ``path``;
    ``reason`` when nothing was timed), None unless auto. PREDICTED: ``predicted_grad_allreduce_planned`` (the
    path of ``predicted_step_s_planned``: the kept one, ``train_predict.prediction_on_kept_path``),
    ``predicted_auto_keeps`` (the path the predictor expected the warm-up to keep, ``Prediction.buckets``) and
    ``predicted_grad_allreduce_before_warm_up``, both paths' steps, ``predicted_faster_grad_allreduce``,
    ``predicted_buckets`` (the bucketed path's terms). When the plan can bucket, both paths MEASURED in this run
    (the kept one is the "planned" row, the other ``planned_bucketed`` / ``planned_unbucketed``, secondary):
    ``fraction_of_upper_bound_bucketed`` / ``_unbucketed``, ``measured_step_s_planned_bucketed`` /
    ``_unbucketed``, ``prediction_error_bucketed`` / ``_unbucketed`` (each path's PREDICTED step against its
    measured one) and ``planned_bucketed_over_unbucketed`` (tokens/s). ``prediction_error_search_model``: the
    planner's own ranking figure (``search``, the path the predictor expects auto to keep) against the measured
    planned step."""
    p, kept = args.planned_prediction, args.grad_paths["planned"]
    c = kept.get("warm_up")
    before = args.planned_prediction_before_warm_up
    if args.grad_mode == "auto" and c and c.get("path"):
        how = ("MEASURED by training's warm-up (train.grad_bucket_mb auto: hethub_jax.train.warm_up_grad_allreduce, "
               "bucketed only when faster by more than 2%)")
    elif kept["off_reason"] and args.grad_mode != "off":
        how = f"the plan cannot bucket: {kept['off_reason']}"
    else:
        how = ("forced by --bucket-mb " + f"{args.bucket_mb:g}" if args.grad_mode == "forced"
               else "--bucket-mb 0 (off)")
    by_path = {kept["path"]: rows["planned"]}
    by_path.update({x: rows[f"planned_{x}"] for x in ("bucketed", "unbucketed") if f"planned_{x}" in rows})
    out = {"grad_allreduce_kept": kept["path"], "grad_allreduce_decided_by": how,
           "grad_allreduce_warm_up": c, "grad_allreduce_mode": args.grad_mode,
           "grad_allreduce_per_contender": args.grad_paths,
           "predicted_grad_allreduce_planned": p.grad_allreduce,
           "predicted_grad_allreduce_before_warm_up": before.grad_allreduce,
           "predicted_auto_keeps": (p.buckets or {}).get("auto_keeps"),
           "predicted_step_s_planned_bucketed": p.step_time_bucketed_s,
           "predicted_step_s_planned_unbucketed": p.step_time_unbucketed_s,
           "predicted_faster_grad_allreduce": (p.buckets or {}).get("faster"),
           "predicted_buckets": p.buckets,
           "predicted_step_s_planned_search": args.planned_search_step_s,
           "prediction_error_search_model": _err(args.planned_search_step_s, rows["planned"][1])}
    if len(by_path) == 2:  # both paths measured in this run
        for x, (tok, step) in by_path.items():
            out.update({f"fraction_of_upper_bound_{x}": round(tok / upper, 4), f"measured_step_s_planned_{x}": step,
                        f"prediction_error_{x}": _err(getattr(p, f"step_time_{x}_s"), step)})
        out["planned_bucketed_over_unbucketed"] = round(by_path["bucketed"][0] / by_path["unbucketed"][0], 4)
    return out


def grad_allreduce_summary(figures: dict) -> str:
    """The report's line on the planner's plan's gradient all-reduce: the path kept and how, the warm-up's
    MEASURED seconds, both paths PREDICTED and, when both ran, measured (the secondary rows)."""
    f = figures
    w = f.get("grad_allreduce_warm_up") or {}
    line = (f"planned, gradient all-reduce: KEPT {f['grad_allreduce_kept']} ({f['grad_allreduce_decided_by']}"
            + (f"; warm-up MEASURED bucketed {w['bucketed_s']:.3f} s, unbucketed {w['unbucketed_s']:.3f} s"
               if w.get("bucketed_s") is not None else "") + "): the headline figures' path")
    if f.get("predicted_step_s_planned_bucketed") is not None:
        line += (f"; PREDICTED bucketed {f['predicted_step_s_planned_bucketed']:.3f} s, unbucketed "
                 f"{f['predicted_step_s_planned_unbucketed']:.3f} s (the predictor expected auto to keep "
                 f"{f['predicted_auto_keeps']}; chunked last microbatch x {f['predicted_buckets']['ratio']} from "
                 f"{f['predicted_buckets']['ratio_source']})")
    if f.get("measured_step_s_planned_bucketed") is not None:
        line += (f"; timed in this run: bucketed {f['measured_step_s_planned_bucketed']:.3f} s (fraction "
                 f"{f['fraction_of_upper_bound_bucketed']:.3f}, prediction_error {f['prediction_error_bucketed']}), "
                 f"unbucketed {f['measured_step_s_planned_unbucketed']:.3f} s (fraction "
                 f"{f['fraction_of_upper_bound_unbucketed']:.3f}, prediction_error "
                 f"{f['prediction_error_unbucketed']}) [EMULATED]")
    return line


def _parts(name, plan, cfg, costs, args) -> list:
    """The PREDICTED (pipeline, gradient all-reduce + norm, update) seconds of contender ``name`` on the
    gradient all-reduce path its runtime ran (``args.grad_paths``; the planner's plan: its prediction on the
    kept path, ``args.planned_prediction``)."""
    from hethub_jax.planner import cluster_from_dict
    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search import bridge_for
    if name == "planned":
        p = args.planned_prediction
    else:
        path = args.grad_paths.get(name, args.grad_paths["planned"])
        p = predict(cfg, plan, {i.name: costs[i.name] for i in plan.islands}, seq_len=args.seq,
                    bridge=bridge_for(cluster_from_dict(cluster(args.slowdown, bridge=args.bridge_link)),
                                      [("fast", "slow")]), grad_bucket_mb=path["bucket_mb"])
    return [round(p.pipeline_s, 4), round(p.allreduce_s, 4), round(p.update_s, 4)]


def _time_apply_updates(runtimes) -> dict:
    """Wraps each ``PipelineRuntime._apply_updates`` (the optimizer updates after the gradient sums, the
    slow island's EMULATED wait after its update, and under ZeRO-1 the parameter gather) so that its wall
    seconds add up in the returned ``{"t": seconds}`` (as ``benchmarks.common.time_reduce_shared``)."""
    import time
    acc_s = {"t": 0.0}
    for rt in runtimes:
        orig = rt._apply_updates

        def timed(*a, _orig=orig, **k):
            t0 = time.perf_counter()
            out = _orig(*a, **k)
            acc_s["t"] += time.perf_counter() - t0
            return out
        rt._apply_updates = timed
    return acc_s


def _parts_compare(args, cfg, contenders, g, costs) -> dict:
    """Per island, the planner's plan's last timed step part by part, measured (its action records) against
    PREDICTED (``predictor.predicted_records`` and ``predict``'s parts): the compute actions (F, B and the
    fused F+B), their mean seconds of own compute (an EMULATED island's action is its compute and then
    ``(f - 1)x`` that in emulated wait, DESIGN.md section 9: the duration over ``f``), the step's last
    compute action apart (``last_compute_s``: with the bucketed all-reduce it is the chunked F+B whose
    buckets are reduced on a thread sharing the island's core) and the mean of the others, the pipeline
    (first action's start to last action's end) and the rest of the step (measured: the rank's step time
    less the pipeline; PREDICTED: gradient reduction + norm + update), and the rest split (``tail``):
    measured ``before_pipeline_s`` (step start to first action), ``wait_for_other_replica_s`` (the other
    rank's pipeline end less this one's, when later: the records' clocks are ``time.perf_counter``, one
    monotonic clock for the machine), ``reduce_after_backward_s`` (``_reduce_shared``, that wait
    included), ``bucket_exposed_s``, ``apply_updates_s`` (the update, its EMULATED wait, the ZeRO-1
    parameter gather), ``param_exchange_s`` (the gather, inside the former), ``other_s`` (the rest: the
    norm, the loss all-reduce, the final wait) and ``update_and_wait_s`` (``apply_updates_s`` less
    ``param_exchange_s``: the update and its EMULATED wait; on an island whose update runs asynchronously
    only its dispatch); PREDICTED ``predictor.tail_parts`` of the island (``sums_s``, ``norm_s``,
    ``zero1_gather_host_s``, ``update_s``: alone), ``bridge_s`` and ``updates_together_s`` (the step's
    update phase: the islands' updates together at the update co-run factor, each EMULATED wait after its
    own; compare the critical island's ``update_and_wait_s``). Seconds."""
    from hethub_jax.planner import cluster_from_dict
    from hethub_jax.planner.predictor import predict, tail_parts
    from hethub_jax.planner.search import bridge_for
    plan = contenders["planned"][0]
    bridge = bridge_for(cluster_from_dict(cluster(args.slowdown, bridge=args.bridge_link)),
                        [("fast", "slow")])
    c = {i.name: costs[i.name] for i in plan.islands}
    pred = args.planned_prediction  # on the runtimes' path (bucketed: the chunked last microbatch's term)
    tails = tail_parts(cfg, plan, c, seq_len=args.seq, bridge=bridge)
    slow = {i.name: i.slowdown for i in plan.islands}
    # a B action whose forward ran fused with it computes nothing of its own (PREDICTED 0 s; measured: the wait
    # for the fused call's result): left out of the compute actions on both sides
    fused = {(r.island, r.replica, r.stage, r.action) for r in pred.timeline
             if r.action[:1] == "B" and r.end_s - r.start_s <= 0}

    def summary(recs, isl):
        rs = [r for r in recs if r.island == isl]
        if not rs:
            return None
        comp = [(r.end_s - r.start_s) / slow[isl] for r in sorted(rs, key=lambda r: r.start_s)
                if r.action[:1] in ("F", "B") and (r.island, r.replica, r.stage, r.action) not in fused]
        return {"compute_actions": len(comp), "mean_compute_s": sum(comp) / len(comp) if comp else 0.0,
                "last_compute_s": comp[-1] if comp else 0.0,
                "mean_compute_s_before_last": sum(comp[:-1]) / (len(comp) - 1) if len(comp) > 1 else None,
                "pipeline_s": max(r.end_s for r in rs) - min(r.start_s for r in rs),
                "pipeline_end": max(r.end_s for r in rs), "pipeline_start": min(r.start_s for r in rs)}
    out, ends = {}, {}
    for x in g:
        isl = ("fast", "slow")[x["rank"]]
        m = summary(x["records"] or [], isl)
        if m is not None:
            ends[isl] = m["pipeline_end"]
    for x in g:
        isl = ("fast", "slow")[x["rank"]]
        m, p = summary(x["records"] or [], isl), summary(pred.timeline, isl)
        step = (x["times"].get("planned") or [None])[-1]
        if m is not None and step is not None:
            m["rest_of_step_s"] = step - m["pipeline_s"]
            m["step_s"] = step
            t = (x.get("tail", {}).get("planned") or [None])[-1]
            if t is not None:  # the last timed step's tail, split
                reduce = (x["reduce_s"].get("planned") or [0.0])[-1]
                bk = (x["buckets"].get("planned") or [None])[-1] or {}
                other_end = max((e for i, e in ends.items() if i != isl), default=m["pipeline_end"])
                m["tail"] = {"before_pipeline_s": m["pipeline_start"] - t["t0"],
                             "wait_for_other_replica_s": max(0.0, other_end - m["pipeline_end"]),
                             "reduce_after_backward_s": reduce, "bucket_exposed_s": bk.get("exposed_s", 0.0),
                             "apply_updates_s": t["apply_updates_s"], "param_exchange_s": t["param_exchange_s"],
                             "other_s": t["t1"] - m["pipeline_end"] - reduce - t["apply_updates_s"],
                             # the update and its EMULATED wait without the exchange (the fast island's update
                             # runs asynchronously: there only its dispatch; the exchange waits for it)
                             "update_and_wait_s": t["apply_updates_s"] - t["param_exchange_s"]}
        for d in (m, p):
            if d is not None:
                for k in ("pipeline_end", "pipeline_start"):
                    d.pop(k, None)
        if p is not None:
            p["rest_of_step_s"] = pred.allreduce_s + pred.update_s
            p["step_s"] = pred.step_time_s
            p["tail"] = dict(tails["per_island"].get(isl, {}), bridge_s=tails["bridge_s"],
                             updates_together_s=tails["update_s"])
        out[isl] = {"measured": m, "PREDICTED": p}
    return out


def _timeline(args, cfg, contenders, g, costs) -> None:
    from hethub_jax.planner.predictor import predicted_records
    from hethub_jax.timeline import write_timeline_png
    plan = contenders["planned"][0]
    recs = [r for x in g for r in (x["records"] or [])]
    from hethub_jax.planner import cluster_from_dict
    from hethub_jax.planner.search import bridge_for
    bridge = bridge_for(cluster_from_dict(cluster(args.slowdown, bridge=args.bridge_link)), [("fast", "slow")])
    pred = predicted_records(cfg, plan, {i.name: costs[i.name] for i in plan.islands}, seq_len=args.seq,
                             bridge=bridge, prediction=args.planned_prediction)
    write_timeline_png(args.timeline_png, recs, pred, slowdown={i.name: i.slowdown for i in plan.islands},
                       title="hetero_e2e planned plan, last step")
    print(f"timeline: {args.timeline_png}")


if __name__ == "__main__":
    main()
