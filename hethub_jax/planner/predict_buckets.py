"""PREDICTED bucketed against unbucketed gradient all-reduce of a heterogeneous-DP step (issue 17), no JAX.

The runtime (``hethub_jax.parallel.runtime``, ``train.grad_bucket_mb``) can all-reduce a heterogeneous-DP
step's gradients in two ways, both exact:

* **unbucketed**: after every replica's whole backward (what :func:`hethub_jax.planner.predictor.predict`
  has always predicted: pipeline, then the gradient sums + norm, then the update);
* **bucketed** (``hethub_jax.parallel.buckets``, PyTorch DDP's gradient buckets): a replica whose last
  microbatch is chunked (the ONE rule: :func:`hethub_jax.parallel.plan.chunks_last_microbatch`, replicas
  of two or more microbatches) runs that microbatch as one jitted program per layer bucket, and a
  background thread all-reduces each bucket while the next one computes; a replica of one microbatch runs
  it fused and hands its whole gradient to the same collectives at the end of its backward.

What the bucketed path changes in the PREDICTED step (:func:`bucketed_terms`, used by ``predict``):

1. **the chunked microbatch's own cost**: a chunked replica's last compute action (the fused F+B of its
   last microbatch) takes ``ratio x`` its fused seconds, ``ratio`` = the profile's MEASURED seconds of
   ``buckets.StageChunks.forward_backward`` over the fused ``PipelineStage.forward_backward`` of the same
   whole-model stage, same microbatch, timed interleaved (``python -m hethub_jax.profile --stage-shapes``
   with the whole model: :func:`hethub_jax.profile.measure_chunked_last`, ``fits.chunked_last``); 1.0
   when the profile did not measure it (the runtime's design figure: ``buckets`` module docstring,
   "the chunked microbatch then costs the same CPU time as the fused forward+backward" on ``tiny``),
   said in :attr:`BucketedTerms.ratio_source`;
2. **the bucket thread's host work on the island's own core**: on an island that computes on the host's
   CPU (platform ``cpu``: its compute and the bucket thread share the pinned core), the island's gradient
   sums (``DeviceCosts.shared_sum_s``: the float32 host copies and the sum) run during the chunked
   microbatch and lengthen it by their seconds (not stretched by an EMULATED slowdown: the runtime's
   ``_emulate`` stretches the compute's busy seconds only); on an accelerator they run on the host beside
   the device's compute and are hidden as far as the buckets' readiness allows (item 3);
3. **what is hidden**: the cross-island gradient transfer (ZeRO-1's reduce to the owners or the ring
   all-reduce over the bridge; the parameter gather stays after the update) and the sums of item 2 on
   accelerators, split over the buckets by their gradient bytes
   (:func:`hethub_jax.parallel.bucket_layout.layer_chunks`, the runtime's cut), run one bucket after the
   other on the bucket thread, a bucket starting when every replica has it: on a chunked replica bucket
   ``j`` (backward order) is ready at ``start + T (phi + (1 - phi) c_j)`` of its last action
   (``[start, start + T]``; ``phi`` = the forward's share of a microbatch's F + B, ``c_j`` = the bytes of
   buckets ``0..j`` over the stage's), on a one-microbatch replica at its end. The part still running
   when the last pipeline action ends is exposed (:func:`exposed_s`); the global norm, the ZeRO-1
   parameter gather's host work and the update stay after the pipeline, as unbucketed.

The predicted bucket thread is a model, not a measurement of it: its sleeping waits (``with_spin(0)``)
and the GIL are not modelled; docs/benchmarks.md (issue 17, session 15) sets it against measured runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hethub_jax.parallel.schedule import ActionKind
from hethub_jax.planner import analytic

__all__ = ["CHUNKED_FIT", "FIRST_BUCKET_BYTES", "BucketedTerms", "bucketing_off_reason", "chunked_last_ratio",
           "min_chunked_last_ratio", "computes_on_host", "bucket_fractions", "ready_times", "exposed_s"]

#: the profile's fit of the chunked last microbatch (``fits.chunked_last``, :func:`chunked_last_ratio`)
CHUNKED_FIT = "chunked_last"
#: the runtime's first bucket, bytes (``hethub_jax.parallel.buckets.DEFAULT_FIRST_BUCKET_BYTES``: DDP's
#: 1 MiB first bucket), capped at the bucket size as ``PipelineRuntime.set_grad_buckets`` caps it
FIRST_BUCKET_BYTES = 1 * 2**20


@dataclass(frozen=True)
class BucketedTerms:
    """The bucketed path's PREDICTED terms of one plan (:func:`bucketed_terms`).

    Attributes:
      chunked: per stage key ``(replica, 0)``, whether the replica chunks its last microbatch
        (:func:`hethub_jax.parallel.plan.chunks_last_microbatch`).
      ratio: per chunked key, chunked / fused seconds of its last microbatch (item 1 of the module).
      ratio_source: per chunked key, ``"profile"`` (measured) or ``"not measured (1.0)"``.
      on_core_s: per chunked key, seconds of the island's gradient sums added to its last action
        (item 2; 0 on an accelerator).
      fractions: the buckets' shares of the stage's gradient bytes, backward order (sum 1).
    """

    chunked: Dict[Tuple[int, int], bool]
    ratio: Dict[Tuple[int, int], float]
    ratio_source: Dict[Tuple[int, int], str]
    on_core_s: Dict[Tuple[int, int], float]
    fractions: Tuple[float, ...]


def bucketing_off_reason(plan: Any, arrays: Optional[Mapping[int, Any]] = None) -> Optional[str]:
    """None when the runtime would run ``plan``'s gradient all-reduce bucketed once buckets are on, else
    why not: the plan-side conditions of ``PipelineRuntime.grad_bucket_off_reason`` (several replicas,
    each ONE stage (on one process: an island of several processes per stage is not seen in a plan and
    is the caller's to check), every replica's last two compute actions F and B of one microbatch).
    ``arrays``: per replica its ``ScheduleArrays`` (else ``plan.actions(r)`` is asked)."""
    if plan.num_replicas < 2:
        return "one replica: no heterogeneous-DP gradients to all-reduce"
    if any(plan.num_stages(r) != 1 for r in range(plan.num_replicas)):
        return "replicas of several stages (bucketing needs one stage on one process each)"
    for r in range(plan.num_replicas):
        acts = arrays[r].lists[0] if arrays is not None else plan.actions(r)[0]
        comp = [a for a in acts if a.kind in (ActionKind.F, ActionKind.B)]
        if not (len(comp) >= 2 and comp[-1].kind == ActionKind.B and comp[-2].kind == ActionKind.F
                and comp[-1].microbatch == comp[-2].microbatch):
            return f"replica {r}'s last backward does not follow its own forward under schedule {plan.schedule}"
    return None


def chunked_last_ratio(costs: Any, tokens: float) -> Tuple[float, str]:
    """``(chunked / fused seconds of the last microbatch, source)`` for ``tokens`` tokens per microbatch from
    the profile's ``fits.chunked_last`` (``{"points": [[tokens, ratio], ...]}``, written by
    ``python -m hethub_jax.profile``: :func:`hethub_jax.profile.fit_chunked_last`): linear between the
    measured token counts, the nearest one's outside them. ``(1.0, "not measured (1.0)")`` without it
    (catalog costs, older profiles)."""
    fit = ((getattr(costs, "profile", None) or {}).get("fits") or {}).get(CHUNKED_FIT) or {}
    pts = sorted((float(t), float(r)) for t, r in fit.get("points") or () if float(r) > 0)
    if not pts:
        return 1.0, "not measured (1.0)"
    if tokens <= pts[0][0]:
        return pts[0][1], "profile"
    for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
        if tokens <= t1:
            return r0 + (r1 - r0) * (tokens - t0) / (t1 - t0), "profile"
    return pts[-1][1], "profile"


def min_chunked_last_ratio(costs: Any) -> float:
    """The least chunked / fused ratio :func:`chunked_last_ratio` can return for ``costs`` at ANY token count
    (the least measured point of ``fits.chunked_last``: the fit is linear between its points and flat
    outside them), 1.0 without a fit. The planner's pruning bounds use it (``planner.search``): the bucketed
    path scales a chunked replica's last compute action by the ratio and only ADDS seconds besides
    (``on_core_s`` >= 0), so that action takes at least ``min(1, this) x`` its fused seconds."""
    fit = ((getattr(costs, "profile", None) or {}).get("fits") or {}).get(CHUNKED_FIT) or {}
    pts = [float(r) for _, r in fit.get("points") or () if float(r) > 0]
    return min(pts) if pts else 1.0


def computes_on_host(costs: Any) -> bool:
    """True when the island computes on the host's CPU cores (its profile's ``platform`` is ``cpu``, or a
    catalog / profile device type named ``cpu``): the bucket thread's host work then shares its cores."""
    prof = getattr(costs, "profile", None) or {}
    return prof.get("platform") == "cpu" or str(getattr(costs, "name", "")).lower() == "cpu"


