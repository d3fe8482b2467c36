"""``python -m hethub_jax.plan``: the automatic parallel planner on the command line (docs/planner.md).

Usage::

    python -m hethub_jax.plan --model PRESET_OR_CONFIG --cluster CLUSTER.yaml --global-batch N
        [--seq-len N] [--memory-headroom F] [--profiles DIR] [--out plan.json] [--top K] [--json]
        [--grad-bucket-mb auto|none|MiB]

Prints the chosen plan (least PREDICTED step time; the one ``--out`` writes) headed ``Chosen plan``, then
up to ``--top - 1`` alternatives headed ``Alternative 1``, ``Alternative 2``, ... (next best first, each with
its step time relative to the chosen plan's), one table each: per stage its device type, devices, DP x TP, layers,
predicted compute (forward + backward) per microbatch, memory per device and bubble; the step time
(pipeline + gradient all-reduce across stages/replicas and global norm + optimizer update), tokens/s, MFU and the
fraction of the cluster's upper bound (sum of each group's best homogeneous tokens/s). Every figure is
PREDICTED by ``hethub_jax.planner.predictor``, none is measured. ``--out`` writes the chosen plan, which
``python -m hethub_jax.train --plan`` runs unchanged (the plan records its ``seq_len``; training
refuses a longer ``data.seq_len`` and warns for a shorter one). Memory figures are binary (GiB = 2**30
bytes); a stage fits when its memory per device is at most ``1 - --memory-headroom`` (default 0.05) of
the device's capacity. A plan with several stages on a multi-node group is
printed and written with that group split into one island per stage and predicted again
(``planner.runnable``; ``--no-split``: as searched, which today's runtime does not run).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from hethub_jax.parallel.rules import check_runtime_support

__all__ = ["main", "format_candidate", "candidate_heading", "candidate_dict", "cost_source_lines"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hethub_jax.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model preset name (e.g. llama-140b) or a YAML/JSON config")
    p.add_argument("--cluster", required=True, help="cluster spec YAML (docs/cluster_spec.md)")
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sample, recorded in the plan (default: a training config's data.seq_len "
                        "when --model is one, else min(4096, the model's max_position_embeddings))")
    p.add_argument("--memory-headroom", type=float, default=None, metavar="F",
                   help="fraction of each device's memory kept free for allocator fragmentation and XLA "
                        "workspace, in [0, 1) (default 0.05: a stage may use 95%% of the capacity)")
    p.add_argument("--profiles", default=None, help="folder of measured profiles <device>.json / <group>.json")
    p.add_argument("--out", default=None, help="write the chosen plan (JSON; the first printed) here")
    from hethub_jax.planner.search import DEFAULT_TOP_K
    p.add_argument("--top", type=int, default=DEFAULT_TOP_K,
                   help=f"plans to print: the chosen one and up to K-1 alternatives (default {DEFAULT_TOP_K}, as plan-less "
                        f"training keeps; the search keeps K candidates, which a multi-node group's split per stage "
                        f"ranks again, so another K may choose another plan)")
    p.add_argument("--max-stages-per-group", type=int, default=4, help="most stages one group may hold (default 4)")
    p.add_argument("--microbatch-sizes", type=int, nargs="+", default=None,
                   help="candidate microbatch sizes (default: every divisor of the global batch)")
    p.add_argument("--no-hetero-dp", action="store_true", help="skip the heterogeneous data-parallel family")
    p.add_argument("--grad-bucket-mb", type=_bucket_mb, default="auto", metavar="auto|none|MiB",
                   help="the runs' train.grad_bucket_mb: which gradient all-reduce path a heterogeneous-DP plan is "
                        "ranked by (default auto, as training's default: the path the runtime's warm-up rule keeps, "
                        "bucketed only when PREDICTED faster by more than 2%%; none: after the backward; a number: "
                        "bucketed in buckets of that many MiB)")
    p.add_argument("--no-upper-bound", action="store_true", help="skip the per-group homogeneous searches")
    p.add_argument("--no-split", action="store_true",
                   help="print the plans as searched (one island per node group), without splitting a "
                        "multi-node group into one island per stage (then such plans do not run today)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    return p


def fmt_bytes(x: float) -> str:
    """Bytes in binary units, labelled (the convention of every memory figure in the output: MiB =
    2**20 bytes, GiB = 2**30 bytes): ``47.0 MiB``, ``1.50 GiB`` (GiB from 1 GiB up)."""
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def devices_used(plan: Any) -> int:
    """Accelerators the plan's stages use (sum of every stage's ``dp x tp``): ``planner.search.devices_used``,
    the count the ranking's tie-break reads (``search.rank_key``)."""
    from hethub_jax.planner.search import devices_used as used
    return used(plan)


