"""Predictions for a training run, and plan-less training (issue 13 part 5, issue 17 part 1).

Two entry points used by ``hethub_jax.train`` during set-up (before any JAX import in this process):

* :func:`predict_run`: the PREDICTED step of the plan the run trains (``planner.predictor.predict``), from
  measured profiles when given (``--profiles DIR``), else the device catalog's ``cpu`` entry (a stated
  assumption, not a measurement); :class:`RunPrediction` says which.
* :func:`plan_from_cluster`: ``--cluster CLUSTER.yaml`` without ``--plan``: profile the CPU device type of
  the cluster briefly (``python -m hethub_jax.profile`` in a child process with small settings) or reuse
  saved profiles, ask the planner (``hethub_jax.planner.search``, split per stage as the plan CLI does:
  ``planner.runnable``), write the chosen plan as ``plan.json``
  beside the metrics. Under ``mpiexec`` rank 0 profiles and plans and sends the plan and the profiles to
  every other rank (so every rank trains the SAME plan; ``cluster.handshake`` then checks the plan digest).
  Between the profiles and the search, a job of 2 ranks measures the MPI bridge's all-reduce between its
  own ranks (:func:`bridge_allreduce_step`: ``profile.measure_bridge_allreduce`` and its Hockney fit, saved as
  ``<profiles>/bridge_allreduce.json``), which the planner then uses for the cross-island gradient all-reduce.

Every figure here is PREDICTED and labelled so. This module imports no JAX (the profiler runs in a child
process, so the training process can still choose its JAX platform and device count afterwards).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from hethub_jax.planner.costs import cost_source_text

__all__ = ["RunPrediction", "predict_run", "plan_from_cluster", "profile_device", "measured_bubble",
           "PROFILE_SETTINGS", "planner_microbatch_sizes", "microbatch_sizes_to_profile", "tp_degrees_to_profile",
           "profiled_tp_degrees", "dp_degrees_to_profile", "dp_microbatch_sizes_to_profile", "profiled_dp_degrees",
           "profiled_microbatch_sizes", "chunked_microbatch_sizes_to_profile", "extrapolation_note", "plan_command",
           "cores_note", "grad_allreduce_line", "chunked_ratio_text", "prediction_on_kept_path"]

#: the brief profile of plan-less training (``python -m hethub_jax.profile`` flags): the fastest of 2
#: timed calls (the machine may be shared); no co-run slowdown, runtime per-action seconds or in-process
#: bridge (the training islands are processes, planned without them). The microbatch sizes, TP and DP
#: degrees are added per run (:func:`microbatch_sizes_to_profile`, :func:`tp_degrees_to_profile`,
#: :func:`dp_degrees_to_profile`: every size and degree the planner may choose is measured, none
#: extrapolated).
PROFILE_SETTINGS = ("--repeats", "2", "--statistic", "min", "--corun", "off", "--no-runtime")


# ---------------------------------------------------------------------------------------------------
# profile coverage of the microbatch sizes (issue 17: a plan at microbatch 8 predicted from a profile
# of 1, 2, 4 was 26% low; measured per-sample cost on one CPU core: flat from 4 to 8, +7% at 16 and 32,
# while the line fitted on 1, 2, 4 has a per-call intercept that the larger sizes do not pay)

def planner_microbatch_sizes(global_batch: int, microbatch_size: Optional[int] = None) -> List[int]:
    """The microbatch sizes the planner may choose (``planner.search``: the given one, else every
    divisor of the global batch), ascending.

    Raises:
      ValueError: if ``global_batch < 1`` or ``microbatch_size`` does not divide it.
    """
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if microbatch_size is not None:
        if microbatch_size < 1 or global_batch % microbatch_size:
            raise ValueError(f"microbatch_size {microbatch_size} must be >= 1 and divide the global batch "
                             f"{global_batch}")
        return [int(microbatch_size)]
    return [d for d in range(1, global_batch + 1) if global_batch % d == 0]


def microbatch_sizes_to_profile(sizes: List[int], every_power_of_two: bool = False) -> List[int]:
    """Microbatch sizes to profile so that each of ``sizes`` (the planner's choices) is interpolated
    between profiled sizes, never extrapolated beyond them: 1 and 2 (two points for the fitted lines
    even when one size is planned), the largest of ``sizes``, the sizes themselves when there are at
    most two (e.g. the microbatch the config fixes), and with ``every_power_of_two`` each power of two
    in between (more points where the cost bends; a longer profile). Ascending, no duplicates.

    Raises:
      ValueError: for an empty list or a size < 1.
    """
    if not sizes or min(sizes) < 1:
        raise ValueError(f"microbatch sizes must be a non-empty list of integers >= 1, got {sizes}")
    top = max(sizes)
    out = {1, 2, top}
    if len(sizes) <= 2:
        out |= set(sizes)
    if every_power_of_two:
        p = 4
        while p < top:
            out.add(p)
            p *= 2
    return sorted(out)


#: the largest microbatch size :func:`chunked_microbatch_sizes_to_profile` picks (as the profiler's ``auto``,
#: ``hethub_jax.profile.CHUNKED_MAX_MBS``; repeated here: this module imports no JAX)
CHUNKED_MAX_MBS = 16


def chunked_microbatch_sizes_to_profile(sizes: List[int]) -> List[int]:
    """The microbatch sizes at which plan-less training's brief profile times the bucketed all-reduce's
    chunked last microbatch against the fused one (``python -m hethub_jax.profile --chunked-mbs``,
    ``fits.chunked_last``, read by ``planner.predict_buckets.chunked_last_ratio``): the smallest and the
    largest of the planner's ``sizes`` up to :data:`CHUNKED_MAX_MBS` (the smallest alone when only one is),
    ascending; the predictor interpolates the ratio linearly in tokens between them and takes the nearest
    one's outside them. Two sizes keep it brief: 3 x (repeats + 1) whole-model forward + backward calls
    each, plus compiling the chunks' programs.

    Raises:
      ValueError: for an empty ``sizes`` or a size < 1."""
    if not sizes or min(sizes) < 1:
        raise ValueError(f"microbatch sizes must be a non-empty list of sizes >= 1, got {sizes}")
    under = [m for m in sizes if m <= CHUNKED_MAX_MBS] or [min(sizes)]
    return sorted({min(under), max(under)})


def tp_degrees_to_profile(cfg: Any, groups: List[Any]) -> List[int]:
    """The TP degrees the planner may choose for ``groups`` (``planner.cluster`` groups, defaults
    filled): 1 and every divisor of a group's ``devices_per_node`` that fits the model
    (``parallel.rules.check_tp``), ascending. Profiling them all keeps TP costs measured: a degree not
    profiled is predicted from the nearest lower one with its per-FLOP slope divided by the ratio
    (``planner.costs``), i.e. perfect TP scaling, which fake CPU devices sharing a machine's cores do
    not reach (a clean-clone run of README's main command: TP 2 PREDICTED at half of TP 1's time,
    measured step 4.3x the PREDICTED one)."""
    from hethub_jax.parallel.rules import check_tp
    out = {1}
    for g in groups:
        n = int(getattr(g, "devices_per_node", None) or 1)
        for t in range(2, n + 1):
            if n % t:
                continue
            try:
                check_tp(cfg, t)
            except ValueError:
                continue
            out.add(t)
    return sorted(out)


def dp_degrees_to_profile(groups: List[Any], microbatch_sizes: List[int]) -> List[int]:
    """The DP degrees > 1 of a stage inside one node that the planner may choose for ``groups``
    (``planner.cluster`` groups, defaults filled) at the planner's ``microbatch_sizes``: every ``d`` in
    2..``devices_per_node`` that divides one of the sizes (``planner.search``'s ``choices``: DP divides
    the microbatch), ascending. Profiled as ``(d, 1)`` meshes (``python -m hethub_jax.profile --dp``).
    A DP degree not profiled is predicted from one device with ``1/d`` of the tokens, i.e. perfectly
    parallel, which fake CPU devices sharing a host's cores do not reach (measured: README's main
    command chose DP 2 over the two fake devices of island ``fast`` and took 2.8x its PREDICTED
    step; docs/benchmarks.md, issue 17). DP across nodes is not profiled here (the profile runs on one machine)."""
    out = set()
    for g in groups:
        n = int(getattr(g, "devices_per_node", None) or 1)
        out |= {d for d in range(2, n + 1) if any(m % d == 0 for m in microbatch_sizes)}
    return sorted(out)


def dp_microbatch_sizes_to_profile(microbatch_sizes: List[int], dp_degrees: List[int]) -> List[int]:
    """Microbatch sizes PER DP RANK at which the ``(d, 1)`` meshes are profiled: those of
    :func:`microbatch_sizes_to_profile` over ``m / d`` for each planner size ``m`` divisible by a degree
    ``d`` of ``dp_degrees`` (so that no planner choice is extrapolated, and no mesh runs a microbatch
    larger than the planner's largest); [] without DP degrees."""
    per_rank = sorted({m // d for m in microbatch_sizes for d in dp_degrees if m % d == 0})
    return microbatch_sizes_to_profile(per_rank) if per_rank else []


def profiled_dp_degrees(profile: Optional[Mapping[str, Any]]) -> List[int]:
    """The DP degrees a profile's stage calls were measured at (1 and the ``(dp, 1)`` meshes); [] for
    None or a profile without samples (the catalog)."""
    if not profile:
        return []
    return sorted({int(s.get("dp", 1)) for s in profile.get("samples", ()) if s.get("kind") == "stage"})


def profiled_tp_degrees(profile: Optional[Mapping[str, Any]]) -> List[int]:
    """The TP degrees a profile's stage calls were measured at (``dp`` 1 samples); [] for None or a
    profile without samples (the catalog)."""
    if not profile:
        return []
    return sorted({int(s.get("tp", 1)) for s in profile.get("samples", ())
                   if s.get("kind") == "stage" and int(s.get("dp", 1)) == 1})


def profiled_microbatch_sizes(profile: Optional[Mapping[str, Any]]) -> List[int]:
    """The microbatch sizes (samples per DP rank) a profile's stage calls were measured at, from its
    ``samples`` (``tokens / seq_len`` of the ``"stage"`` samples); [] for None or a profile without
    them (the catalog)."""
    if not profile:
        return []
    seq = int(profile.get("seq_len") or 0)
    if seq < 1:
        return []
    return sorted({int(s["tokens"]) // seq for s in profile.get("samples", ())
                   if s.get("kind") == "stage" and int(s.get("dp", 1)) == 1})


def extrapolation_note(plan: Any, profiles: Mapping[str, Optional[Mapping[str, Any]]]) -> Optional[str]:
    """One line when ``plan``'s microbatch (per DP rank of a stage) lies outside the microbatch sizes an
    island's profile measured (its costs are then EXTRAPOLATED from the profile's fitted lines, not
    measured at that size), else None. ``profiles``: per island name, the profile dict (None: the
    catalog, not a profile: no note)."""
    out = []
    for isl in plan.islands:
        sizes = profiled_microbatch_sizes(profiles.get(isl.name))
        if not sizes:
            continue
        stages = [st for rep in plan.replicas for st in rep.stages if st.island == isl.name]
        per_rank = sorted({plan.microbatch_size // st.dp for st in stages})
        beyond = [m for m in per_rank if m < sizes[0] or m > sizes[-1]]
        if beyond:
            out.append(f"{isl.name} (microbatch {', '.join(map(str, beyond))}; profiled "
                       f"{', '.join(map(str, sizes))})")
        tps = profiled_tp_degrees(profiles.get(isl.name))
        missing = sorted({st.tp for st in stages} - set(tps))
        if missing:
            out.append(f"{isl.name} (TP {', '.join(map(str, missing))}; profiled TP {', '.join(map(str, tps))}: "
                       f"scaled as if perfectly parallel)")
        dps = profiled_dp_degrees(profiles.get(isl.name))
        # the profiler measures (dp, 1) meshes only: a dp > 1 stage with TP > 1 is scaled too
        missing_dp = sorted({(st.dp, st.tp) for st in stages if st.dp > 1 and (st.dp not in dps or st.tp > 1)})
        if missing_dp:
            out.append(f"{isl.name} (DP x TP {', '.join(f'{d}x{t}' for d, t in missing_dp)}; profiled DP "
                       f"{', '.join(map(str, dps))} at TP 1: scaled as if perfectly parallel)")
    if not out:
        return None
    return ("PREDICTED costs EXTRAPOLATED beyond the profiled microbatch sizes, TP or DP degrees on " + "; ".join(out)
            + ": profile them (python -m hethub_jax.profile --microbatch-sizes ... --tp ... --dp ...) for a "
              "measured figure")

#: environment variables of MPI launchers; removed for the profiler child so that it starts as a
#: single-process (singleton) MPI program instead of joining the job
_LAUNCHER_ENV = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "OMPI_", "MPI_LOCAL", "I_MPI_")


@dataclasses.dataclass
class RunPrediction:
    """The PREDICTED step of the plan a run trains.

    Attributes:
      prediction: ``planner.predictor.Prediction`` (step time s, tokens/s, stages, timeline).
      costs: per island name, the ``planner.costs.DeviceCosts`` used.
      bridge: the ``costs.LinkModel`` between islands (None: the predictor's default).
      seq_len: tokens per sample.
      source: one line saying where the costs came from (profile files or the catalog).
      plan: the plan predicted (None: not kept); the banner then names each stage mesh's figures.
      bridge_allreduce: plan-less training: where the cross-island gradient all-reduce's figure comes from
        (:func:`bridge_allreduce_step`: ``"MEASURED alpha .. s, beta .. s/byte on this job's ranks ..."`` or
        ``"catalog default ..."``); None: not said (a run with ``--plan``).
    """

    prediction: Any
    costs: Dict[str, Any]
    bridge: Any
    seq_len: int
    source: str
    plan: Any = None
    bridge_allreduce: Optional[str] = None

    def records(self, cfg: Any, plan: Any, offset_s: float) -> list:
        """PREDICTED ``ActionRecord``s of one step starting at ``offset_s`` (seconds, the measured clock),
        islands named ``"predicted: <island>"`` (``predictor.predicted_records``)."""
        from hethub_jax.planner.predictor import predicted_records
        return predicted_records(cfg, plan, self.costs, seq_len=self.seq_len, bridge=self.bridge,
                                 offset_s=offset_s, prediction=self.prediction)

    @property
    def bubble_fraction(self) -> float:
        """Mean over stages of the PREDICTED bubble fraction."""
        st = self.prediction.stages
        return sum(s.bubble_fraction for s in st) / len(st) if st else 0.0

    def summary(self) -> Dict[str, Any]:
        """JSON summary for the metrics file's ``run`` record (every figure PREDICTED)."""
        p = self.prediction
        return {"predicted": True, "source": self.source, "step_time_s": p.step_time_s,
                "tokens_per_s": p.tokens_per_s, "bubble_fraction": self.bubble_fraction,
                "fits": p.fits, "critical_path": p.critical_path,
                "grad_allreduce": getattr(p, "grad_allreduce", "unbucketed"),
                "step_time_unbucketed_s": getattr(p, "step_time_unbucketed_s", None),
                "step_time_bucketed_s": getattr(p, "step_time_bucketed_s", None),
                "faster_grad_allreduce": (getattr(p, "buckets", None) or {}).get("faster"),
                "bridge_allreduce_source": self.bridge_allreduce,
                "stages": [{"replica": s.replica, "stage": s.stage, "island": s.island, "source": s.source,
                            "memory_bytes": s.memory.total, "bubble_fraction": s.bubble_fraction}
                           for s in p.stages]}

    def banner(self) -> List[str]:
        """Lines for the start-up banner."""
        p = self.prediction
        lines = [f"PREDICTED step time {p.step_time_s:.4g} s ({p.tokens_per_s:,.0f} tokens/s, mean bubble "
                 f"{100 * self.bubble_fraction:.1f}%) from {self.source}"]
        line = grad_allreduce_line(p)
        lines += [line] if line else []
        if self.bridge_allreduce:
            lines.append(f"  gradient all-reduce between islands (bridge): {self.bridge_allreduce}")
        for s in p.stages:
            lines.append(f"  PREDICTED replica {s.replica} stage {s.stage} on {s.island}: "
                         f"{s.memory.total / 2**20:,.0f} MiB per device, bubble {100 * s.bubble_fraction:.1f}%"
                         + self._mesh_note(s))
        return lines

    def _mesh_note(self, s: Any) -> str:
        """``"; compute from <where>"`` for stage ``s`` (``DeviceCosts.mesh_source`` of its (dp, tp) mesh:
        the catalog, a measured profile mesh, or a scaled one), "" without the plan."""
        costs = self.costs.get(s.island)
        try:
            spec = self.plan.replicas[s.replica].stages[s.stage]
        except (AttributeError, IndexError, TypeError):
            return ""
        return f"; compute from {costs.mesh_source(spec.dp, spec.tp)}" if hasattr(costs, "mesh_source") else ""


def grad_allreduce_line(p: Any) -> Optional[str]:
    """One line on a heterogeneous-DP plan's two gradient all-reduce paths, both PREDICTED: the step
    bucketed and unbucketed, which the run is configured for and which is PREDICTED faster; None when the
    plan cannot bucket (``Prediction.step_time_bucketed_s`` None)."""
    b, u, bk = getattr(p, "step_time_bucketed_s", None), getattr(p, "step_time_unbucketed_s", None), \
        getattr(p, "buckets", None)
    if b is None or u is None or not bk:
        return None
    return (f"  PREDICTED gradient all-reduce: bucketed {b:.4g} s, unbucketed {u:.4g} s per step; "
            f"PREDICTED faster: {bk.get('faster')} (this run: {p.grad_allreduce}; {chunked_ratio_text(bk)})")


def chunked_ratio_text(buckets: Mapping[str, Any]) -> str:
    """In words, the bucketed path's chunked last microbatch against the fused forward+backward call it
    replaces, per chunking replica (``Prediction.buckets``: ``ratio`` and ``ratio_source`` per replica name,
    from ``planner.predict_buckets.chunked_last_ratio``): ``"chunked last microbatch of r0 (fast): MEASURED
    x1.115 of the fused call"`` (the profile's ``fits.chunked_last``), ``"... : not measured, taken as the
    fused call's time (x1.0)"`` (no fit: catalog costs, older profiles); ``"no replica chunks its last
    microbatch"`` without a chunking replica."""
    ratio, source = buckets.get("ratio") or {}, buckets.get("ratio_source") or {}
    if not ratio:
        return "no replica chunks its last microbatch"
    parts = []
    for name, r in ratio.items():
        src = source.get(name)
        if src == "profile":
            parts.append(f"of {name}: MEASURED x{r:.3f} of the fused call")
        elif src is None or str(src).startswith("not measured"):
            parts.append(f"of {name}: not measured, taken as the fused call's time (x{r:.1f})")
        else:
            parts.append(f"of {name}: x{r:.3f} of the fused call ({src})")
    return "chunked last microbatch " + "; ".join(parts)


def prediction_on_kept_path(cfg: Any, plan: Any, prediction: Any, costs: Mapping[str, Any], seq_len: int,
                            bridge: Any, choice: Optional[Mapping[str, Any]]) -> Any:
    """The PREDICTED step on the gradient all-reduce path a run KEPT: ``prediction`` itself when the
    MEASURED choice ``choice`` (``PipelineRuntime.grad_bucket_choice``, made by ``train.grad_bucket_mb:
    auto``'s warm-up, ``hethub_jax.train.warm_up_grad_allreduce``) kept the path ``prediction`` is on
    (``Prediction.grad_allreduce``), when there is no choice (a number or null ``grad_bucket_mb``) or it
    chose nothing (the plan cannot bucket), or when the plan was not PREDICTED on both paths
    (``step_time_bucketed_s`` None); else ``planner.predictor.predict`` again on the kept path (bucketed
    at the choice's ``bucket_mb``, or unbucketed), whose other-path figures equal ``prediction``'s. The ONE
    copy of this rule: training (``train._predict_kept_path``) and ``benchmarks/hetero_e2e.py`` call it.

    Args:
      cfg, plan, costs (per island name), seq_len, bridge: as ``predict`` was called for ``prediction``.
      prediction: a ``planner.predictor.Prediction``.
      choice: ``{"path": "bucketed" | "unbucketed" | None, "bucket_mb": MiB, ...}`` or None.
    """
    if not choice or choice.get("path") not in ("bucketed", "unbucketed"):
        return prediction
    if getattr(prediction, "step_time_bucketed_s", None) is None \
            or getattr(prediction, "grad_allreduce", choice["path"]) == choice["path"]:
        return prediction
    from hethub_jax.planner.predictor import predict
    return predict(cfg, plan, dict(costs), seq_len=seq_len, bridge=bridge,
                   grad_bucket_mb=choice.get("bucket_mb") if choice["path"] == "bucketed" else None)


def _profile_date(path: Optional[str]) -> Optional[str]:
    """The ``date`` a profile file records (when it was measured), or None when unreadable."""
    try:
        with open(path) as f:
            return json.load(f).get("date")
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _profile_for_island(profiles_dir: Optional[str], isl: Any) -> Optional[str]:
    if not profiles_dir:
        return None
    for name in (isl.name, isl.platform):
        p = os.path.join(profiles_dir, f"{name}.json")
        if os.path.exists(p):
            return p
    return None


def predict_run(cfg: Any, plan: Any, seq_len: int, *, profiles_dir: Optional[str] = None,
                costs: Optional[Mapping[str, Any]] = None, bridge: Any = None,
                source: Optional[str] = None, grad_bucket_mb: Optional[Union[float, str]] = None) -> RunPrediction:
    """The PREDICTED step of ``plan`` (``cfg`` a ``LlamaConfig``, ``seq_len`` tokens per sample).
    ``grad_bucket_mb``: the run's ``train.grad_bucket_mb`` (None: buckets off; ``"auto"``: the faster PREDICTED path): a heterogeneous-DP plan's
    step is PREDICTED on the path the run is configured for, the other path's figure beside it
    (``Prediction.step_time_bucketed_s`` / ``step_time_unbucketed_s``, :meth:`RunPrediction.banner`).

    Costs: ``costs`` when given; else per island ``<profiles_dir>/<island>.json`` or
    ``<profiles_dir>/<platform>.json`` when present (measured), else the catalog's ``cpu`` entry for a
    cpu island (``DeviceCosts.from_catalog``, efficiency 0.4: an assumption, not a measurement).

    Raises:
      ValueError: a non-cpu island with neither a profile nor costs (``predictor.costs_for_plan``).
    """
    from hethub_jax.planner.predictor import costs_for_plan, predict
    if costs is None:
        found = {i.name: _profile_for_island(profiles_dir, i) for i in plan.islands}
        costs = costs_for_plan(plan, {k: v for k, v in found.items() if v})
        if source is None:
            parts = [cost_source_text("cpu", profile_path=v, measured=_profile_date(v)) if v else cost_source_text("cpu")
                     for v in found.values()]
            by_text: Dict[str, List[str]] = {}  # islands of one source named once: "fast, slow: catalog ..."
            for k, p in zip(found, parts):
                by_text.setdefault(p, []).append(k)
            source = "; ".join(f"{', '.join(ks)}: {p}" for p, ks in by_text.items())
    pred = predict(cfg, plan, dict(costs), seq_len=seq_len, bridge=bridge, grad_bucket_mb=grad_bucket_mb)
    return RunPrediction(pred, dict(costs), bridge, seq_len, source or "given costs", plan)


def measured_bubble(records: list, start_s: Optional[float] = None) -> Optional[float]:
    """The MEASURED bubble fraction of one step's ``ActionRecord``s of EVERY stage (e.g. those
    ``train_insight.GatherRecordsHook`` gathers on the logging rank), as the simulator defines the
    PREDICTED one (``planner.simulator.Timeline.bubble_fraction``, ``StagePrediction.bubble_fraction``):
    the mean over stages ``(replica, stage)`` of ``1 - busy / pipeline``, where ``busy`` is the stage's
    seconds in F and B actions (emulated waits included: they stand for the slower device's compute, as
    in the prediction) and ``pipeline`` the step's pipeline time, from ``start_s`` (default: the
    earliest record's start) to the end of the last record of any stage. Idle time counts wherever it
    falls: waits in receives, before a stage's first action (warm-up), after its last one (cool-down,
    or a fast replica waiting for a slow one). The gradient all-reduce and the update come after the
    pipeline and are not bubble (the prediction times them separately). During training the runtime
    measures the same figure every step over all ranks (``StepResult.bubble``,
    ``trace.bubble_terms`` / ``trace.bubble_from_terms``). None without records."""
    from hethub_jax.parallel.trace import bubble_from_terms, bubble_terms
    return bubble_from_terms([bubble_terms(records, start_s)]) if records else None


# ---------------------------------------------------------------------------------------------------
# plan-less training

def profile_device(model: str, seq_len: int, out: str, timeout_s: float = 600.0,
                   microbatch_sizes: Tuple[int, ...] = (1, 2), tp_degrees: Tuple[int, ...] = (1,),
                   dp_degrees: Tuple[int, ...] = (), dp_microbatch_sizes: Tuple[int, ...] = (),
                   chunked_microbatch_sizes: Tuple[int, ...] = ()) -> Tuple[bool, str]:
    """Profile this machine's CPU as device type ``cpu`` into ``out`` (``python -m hethub_jax.profile``
    with :data:`PROFILE_SETTINGS` at ``microbatch_sizes`` and ``tp_degrees``, and ``(d, 1)`` meshes for
    each of ``dp_degrees`` (> 1) at ``dp_microbatch_sizes`` per DP rank, preset ``model``; a TP or DP
    degree above 1 runs on fake CPU devices of this machine, which share its cores: measured, not
    assumed parallel) in a child process with the MPI launcher's variables removed; with
    ``chunked_microbatch_sizes``, also the bucketed all-reduce's chunked last microbatch against the fused
    one at those sizes (``--chunked-mbs``: ``fits.chunked_last``; without them it is not measured). Returns
    ``(ok, message)``; never raises for a failed profile (the caller falls back to the catalog and
    says so)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV)}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "hethub_jax.profile", "--model", model, "--seq-len", str(seq_len),
           "--device-type", "cpu", "--out", out, "--microbatch-sizes", ",".join(map(str, microbatch_sizes)),
           "--tp", ",".join(map(str, tp_degrees)), *PROFILE_SETTINGS]
    if dp_degrees:
        cmd += ["--dp", ",".join(map(str, (1, *dp_degrees))),
                "--dp-microbatch-sizes", ",".join(map(str, dp_microbatch_sizes or microbatch_sizes))]
    cmd += ["--chunked-mbs", ",".join(map(str, chunked_microbatch_sizes)) if chunked_microbatch_sizes else "none"]
    t0 = time.perf_counter()
    try:
        rc, err = _run_showing_stderr(cmd, env, timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"profiling timed out after {timeout_s:.0f} s"
    if rc != 0 or not os.path.exists(out):
        lines = err.strip().splitlines() or ["no output"]
        errors = [x for x in lines if x.split(":")[0].endswith(("Error", "Exception", "Exit"))]
        last = (errors or lines)[-1]
        return False, f"profiling failed (exit {rc}: {last[:200]})"
    return True, f"profiled in {time.perf_counter() - t0:.0f} s"


def _run_showing_stderr(cmd: List[str], env: Mapping[str, str], timeout_s: float) -> Tuple[int, str]:
    """Runs ``cmd``; its stderr (the profiler's progress bar) is copied to this process's stderr as it
    comes, so that minutes of profiling are not silent, and also returned. Returns ``(exit status,
    stderr text)``. Raises ``subprocess.TimeoutExpired`` (after killing the child) past ``timeout_s``."""
    import threading
    p = subprocess.Popen(cmd, env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    chunks: List[bytes] = []

    def pump() -> None:
        for chunk in iter(lambda: p.stderr.read1(4096), b""):
            chunks.append(chunk)
            try:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
            except (AttributeError, ValueError, OSError):  # stderr replaced or closed: keep collecting
                pass

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        rc = p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    finally:
        t.join(timeout=5.0)
    return rc, b"".join(chunks).decode(errors="replace")


def _profiles(cluster: Any, model: str, seq_len: int, profiles_dir: str, log,
              microbatch_sizes: Tuple[int, ...] = (1, 2), cfg: Any = None,
              planner_sizes: Optional[Tuple[int, ...]] = None) -> Tuple[Dict[str, Any], List[str]]:
    """Per group name, a profile dict (or None: the catalog), and one line per profile file (or catalog
    entry) saying which groups use it: groups of one device type share one profile (emulated slowdowns
    are applied by the predictor), reported once, not once per group. A profile that is measured here
    is measured at ``microbatch_sizes`` and, given the model's ``cfg``, at every TP degree the planner
    may choose for its groups (:func:`tp_degrees_to_profile`; without ``cfg``: TP 1) and every DP degree
    inside a node it may choose at the microbatch sizes ``planner_sizes`` (:func:`dp_degrees_to_profile`;
    without ``planner_sizes``: none), and the chunked last microbatch at
    :func:`chunked_microbatch_sizes_to_profile` of ``planner_sizes`` (without them: not measured)."""
    users: Dict[str, List[Any]] = {}  # profile path -> the groups using it, in cluster order
    for g in cluster.resolved().groups:
        users.setdefault(g.profile or _profile_path(profiles_dir, g), []).append(g)
    out: Dict[str, Any] = {}
    notes: List[str] = []
    for path, groups in users.items():
        tps = tuple(tp_degrees_to_profile(cfg, groups)) if cfg is not None else (1,)
        dps = tuple(dp_degrees_to_profile(groups, list(planner_sizes))) if planner_sizes else ()
        dp_sizes = tuple(dp_microbatch_sizes_to_profile(list(planner_sizes), list(dps))) if dps else ()
        chunked = tuple(chunked_microbatch_sizes_to_profile(list(planner_sizes))) if planner_sizes else ()
        notes.append(f"{_groups_text(groups)}: "
                     f"{_get_profile(path, groups, model, seq_len, log, microbatch_sizes, tps, dps, dp_sizes, chunked)}")
        prof = None
        if os.path.exists(path):
            with open(path) as f:
                prof = json.load(f)
            busy = (prof or {}).get("others_cpu_share")
            if busy is not None and busy > 0.05:  # the profiler's own note goes to its stdout, not shown here
                notes[-1] += (f" (note: other processes used {100 * busy:.0f}% of this machine's CPUs while it was "
                              f"profiled: its figures include their load, and so does the PREDICTED step)")
            note = cores_note(prof)
            if note:
                notes[-1] += f" ({note})"
        out.update({g.name: prof for g in groups})
    return out, notes


def cores_note(profile: Optional[Mapping[str, Any]], cores: Optional[int] = None) -> Optional[str]:
    """A note when a CPU profile was measured on another number of cores than this process may use
    (``cores``, default ``len(os.sched_getaffinity(0))``; the profile's ``host_cpus``): plan-less
    training pins each CPU island's process to its own cores (``core_pinning``), and a profile saved by
    an unpinned run (every core of the host) times its computations faster than the pinned island runs
    them. None when the counts agree, the profile does not say, or it is not a CPU profile."""
    if not profile or profile.get("platform", "cpu") != "cpu" or not profile.get("host_cpus"):
        return None
    if cores is None:
        if not hasattr(os, "sched_getaffinity"):
            return None
        cores = len(os.sched_getaffinity(0))
    have = int(profile["host_cpus"])
    if have == cores:
        return None
    return (f"note: this profile was measured on {have} core{'s' if have != 1 else ''}, this island runs on "
            f"{cores}: its PREDICTED step follows the profile's cores; delete it to measure it again here")


def _profile_path(profiles_dir: str, g: Any) -> str:
    """The profile file of group ``g`` in ``profiles_dir``, looked up as the plan CLI's ``--profiles``
    does (``planner.search.group_costs``): ``<device>.json``, else ``<group name>.json`` when only that
    exists; a profile measured here goes to ``<device>.json``."""
    own = os.path.join(profiles_dir, f"{g.device or g.name}.json")
    by_name = os.path.join(profiles_dir, f"{g.name}.json")
    return by_name if not os.path.exists(own) and os.path.exists(by_name) else own


def _groups_text(groups: List[Any]) -> str:
    """``"group fast"``, or ``"groups fast, slow (one profile; slow EMULATED 3x slower by the predictor)"``."""
    if len(groups) == 1:
        return f"group {groups[0].name}"
    emu = [f"{g.name} EMULATED {g.slowdown:g}x slower" for g in groups if g.slowdown > 1]
    return (f"groups {', '.join(g.name for g in groups)} (one profile"
            + (f"; {', '.join(emu)} by the predictor" if emu else "") + ")")


def _get_profile(path: str, groups: List[Any], model: str, seq_len: int, log,
                 microbatch_sizes: Tuple[int, ...] = (1, 2), tp_degrees: Tuple[int, ...] = (1,),
                 dp_degrees: Tuple[int, ...] = (), dp_sizes: Tuple[int, ...] = (),
                 chunked_sizes: Tuple[int, ...] = ()) -> str:
    """Reuses the profile at ``path``, or measures it (device type cpu, at ``microbatch_sizes`` and
    ``tp_degrees``; ``(d, 1)`` meshes for ``dp_degrees`` at ``dp_sizes`` per DP rank; the chunked last
    microbatch at ``chunked_sizes``), or falls back to
    the catalog. Returns the text saying which."""
    if os.path.exists(path):
        return f"reusing saved profile; costs: {cost_source_text(groups[0].device, profile_path=path, measured=_profile_date(path))}"
    if not all(g.platform == "cpu" and g.device == "cpu" for g in groups):
        eff = groups[0].efficiency
        return f"no profile; costs: {cost_source_text(groups[0].device, efficiency=0.4 if eff is None else eff)}"
    log(f"profiling device type cpu for {_groups_text(groups)} into {path} (python -m hethub_jax.profile "
        f"--microbatch-sizes {','.join(map(str, microbatch_sizes))} --tp {','.join(map(str, tp_degrees))} "
        + (f"--dp 1,{','.join(map(str, dp_degrees))} --dp-microbatch-sizes {','.join(map(str, dp_sizes))} "
           if dp_degrees else "")
        + (f"--chunked-mbs {','.join(map(str, chunked_sizes))} " if chunked_sizes else "")
        + f"{' '.join(PROFILE_SETTINGS)}; emulated slowdowns are applied by the predictor"
        + ("; DP meshes of fake CPU devices share this process's cores: measured, not assumed parallel"
           if dp_degrees else "") + ")...")
    kw = {"dp_degrees": tuple(dp_degrees), "dp_microbatch_sizes": tuple(dp_sizes)} if dp_degrees else {}
    kw.update({"chunked_microbatch_sizes": tuple(chunked_sizes)} if chunked_sizes else {})
    ok, msg = profile_device(model, seq_len, path, microbatch_sizes=tuple(microbatch_sizes),
                             tp_degrees=tuple(tp_degrees), **kw)
    return (f"measured profile now ({msg}); costs: {cost_source_text('cpu', profile_path=path, measured=_profile_date(path))}" if ok
            else f"{msg}; costs: {cost_source_text('cpu')}")


def cluster_costs(cluster: Any, profiles: Mapping[str, Any],
                  bridge_fit: Optional[Mapping[str, float]] = None) -> Dict[str, Any]:
    """Per group name, the ``DeviceCosts``: from the profile dict when given, else the planner's default
    (``search.group_costs``: the catalog entry with the group's links). ``bridge_fit``: the bridge's
    all-reduce line MEASURED on the job's ranks (``{"c0": s, "c1": s/byte}``, :func:`bridge_allreduce_step`),
    given to every group's costs (``DeviceCosts.with_bridge_allreduce``, replacing a profile's own
    ``fits.bridge_allreduce``); None: the profiles' own fits, else the ring formula over the cluster's link."""
    from hethub_jax.planner.costs import DeviceCosts
    from hethub_jax.planner.search import group_costs
    costs = group_costs(cluster)
    for name, prof in profiles.items():
        if prof is not None:
            costs[name] = DeviceCosts.from_profile(prof)
    if bridge_fit is not None:
        costs = {k: c.with_bridge_allreduce(bridge_fit) for k, c in costs.items()}
    return costs


def _search_options(mbs: Optional[int], grad_bucket_mb: Optional[Union[float, str]] = "auto"):
    """The ``SearchOptions`` of plan-less training: the planner's defaults, the run's microbatch size when
    its config fixes one (``train.microbatch_size``), the run's ``train.grad_bucket_mb`` (the gradient
    all-reduce path a heterogeneous-DP plan is ranked by; ``"auto"``: the planner's and training's default),
    the top ``search.DEFAULT_TOP_K`` candidates, as the plan CLI keeps by default (``--top``): the split per
    stage (``planner.runnable.runnable_result``) ranks again only those, so plan-less training and the CLI
    choose the same plan."""
    from hethub_jax.planner.search import DEFAULT_TOP_K, SearchOptions
    return SearchOptions(top_k=DEFAULT_TOP_K, microbatch_sizes=(mbs,) if mbs else None, grad_bucket_mb=grad_bucket_mb)


def _search(cfg: Any, cluster: Any, gbs: int, seq_len: int, mbs: Optional[int], profiles: Mapping[str, Any],
            grad_bucket_mb: Optional[Union[float, str]] = "auto", bridge_fit: Optional[Mapping[str, float]] = None):
    """The planner's best plan as ``python -m hethub_jax.plan`` emits it: the search's top
    ``search.DEFAULT_TOP_K`` (:func:`_search_options`, the CLI's default ``--top``), a multi-node group
    holding several stages split into one island per stage and predicted again, ranked again
    (``planner.runnable.runnable_result``), so that today's runtime runs it; unchanged otherwise. A
    ``SearchResult`` of ``RunnableCandidate`` s (``island_groups``: island -> node group); ``.best`` is the plan.
    ``bridge_fit``: as :func:`cluster_costs`."""
    from hethub_jax.planner.runnable import runnable_result
    from hethub_jax.planner.search import search
    opts = _search_options(mbs, grad_bucket_mb)
    costs = cluster_costs(cluster, profiles, bridge_fit)
    res = search(cfg, cluster, gbs, seq_len, costs=costs, options=opts)
    return runnable_result(res, cfg, cluster, seq_len, costs=costs, options=opts)


def plan_command(model: str, cluster_path: str, gbs: Any, seq_len: Any, mbs: Optional[int] = None,
                 profiles_dir: Optional[str] = None, out: Optional[str] = None,
                 grad_bucket_mb: Optional[Union[float, str]] = "auto") -> str:
    """The ``python -m hethub_jax.plan`` command line (shell-quoted) that plans the problem plan-less
    training planned: same model, cluster, global batch, ``--seq-len`` (always given: the plan CLI's
    default differs from training's ``data.seq_len``), ``--profiles`` (the folder the run's profiles
    came from, when it exists: the CLI refuses a missing folder) and every search option of
    :func:`_search_options` that differs from the CLI's default (``--microbatch-sizes``,
    ``--max-stages-per-group``, ``--memory-headroom``, ``--no-hetero-dp``); ``out``: ``--out`` path.
    ``model``: a preset name or a model file (:func:`_model_arg`)."""
    import shlex

    from hethub_jax.plan import _parser
    opts, cli = _search_options(mbs, grad_bucket_mb), _parser()
    argv = ["--model", model, "--cluster", cluster_path, "--global-batch", str(gbs), "--seq-len", str(seq_len)]
    if profiles_dir and os.path.isdir(profiles_dir):
        argv += ["--profiles", profiles_dir]
    if opts.microbatch_sizes:
        argv += ["--microbatch-sizes", *map(str, opts.microbatch_sizes)]
    if opts.max_stages_per_group != cli.get_default("max_stages_per_group"):
        argv += ["--max-stages-per-group", str(opts.max_stages_per_group)]
    from hethub_jax.planner.search import DEFAULT_MEMORY_HEADROOM
    if opts.memory_headroom != DEFAULT_MEMORY_HEADROOM:  # the CLI's default (its --help)
        argv += ["--memory-headroom", repr(opts.memory_headroom)]
    if not opts.hetero_dp:
        argv += ["--no-hetero-dp"]
    if opts.top_k != cli.get_default("top"):  # one constant today (search.DEFAULT_TOP_K): never printed
        argv += ["--top", str(opts.top_k)]
    if opts.grad_bucket_mb != cli.get_default("grad_bucket_mb"):
        argv += ["--grad-bucket-mb", "none" if opts.grad_bucket_mb is None else repr(float(opts.grad_bucket_mb))]
    if out:
        argv += ["--out", out]
    return shlex.join(["python", "-m", "hethub_jax.plan", *argv])


def _model_arg(cfg: Any, preset: str, out_dir: Optional[str]) -> str:
    """What ``--model`` of a suggested plan command must say to plan ``cfg``: the preset name when ``cfg``
    is that preset unchanged, else a JSON file of every model field written to ``<out_dir>/model.json``
    (a training config's model overrides, e.g. ``--set model.num_hidden_layers=4``)."""
    from hethub_jax.models.config import get_preset
    try:
        if get_preset(preset) == cfg:
            return preset
    except ValueError:
        pass
    if not hasattr(cfg, "to_dict") or not out_dir:
        return preset
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "model.json")
    with open(path, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    return path


def _check_ranks(c: Any, world_size: int, command: str = "python -m hethub_jax.plan ... --out plan.json") -> None:
    """Refuse a split plan whose rank count differs from the job's (the split leaves out processes that
    hold no stage): the job was started with one rank per node, and its ranks cannot be renumbered.
    ``command``: the plan command of the run's problem (:func:`plan_command` with ``--out plan.json``).

    Raises:
      ValueError: naming the plan's and the job's rank counts and the commands that run the plan.
    """
    n = c.plan.world_size
    if world_size <= 1 or n == world_size or getattr(c, "searched", None) is None:
        return
    parts: Dict[str, List[str]] = {}
    for isl, grp in c.island_groups.items():
        parts.setdefault(grp, []).append(isl)
    split = "; ".join(f"group {g} -> islands {', '.join(v)}" for g, v in parts.items() if v != [g])
    raise ValueError(
        f"the planner's best plan runs a multi-node group's stages as one island per stage ({split}) and "
        f"leaves out the processes that hold no stage: it needs {n} MPI ranks, this job has {world_size}. "
        f"Plan it first and train that plan with its rank count: `{command}`, then `mpiexec -n {n} python -m "
        f"hethub_jax.train --plan plan.json ...` (or start this job with {n} ranks)")


def upper_bound_skipped_note(command: str) -> str:
    """Why plan-less training prints no fraction of the cluster's upper bound, and the command that
    computes it (:func:`plan_command`; the per-group homogeneous searches are skipped to keep start-up
    short)."""
    return f"upper bound skipped in plan-less training (it needs one more search per group); `{command}` computes it"


def _plan_lines(res: Any, cluster: Any, costs: Mapping[str, Any], ub_note: Optional[str] = None) -> List[str]:
    """The planner's table of the chosen plan; ``ub_note``: why the upper bound is missing when the
    search result gives no reason."""
    from hethub_jax.plan import format_candidate

    class _Info:
        def __init__(self, g):
            self.device, self.memory_bytes = g.device, costs[g.name].memory_bytes
    groups = {g.name: _Info(g) for g in cluster.resolved().groups}
    return format_candidate(0, res.best, groups, res.upper_bound_tokens_per_s,
                            getattr(res, "upper_bound_note", None) or ub_note,
                            cluster.resolved().num_devices).splitlines()


def _profile_rank0(cfg: Any, model: str, cluster_path: str, gbs: int, mbs: Optional[int], seq_len: int,
                   profiles_dir: str, log) -> Dict[str, Any]:
    """Rank 0's first part: the island profiles (:func:`_profiles`, measured or reused) and the bridge
    all-reduce measurement saved beside them (``costs.read_bridge_allreduce``, None when there is none),
    read here so that every rank learns from rank 0's message whether to measure it
    (:func:`bridge_allreduce_step`). Returns ``{"profiles", "notes", "bridge_saved"}``.

    Raises:
      ValueError: a bad cluster spec, or a saved bridge all-reduce file that does not read."""
    from hethub_jax.planner.cluster import load_cluster
    from hethub_jax.planner.costs import read_bridge_allreduce
    cluster = load_cluster(cluster_path)
    planner_sizes = tuple(planner_microbatch_sizes(gbs, mbs))
    sizes = tuple(microbatch_sizes_to_profile(list(planner_sizes)))
    profiles, notes = _profiles(cluster, model, seq_len, profiles_dir, log, sizes, cfg=cfg, planner_sizes=planner_sizes)
    return {"profiles": profiles, "notes": notes, "bridge_saved": read_bridge_allreduce(profiles_dir)}


#: calls per size of plan-less training's bridge all-reduce measurement (the median; one untimed call first):
#: the standalone profiler's least (``max(--repeats, 5)``); at :data:`profile.BRIDGE_ALLREDUCE_SIZES` well under
#: a second on this machine's bridge
BRIDGE_ALLREDUCE_REPEATS = 5


def _profiles_bridge_fit(profiles: Mapping[str, Any]) -> Optional[str]:
    """When every group has a profile carrying ``fits.bridge_allreduce`` (the standalone profiler under
    ``mpiexec -n 2``), the text of those lines (the predictor takes the slower of two islands'), else None."""
    from hethub_jax.planner.costs import bridge_allreduce_text
    fits = [((p or {}).get("fits") or {}).get("bridge_allreduce") for p in profiles.values()]
    if not fits or any(not f for f in fits):
        return None
    texts = list(dict.fromkeys(bridge_allreduce_text(f) for f in fits))
    return "; ".join(texts)


def bridge_allreduce_step(prof_msg: Mapping[str, Any], profiles_dir: str, *, rank: int = 0, world_size: int = 1,
                          timeout_s: float = 300.0, log=print) -> Dict[str, Any]:
    """Plan-less training between the island profiles and the search, on EVERY rank: where the planner's
    cross-island gradient all-reduce figure comes from, measured here when it can be.

    In this order: the measurement saved beside the profiles (``prof_msg["bridge_saved"]``,
    ``<profiles_dir>/bridge_allreduce.json``, read by rank 0) is reused; else profiles of every group that carry
    ``fits.bridge_allreduce`` are used as they are; else a job of 2 ranks measures it between its own ranks,
    the ranks that will run the all-reduce: both call ``profile.measure_bridge_allreduce`` (the standalone
    profiler's method, at ``profile.BRIDGE_ALLREDUCE_SIZES`` bytes, :data:`BRIDGE_ALLREDUCE_REPEATS` calls each)
    on ``MPI.COMM_WORLD`` and fit ``profile.fit_bridge_allreduce`` (Hockney's alpha-beta); rank 0 then saves it
    (:func:`_plan_rank0`, ``save``). Else (one process: islands in-process, no MPI bridge; or a job of more than
    2 ranks, which the 2-rank measurement does not cover) the cluster spec's link by the ring formula.

    Under MPI every rank enters two agreement points (``cluster.agree_errors``, at most ``timeout_s`` each):
    before measuring (the imports) and after; a failure on any rank ends every rank there with that rank's
    error (``SetUpFailed``). A rank whose measurement failed while its peer still waits in a blocking MPI call
    of the measurement (a barrier: the peer never reaches the agreement point) prints its error and ends the
    job (``MPI.COMM_WORLD.Abort(1)``) after ``timeout_s``. ``prof_msg``: :func:`_profile_rank0`'s message, the
    same on every rank.

    Returns:
      ``{"fit": {"c0", "c1", ...} or None (the profiles' own fits or the ring formula), "line": where the figure
      comes from (``RunPrediction.bridge_allreduce``), "save": the measurement to write or None}``.
    Raises:
      hethub_jax.cluster.SetUpFailed: on every rank, when the measurement failed on any rank.
    """
    from hethub_jax.planner.costs import bridge_allreduce_text
    saved = prof_msg.get("bridge_saved")
    if saved:
        threads = ("; this run's islands are threads of one process, which do not use the MPI bridge: an "
                   "assumption for them" if world_size <= 1 else "")
        return {"fit": dict(saved["fit"]), "save": None,
                "line": (f"MEASURED {bridge_allreduce_text(saved['fit'])}, reused from {saved['path']} (measured "
                         f"{saved.get('date', '?')} on the {saved.get('ranks', '?')} ranks of a plan-less training job "
                         f"on {', '.join(saved.get('hosts') or ['?'])}; delete it to measure again{threads})")}
    in_profiles = _profiles_bridge_fit(prof_msg.get("profiles") or {})
    if in_profiles:
        return {"fit": None, "save": None,
                "line": f"MEASURED {in_profiles} (fits.bridge_allreduce of the saved profiles, python -m "
                        f"hethub_jax.profile under mpiexec -n 2)"}
    if world_size != 2:
        why = ("one process runs every island (no MPI bridge)" if world_size <= 1 else
               f"the measurement runs between the 2 ranks of a 2-rank job; this job has {world_size}")
        return {"fit": None, "save": None,
                "line": f"catalog default (ring formula over the cluster spec's link between the groups; not "
                        f"measured: {why})"}
    from hethub_jax import cluster as cl
    error = None
    try:
        import platform

        from mpi4py import MPI

        from hethub_jax.comm.mpi import MPIHostBridge  # noqa: F401 (the bridge measured: fails here, not midway)
        from hethub_jax.profile import BRIDGE_ALLREDUCE_SIZES, fit_bridge_allreduce, measure_bridge_allreduce
    except Exception as e:  # every rank must reach the agreement point
        error = f"bridge all-reduce measurement on rank {rank}: {type(e).__name__}: {e}"
    cl.agree_errors(error, timeout_s)
    # the agreement after the measurement runs on a communicator of its own: a rank that failed midway must
    # not match its agreement with its peer's pending barrier or all-reduce on COMM_WORLD (seen: the peer
    # then went on with a wrong result)
    agree = MPI.COMM_WORLD.Dup()
    log(f"measuring the bridge all-reduce between this job's 2 ranks (profile.measure_bridge_allreduce at "
        f"{', '.join(map(str, BRIDGE_ALLREDUCE_SIZES))} bytes, median of {BRIDGE_ALLREDUCE_REPEATS} calls each)...")
    t0, fit, samples, hosts = time.perf_counter(), None, None, None
    try:
        hosts = MPI.COMM_WORLD.allgather(platform.node())
        samples = measure_bridge_allreduce(BRIDGE_ALLREDUCE_SIZES, BRIDGE_ALLREDUCE_REPEATS)
        fit = fit_bridge_allreduce(samples or [])
        if fit is None:
            error = f"bridge all-reduce measurement on rank {rank}: no samples (not a 2-rank MPI job?)"
    except Exception as e:  # every rank must reach the agreement point
        error = f"bridge all-reduce measurement on rank {rank}: {type(e).__name__}: {e}"
    try:
        cl.agree_errors(error, timeout_s, comm=agree)
    except TimeoutError:
        if error is None:
            raise  # a peer died or hangs: the caller's uncaught-exception hook aborts the job
        _abort_job(rank, f"{error} (the other rank did not reach the agreement point within {timeout_s:g} s: "
                         f"it waits in the measurement's MPI calls; ending the job)")
    agree.Free()
    date = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    from hethub_jax.planner.costs import BRIDGE_ALLREDUCE_FILE
    path = os.path.join(profiles_dir, BRIDGE_ALLREDUCE_FILE)
    return {"fit": fit,
            "line": (f"MEASURED {bridge_allreduce_text(fit)} on this job's ranks (ranks 0 and 1 on "
                     f"{', '.join(dict.fromkeys(hosts))}: profile.measure_bridge_allreduce, Hockney fit, "
                     f"{time.perf_counter() - t0:.1f} s; saved to {path})"),
            "save": {"fit": fit, "samples": samples, "date": date, "ranks": 2, "hosts": hosts,
                     "note": "MEASURED by plan-less training (python -m hethub_jax.train --cluster) between the "
                             "job's own ranks before planning; the planner gives this line to every group's costs "
                             "(planner.costs.BRIDGE_ALLREDUCE_FILE)"}}


def _abort_job(rank: int, error: str) -> None:
    """Prints ``[rank R] error`` on stderr and ends the whole MPI job (``MPI.COMM_WORLD.Abort(1)``, then this
    process with status 1 should Abort return; after
    ``cluster.ABORT_GRACE_S`` so that the launcher forwards the line), as ``cluster.install_abort_on_exception``
    does: for a rank whose measurement failed while its peer waits in a blocking MPI call that no agreement
    point can reach."""
    from mpi4py import MPI

    from hethub_jax.cluster import ABORT_GRACE_S
    sys.stderr.write(f"[rank {rank}] python -m hethub_jax.train: error: {error}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(ABORT_GRACE_S)
    try:
        MPI.COMM_WORLD.Abort(1)
    finally:  # MPICH's Abort was seen to return to the caller while the launcher ends the job: go no further
        os._exit(1)


def _save_bridge_allreduce(profiles_dir: str, save: Mapping[str, Any]) -> str:
    """Writes a bridge all-reduce measurement as ``<profiles_dir>/bridge_allreduce.json``
    (``costs.BRIDGE_ALLREDUCE_FILE``, format ``costs.BRIDGE_ALLREDUCE_FORMAT``), atomically. Returns the path.

    Raises:
      OSError: the folder cannot be written."""
    from hethub_jax.planner.costs import BRIDGE_ALLREDUCE_FILE, BRIDGE_ALLREDUCE_FORMAT
    os.makedirs(profiles_dir, exist_ok=True)
    path = os.path.join(profiles_dir, BRIDGE_ALLREDUCE_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({**save, "format": BRIDGE_ALLREDUCE_FORMAT}, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def _plan_rank0(cfg: Any, model: str, cluster_path: str, gbs: int, seq_len: int, mbs: Optional[int],
                profiles_dir: str, log, world_size: int = 1, out_dir: Optional[str] = None,
                grad_bucket_mb: Optional[Union[float, str]] = "auto", *, profiled: Optional[Mapping[str, Any]] = None,
                bridge: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Rank 0's work: profiles (``profiled``: :func:`_profile_rank0`'s message when already done; None: done
    here), search, lines. ``bridge``: :func:`bridge_allreduce_step`'s result (its ``fit`` given to every
    group's costs, its ``save`` written beside the profiles first, or the line says why not: an ``OSError``,
    e.g. a read-only ``--profiles`` folder, is not a planning error); None: the saved measurement when there is
    one, else the profiles' own fits. Returns the message sent to every rank. ``out_dir``: where
    a model file for the suggested plan commands goes when ``cfg`` is not the preset ``model`` unchanged
    (default: the parent of ``profiles_dir``)."""
    from hethub_jax.planner.cluster import load_cluster
    cluster = load_cluster(cluster_path)
    if profiled is None:
        profiled = _profile_rank0(cfg, model, cluster_path, gbs, mbs, seq_len, profiles_dir, log)
    profiles, notes = profiled["profiles"], profiled["notes"]
    if bridge is None:
        bridge = bridge_allreduce_step(profiled, profiles_dir, log=log)
    line = bridge.get("line")
    if bridge.get("save"):
        try:
            _save_bridge_allreduce(profiles_dir, bridge["save"])
        except OSError as e:  # e.g. a read-only --profiles folder: plan with it all the same, say so
            line = f"{line.rsplit('; saved to ', 1)[0]}; NOT saved: {e})"
    bridge_fit = bridge.get("fit")
    t0 = time.perf_counter()
    res = _search(cfg, cluster, gbs, seq_len, mbs, profiles, grad_bucket_mb, bridge_fit)
    model_arg = _model_arg(cfg, model, out_dir or os.path.dirname(os.path.abspath(profiles_dir)))
    command = lambda out=None: plan_command(model_arg, cluster_path, gbs, seq_len, mbs, profiles_dir, out,
                                            grad_bucket_mb)
    _check_ranks(res.best, world_size, command("plan.json"))
    lines = [f"planner ({time.perf_counter() - t0:.1f} s, {res.evaluated} plans predicted): chosen plan for "
             f"cluster {cluster.name}, every figure PREDICTED", *_plan_lines(
                 res, cluster, cluster_costs(cluster, profiles, bridge_fit), upper_bound_skipped_note(command()))]
    note = extrapolation_note(res.best.plan, profiles)  # e.g. a saved profile of other sizes, reused
    lines += [note] if note else []
    return {"plan": res.best.plan.to_dict(), "profiles": profiles, "notes": notes, "lines": lines,
            "kind": res.best.kind, "island_groups": dict(res.best.island_groups), "bridge_fit": bridge_fit,
            "bridge_line": line}


def _share(make, rank: int, size: int):
    """Rank 0 computes ``make()`` and sends it to every rank (others poll with a sleep so they do not
    spin a core away from rank 0's profiler); a single process just computes it."""
    if size <= 1:
        return make()
    from mpi4py import MPI
    comm, tag = MPI.COMM_WORLD, 717
    if rank == 0:
        try:
            msg = make()
        except Exception as e:  # every rank must learn of it, else they wait forever
            msg = {"error": f"{type(e).__name__}: {e}"}
        for r in range(1, size):
            comm.send(msg, dest=r, tag=tag)
        return msg
    while not comm.Iprobe(source=0, tag=tag):
        time.sleep(0.05)
    return comm.recv(source=0, tag=tag)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def plan_from_cluster(cfg: Any, model: str, cluster_path: str, *, global_batch: int, seq_len: int,
                      microbatch_size: Optional[int], profiles_dir: Optional[str], out_dir: str,
                      rank: int = 0, world_size: int = 1, log=print,
                      grad_bucket_mb: Optional[Union[float, str]] = None,
                      timeout_s: float = 300.0) -> Tuple[str, RunPrediction, List[str]]:
    """Plan-less training's set-up: the planner's best plan for ``cfg`` on the cluster, written to
    ``<out_dir>/plan.json``, with its prediction and the lines to print.

    Args:
      cfg: the model (``LlamaConfig``); model: the preset the profiler builds (``cfg`` when a preset).
      cluster_path: cluster spec YAML (docs/cluster_spec.md).
      global_batch, seq_len, microbatch_size: from the training config (``None``: the planner chooses).
      profiles_dir: saved profiles to reuse (``<dir>/<device>.json``); missing cpu profiles are measured
        into it. ``None``: ``<out_dir>/profiles``.
      rank, world_size: this process's MPI rank and the job size (rank 0 plans, the others receive).
      grad_bucket_mb: the run's ``train.grad_bucket_mb``: the path a heterogeneous-DP plan's gradient
        all-reduce is ranked by in the search (``SearchOptions.grad_bucket_mb``) and the prediction's path
        (:func:`predict_run`); the banner gives both paths' PREDICTED steps.
      timeout_s: under MPI, the most seconds a rank waits at each agreement point of the bridge all-reduce
        measurement (:func:`bridge_allreduce_step`; the run's ``train.message_timeout_s``).

    Returns:
      ``(plan_path, prediction, lines)``.
    The plan is the planner's best as ``python -m hethub_jax.plan`` emits it: a multi-node group holding
    several stages is split into one island per stage (``planner.runnable``), which today's runtime runs.
    In between, the bridge's all-reduce is measured on the job's ranks or reused (:func:`bridge_allreduce_step`;
    the prediction's ``bridge_allreduce`` says which).

    Raises:
      ValueError: a bad cluster spec or an infeasible request (``PlanningError``), naming it; under MPI a
        split plan whose rank count differs from the job's (:func:`_check_ranks`: it says which
        ``python -m hethub_jax.plan`` and ``mpiexec -n`` commands run the plan).
      hethub_jax.cluster.SetUpFailed: on every rank, the bridge all-reduce measurement failed on some rank.
    """
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.planner.cluster import load_cluster
    from hethub_jax.planner.search import bridge_for
    profiles_dir = profiles_dir or os.path.join(out_dir, "profiles")
    profiled = _share(lambda: _profile_rank0(cfg, model, cluster_path, global_batch, microbatch_size, seq_len,
                                             profiles_dir, log), rank, world_size)
    if "error" in profiled:
        raise ValueError(f"--cluster {cluster_path}: {profiled['error']}")
    bridge = bridge_allreduce_step(profiled, profiles_dir, rank=rank, world_size=world_size, timeout_s=timeout_s,
                                   log=log)  # every rank: the measurement needs them all
    msg = _share(lambda: _plan_rank0(cfg, model, cluster_path, global_batch, seq_len, microbatch_size,
                                     profiles_dir, log, world_size, out_dir, grad_bucket_mb, profiled=profiled,
                                     bridge=bridge), rank, world_size)
    if "error" in msg:
        raise ValueError(f"--cluster {cluster_path}: {msg['error']}")
    plan = Plan.from_dict(msg["plan"])
    path = os.path.join(out_dir, "plan.json")
    text = plan.to_json()
    if rank == 0 or _read(path) != text:  # ranks without a shared file system write their own copy
        os.makedirs(out_dir, exist_ok=True)
        with open(path + f".tmp{rank}", "w") as f:
            f.write(text)
        os.replace(path + f".tmp{rank}", path)
    cluster = load_cluster(cluster_path)
    group = msg.get("island_groups") or {i.name: i.name for i in plan.islands}  # split island -> node group
    if msg["kind"] == "pipeline":  # the planner's bridge: the links between consecutive groups
        seq = [group[st.island] for st in plan.replicas[0].stages]
        pairs = [(a, b) for a, b in zip(seq, seq[1:]) if a != b]
    else:
        names = list(dict.fromkeys(group[i.name] for i in plan.islands))
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    src = "; ".join(msg["notes"]) or "catalog"
    costs = cluster_costs(cluster, msg["profiles"], msg.get("bridge_fit"))
    pred = predict_run(cfg, plan, seq_len, costs={i.name: costs[group[i.name]] for i in plan.islands},
                       bridge=bridge_for(cluster, pairs), source=src, grad_bucket_mb=grad_bucket_mb)
    pred.bridge_allreduce = msg.get("bridge_line")
    return path, pred, [*msg["notes"], *msg["lines"], f"plan written to {path}"]