def bucket_fractions(cfg: Any, bucket_bytes: float, param_dtype_bytes: int) -> Tuple[float, ...]:
    """Each bucket's share of a whole-model replica's gradient bytes, backward order (sum 1): the runtime's
    cut (:func:`hethub_jax.parallel.bucket_layout.layer_chunks` over the layers' bytes, the head bucket
    holding the final norm, the LM head and the embedding besides its layers; first bucket
    ``min(FIRST_BUCKET_BYTES, bucket_bytes)``)."""
    from hethub_jax.parallel.bucket_layout import layer_chunks
    if not bucket_bytes > 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    L, pb = cfg.num_hidden_layers, param_dtype_bytes
    lay = analytic.layer_params(cfg) * pb
    head = (analytic.head_params(cfg) + analytic.embed_params(cfg)) * pb
    chunks = layer_chunks([lay] * L, 0, head, int(bucket_bytes), int(min(FIRST_BUCKET_BYTES, bucket_bytes)))
    sizes = [(b - a + 1) * lay + (head if j == 0 else 0) for j, (a, b) in enumerate(chunks)]
    total = float(sum(sizes))
    return tuple(s / total for s in sizes)


def ready_times(start_s: float, end_s: float, forward_fraction: float, fractions: Sequence[float],
                chunked: bool) -> List[float]:
    """When each bucket's gradients are final on one replica whose last compute action runs over
    ``[start_s, end_s]``: chunked, bucket ``j`` at ``start + T (phi + (1 - phi) c_j)`` (``T`` the action's
    seconds, ``phi`` = ``forward_fraction``, ``c_j`` the cumulated ``fractions`` through ``j``); not
    chunked (a one-microbatch replica handing its whole gradient over), every bucket at ``end_s``.

    Raises:
      ValueError: if ``end_s < start_s`` or ``forward_fraction`` is outside [0, 1].
    """
    if end_s < start_s or not 0.0 <= forward_fraction <= 1.0:
        raise ValueError(f"need start <= end and 0 <= forward_fraction <= 1 (got {start_s}, {end_s}, "
                         f"{forward_fraction})")
    if not chunked:
        return [end_s] * len(fractions)
    out, c, T = [], 0.0, end_s - start_s
    for f in fractions:
        c += f
        out.append(start_s + T * (forward_fraction + (1.0 - forward_fraction) * min(c, 1.0)))
    return out