def candidate_heading(i: int, kind: str, chosen_step_s: Optional[float] = None,
                      step_s: Optional[float] = None) -> str:
    """``"Chosen plan (pipeline)"`` for the search's best candidate (``i`` 0), else ``"Alternative i
    (kind)"`` (``i`` >= 1: the next best first) with, given both PREDICTED step times (seconds), the step's
    difference from the chosen plan's in percent: ``"Alternative 1 (pipeline; step +2.9% vs the chosen
    plan)"``. ``kind``: the candidate's family (``pipeline``, ``hetero-dp``)."""
    if i == 0:
        return f"Chosen plan ({kind})"
    if chosen_step_s and step_s is not None:
        return f"Alternative {i} ({kind}; step {100 * (step_s / chosen_step_s - 1):+.1f}% vs the chosen plan)"
    return f"Alternative {i} ({kind})"


def format_candidate(i: int, c: Any, groups: Dict[str, Any], ub: Optional[float],
                     ub_note: Optional[str] = None, cluster_devices: Optional[int] = None,
                     chosen_step_s: Optional[float] = None) -> str:
    """The readable table of the ``i``-th candidate of a search, best first (every figure PREDICTED),
    headed by :func:`candidate_heading` (``i`` 0: ``Chosen plan``; else ``Alternative i``);
    ``ub_note``: why the upper bound ``ub`` is None (``SearchResult.upper_bound_note``);
    ``cluster_devices``: the cluster's accelerators, to say how many the plan leaves idle (MFU counts
    only the plan's devices); ``chosen_step_s``: the chosen plan's PREDICTED step time (seconds), for an
    alternative's relative step time."""
    pred, plan = c.prediction, c.plan
    frac = f"{c.upper_bound_fraction:.3f} of the cluster's upper bound ({ub:,.0f} tokens/s)" if ub else \
        (ub_note or "upper bound not computed")
    lines = [f"{candidate_heading(i, c.kind, chosen_step_s, pred.step_time_s)} - PREDICTED: step {pred.step_time_s:.4g} s, "
             f"{pred.tokens_per_s:,.0f} tokens/s, MFU {_mfu_text(c)}, {frac}",
             f"  microbatch {plan.microbatch_size}, global batch {plan.global_batch_size}, schedule {plan.schedule}, "
             f"recompute {plan.recompute}; pipeline {pred.pipeline_s:.4g} s + gradient all-reduce {pred.allreduce_s:.3g} s "
             f"+ update {pred.update_s:.3g} s" + _bucket_text(pred),
             f"  devices used: {devices_used(plan):,}"
             + (f" of the cluster's {cluster_devices:,} ({cluster_devices - devices_used(plan):,} idle; MFU is over "
                f"the devices used)" if cluster_devices and cluster_devices > devices_used(plan) else ""),
             f"  {'replica':>7} {'stage':>5}  {'group (device)':<26} {'devices':>7} {'DP x TP':>9} {'layers':>9} "
             f"{'F+B per microbatch (s)':>22} {'memory/device (capacity)':>24} {'bubble':>7}"]
    shares = plan.batch_shares()
    for sp in pred.stages:
        st = plan.stage(sp.replica, sp.stage)
        g = groups[_group(c, st.island)]
        dev = f"{st.island} ({g.device or 'profile'})"
        cap = getattr(g, "memory_bytes", None)
        cap = fmt_bytes(cap if cap is not None else g.memory_gb * 1e9)
        lines.append(f"  {sp.replica:>7} {sp.stage:>5}  {dev:<26.26} {st.num_devices:>7} {st.dp:>4} x {st.tp:<3}"
                     f" {st.first_layer:>4}-{st.last_layer:<4} {sp.compute_s_per_microbatch:>22.4g} "
                     f"{fmt_bytes(sp.memory.total) + ' (' + cap + ')':>24} {100 * sp.bubble_fraction:>6.1f}%")
    if plan.num_replicas > 1:
        lines.append(f"  batch shares (samples per replica): {shares}")
    split = _split_note(c)
    if split:
        lines.append(f"  {split}")
    why = _not_runnable(plan)
    if why:
        lines.append(f"  NOT RUNNABLE YET: {why}")
    return "\n".join(lines)


def _bucket_text(pred: Any) -> str:
    """For a plan that can bucket its gradient all-reduce (``Prediction.buckets``): which path the step is of
    and the other path's PREDICTED step; else ''."""
    bk = getattr(pred, "buckets", None)
    if not bk or pred.step_time_bucketed_s is None:
        return ""
    other = pred.step_time_unbucketed_s if pred.grad_allreduce == "bucketed" else pred.step_time_bucketed_s
    what = "bucketed, overlapped with the last backward" if pred.grad_allreduce == "bucketed" else "after the backward"
    return f" (all-reduce {what}; the other path {other:.4g} s)"


def candidate_dict(c: Any) -> Dict[str, Any]:
    """JSON form of a candidate: the plan, its kind, MFU (null with ``mfu_note`` saying why on cpu or
    emulated islands), fraction of the upper bound and the prediction
    (timeline left out); every figure PREDICTED."""
    pred = c.prediction.to_dict()
    pred.pop("timeline", None)
    return {"kind": c.kind, "predicted": True, "step_time_s": c.step_time_s, "tokens_per_s": c.tokens_per_s,
            "mfu": _mfu(c), "mfu_note": _mfu_note(c), "upper_bound_fraction": c.upper_bound_fraction,
            "devices_used": devices_used(c.plan),
            "layers": [list(x) for x in c.layers],
            "plan": c.plan.to_dict(), "prediction": pred, "runnable": _not_runnable(c.plan) is None,
            "not_runnable_because": _not_runnable(c.plan),
            "island_groups": dict(getattr(c, "island_groups", None) or {i.name: i.name for i in c.plan.islands}),
            "searched_step_time_s": c.searched.step_time_s if getattr(c, "searched", None) else c.step_time_s}


def _group(c: Any, island: str) -> str:
    """The node group of ``island`` (a split candidate's islands map to their group)."""
    return (getattr(c, "island_groups", None) or {}).get(island, island)


def _split_note(c: Any) -> Optional[str]:
    """One line saying which groups were split per stage and the step time as searched, or None."""
    searched = getattr(c, "searched", None)
    if searched is None:
        return None
    parts: Dict[str, List[str]] = {}
    for isl, g in c.island_groups.items():
        parts.setdefault(g, []).append(isl)
    split = "; ".join(f"group {g} -> islands {', '.join(v)}" for g, v in parts.items() if v != [g])
    head = (f"split per stage (one jax.distributed runtime each; its stages run concurrently): {split}"
            if split else "processes holding no stage left out")
    return (f"{head}; as searched (one island per group, its stages one action at a time): step "
            f"{searched.step_time_s:.4g} s")


def _mfu_note(c: Any) -> Optional[str]:
    """Why the candidate has no MFU (``catalog.mfu_not_applicable``: cpu or emulated islands; or no
    datasheet peak for a device), or None."""
    from hethub_jax.planner.catalog import mfu_not_applicable
    why = mfu_not_applicable(c.plan)
    if why is None and not (isinstance(c.mfu, (int, float)) and math.isfinite(c.mfu)):
        why = "n/a (no datasheet peak)"
    return why


def _mfu(c: Any) -> Optional[float]:
    """The candidate's PREDICTED MFU, or None where :func:`_mfu_note` gives a reason."""
    return None if _mfu_note(c) else c.mfu


def _mfu_text(c: Any) -> str:
    """``"41.2%"``, or ``"n/a (CPU, no peak)"`` and the like."""
    return _mfu_note(c) or f"{100 * c.mfu:.1f}%"


def _not_runnable(plan: Any) -> Optional[str]:
    """Why today's runtime cannot run ``plan`` (``rules.check_runtime_support``), or None."""
    try:
        check_runtime_support(plan)
    except ValueError as e:
        return str(e)
    return None


class _GroupInfo:
    def __init__(self, g: Any, costs: Any):
        self.device = g.device
        self.memory_bytes = costs.memory_bytes


def cost_source_lines(cluster: Any, costs: Dict[str, Any]) -> List[str]:
    """One line per group of ``cluster`` saying where its costs come from
    (``DeviceCosts.source_text``, the wording ``train --cluster`` prints too): a measured profile and
    its date, or the catalog's datasheet peak x efficiency (an assumption)."""
    return [f"group {g.name} ({g.device or 'profile'}): costs: {costs[g.name].source_text()}" for g in cluster.groups]