def exposed_s(ready_s: Sequence[float], durations_s: Sequence[float], pipeline_end_s: float) -> float:
    """Seconds of the bucket thread's work still running at ``pipeline_end_s``: bucket ``j`` starts at
    ``max(ready_s[j], end of bucket j - 1)`` and takes ``durations_s[j]`` (one bucket at a time, as the
    runtime's one-thread pool runs them). Example (hand check): ready (1, 2), durations (0.5, 0.5), end 2:
    bucket 0 runs 1-1.5, bucket 1 runs 2-2.5: 0.5 s exposed; with end 3: 0."""
    t = float("-inf")
    for r, d in zip(ready_s, durations_s):
        t = max(t, r) + d
    return max(0.0, t - pipeline_end_s) if ready_s else 0.0


def forward_fraction(ctx: Any) -> float:
    """The forward's share of one microbatch's F + B on a stage (``_StageCtx`` ``t_f`` / ``t_b``); 1/3
    (the analytic FLOP ratio 1 : 2) when both are 0."""
    s = ctx.t_f + ctx.t_b
    return ctx.t_f / s if s > 0 else 1.0 / 3.0


def bucketed_terms(cfg: Any, plan: Any, ctxs: Mapping[Tuple[int, int], Any], sums_per_island: Mapping[str, float],
                   bucket_bytes: float) -> BucketedTerms:
    """Items 1-2 of the module docstring for a plan that buckets (:func:`bucketing_off_reason` None):
    which replicas chunk, their measured ratio and the seconds added on their core. ``sums_per_island``:
    each island's gradient sums (``DeviceCosts.shared_sum_s`` part of the predictor's reduction)."""
    from hethub_jax.parallel.plan import chunks_last_microbatch
    chunked, ratio, src, on_core = {}, {}, {}, {}
    for k, c in ctxs.items():
        r = k[0]
        chunked[k] = chunks_last_microbatch(plan.num_microbatches(r))
        if chunked[k]:
            ratio[k], src[k] = chunked_last_ratio(c.costs, c.tokens)
            on_core[k] = sums_per_island.get(c.spec.island, 0.0) if computes_on_host(c.costs) else 0.0
    return BucketedTerms(chunked, ratio, src, on_core,
                         bucket_fractions(cfg, bucket_bytes, analytic.dtype_bytes(cfg.param_dtype)))