def _bucket_mb(text: str) -> Any:
    """``--grad-bucket-mb``: ``auto``, ``none`` (None) or a number of MiB > 0."""
    t = text.strip().lower()
    if t in ("auto", "none", "null"):
        return None if t != "auto" else "auto"
    try:
        v = float(t)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be auto, none or a number of MiB > 0, got {text!r}")
    return v


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from hethub_jax.planner import PlanningError, SearchOptions, default_seq_len, load_cluster, load_model, search
    from hethub_jax.planner.runnable import runnable_result
    from hethub_jax.planner.search import group_costs
    from hethub_jax.planner.costs import bridge_allreduce_text, read_bridge_allreduce
    from hethub_jax.planner.api import config_seq_len
    from hethub_jax.planner.search import DEFAULT_MEMORY_HEADROOM
    try:
        cfg = load_model(args.model)
        if not os.path.exists(args.cluster):
            raise ValueError(f"--cluster: file not found: {args.cluster} (a cluster spec YAML, "
                             f"docs/cluster_spec.md; examples in configs/clusters/)")
        if args.profiles is not None and not os.path.isdir(args.profiles):
            raise ValueError(f"--profiles: folder not found: {args.profiles} (a folder of profiles "
                             f"<device>.json / <group>.json from python -m hethub_jax.profile)")
        cluster = load_cluster(args.cluster).resolved()
        headroom = DEFAULT_MEMORY_HEADROOM if args.memory_headroom is None else args.memory_headroom
        opt = SearchOptions(top_k=args.top, max_stages_per_group=args.max_stages_per_group,
                            microbatch_sizes=tuple(args.microbatch_sizes) if args.microbatch_sizes else None,
                            hetero_dp=not args.no_hetero_dp, memory_headroom=headroom,
                            grad_bucket_mb=args.grad_bucket_mb)
        costs = group_costs(cluster, opt.efficiency, args.profiles)
        from_config = None if args.seq_len else config_seq_len(args.model)
        seq = args.seq_len or from_config or default_seq_len(cfg)
        seq_note = ("--seq-len" if args.seq_len else f"data.seq_len of {args.model}" if from_config else
                    f"default min(4096, max_position_embeddings {cfg.max_position_embeddings}); training "
                    f"defaults to data.seq_len 128: pass the same --seq-len to both")
        res = search(cfg, cluster, args.global_batch, seq, costs=costs, options=opt,
                     upper_bound=not args.no_upper_bound and args.no_split)
        if not args.no_split:
            res = runnable_result(res, cfg, cluster, seq, costs=costs, options=opt,
                                  upper_bound=not args.no_upper_bound)
    except PlanningError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        res.best.plan.to_json(args.out)
    if args.json:
        print(json.dumps({"predicted": True, "cluster": cluster.name, "global_batch": args.global_batch,
                          "seq_len": seq, "memory_headroom": opt.memory_headroom, "search": {"skeletons": res.skeletons, "expanded": res.expanded,
                                                     "evaluated": res.evaluated, "wall_s": res.wall_s},
                          "upper_bound_tokens_per_s": res.upper_bound_tokens_per_s,
                          "upper_bound_note": res.upper_bound_note,
                          "candidates": [{**candidate_dict(c), "chosen": i == 0}
                                         for i, c in enumerate(res.candidates)]}, indent=2))
        return 0
    groups = {g.name: _GroupInfo(g, costs[g.name]) for g in cluster.groups}
    print(f"PREDICTED plans for {args.model} on {cluster.name} ({cluster.num_devices} devices), global batch "
          f"{args.global_batch} x {seq} tokens; search {res.wall_s:.2f} s, {res.skeletons} configurations, "
          f"{res.evaluated} predictions")
    print(f"sequence length {seq} tokens per sample ({seq_note}); recorded in the plan")
    print(f"memory headroom {100 * opt.memory_headroom:g}% (--memory-headroom {opt.memory_headroom:g}): a stage "
          f"fits when its memory per device is at most {100 * (1 - opt.memory_headroom):g}% of the device's "
          f"capacity; memory in GiB (2**30 bytes)")
    for line in cost_source_lines(cluster, costs):
        print(line)
    saved = read_bridge_allreduce(args.profiles)
    if saved is not None:
        print(f"bridge all-reduce between islands: MEASURED {bridge_allreduce_text(saved['fit'])} ({saved['path']}, "
              f"measured {saved.get('date', '?')} on the ranks of a plan-less training job), for every group")
    for i, c in enumerate(res.candidates):
        print()
        print(format_candidate(i, c, groups, res.upper_bound_tokens_per_s,
                               res.upper_bound_note or ("upper bound skipped (--no-upper-bound)"
                                                        if args.no_upper_bound else None),
                               cluster.num_devices, res.best.prediction.step_time_s))
    if args.out:
        print(f"\nchosen plan written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
