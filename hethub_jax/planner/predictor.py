"""Performance predictor: step time, tokens/s, bubble and memory of a plan (pure Python, no JAX).

How a prediction is made (DESIGN.md section 7; details and formulas in ``docs/predictor.md``):
  1. per stage and action, seconds from the island's :class:`~hethub_jax.planner.costs.DeviceCosts`
     (a profile or the catalog): the stage's fixed call cost + its layers + embedding (first stage) +
     LM head and loss (last stage), in the phase the runtime runs (``hethub_jax.parallel.runtime``:
     recompute ``none`` runs F = ``forward_saving``, B = ``backward_saved``; ``full`` runs F =
     ``forward``, B = ``backward_recompute``; on the last stage a forward directly followed by the
     backward of the same microbatch runs fused as one forward + backward, the B action then costs
     the runtime's measured Python of that record), plus the profile's measured cold-call extra on
     every call that follows a different call (:func:`_cold_calls`), stretched by the island's
     emulated slowdown f (the runtime waits (f - 1) x each compute action's own time, a wait that
     takes what the profile measured it to take, ``DeviceCosts.emulated_action_s``; DESIGN.md
     section 9); SEND and RECV take the runtime's measured record seconds (+ the host copies across
     islands), and every action the runtime's measured seconds between records;
  2. the step's timeline from :func:`hethub_jax.planner.simulator.simulate` over ``plan.actions(r)``
     of every replica (the very lists the runtime executes); messages between islands take the
     sender's device-to-host copy, the bridge (``LinkModel``) and the receiver's host-to-device copy;
     when one process runs several stages (one island with several stages or replicas), the process
     executes them one action at a time in the runtime's order
     (:func:`hethub_jax.planner.simulator.simulate_processes`); islands sharing one host's cores
     (``DeviceCosts.on_shared_host``) slow their overlapping compute by the profile's measured co-run
     slowdown by the pair's size ratio (``DeviceCosts.corun_extra``; the one measured factor for islands
     as threads and older profiles, ``costs.CORUN_BY_SIZE_DEFAULT``; a fixed point over the simulated
     timeline, :func:`_corun_factors`); islands that are
     threads of one process (``DeviceCosts.in_process``) whose profile measured XLA:CPU's one-at-a-time
     launcher of multi-device computations (``fits.launch``) run the F and B of their DP / TP stages
     one at a time, first come first served (:func:`_launch_locks`), and their norms and updates after
     the pipelines one after the other (:func:`_serial_tail`);
  3. after the pipelines: the sum of gradients of parameters held by several stages (tied
     embeddings, data-parallel replicas), the global norm, and every stage's optimizer update (the
     stages of one island one after the other);
  4. memory per device of every stage (:func:`stage_memory_bytes`).
"""
from __future__ import annotations

from collections.abc import Sequence as _Seq
import functools
from functools import reduce
import operator
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from hethub_jax.parallel.schedule import Action, ActionKind, ScheduleDeadlock, max_in_flight
from hethub_jax.parallel.trace import ActionRecord
from hethub_jax.planner import analytic
from hethub_jax.planner.costs import DeviceCosts, LinkModel
from hethub_jax.planner.simulator import ScheduleArrays, _checked, run_processes, run_stages, schedule_arrays

__all__ = ["MemoryBreakdown", "StagePrediction", "Prediction", "stage_compute_s", "stage_memory_bytes",
           "predict", "DEFAULT_BRIDGE", "predicted_records", "compare_step", "PREDICTED_LABEL", "costs_for_plan",
           "tail_parts"]

#: bridge between islands when none is given: 20 us + bytes / 1 GB/s (an assumption for MPI over
#: TCP between hosts; measure it with ``python -m hethub_jax.profile`` under ``mpiexec -n 2``)
DEFAULT_BRIDGE = LinkModel(20e-6, 1e9)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak memory of one device of a stage, bytes.

    Attributes:
      params: parameters (param dtype), TP-sharded as stage.py shards them.
      grads: the gradient accumulator (param dtype, same layout).
      optimizer: AdamW state: two moments in the param dtype (optax.adamw's default ``mu_dtype``).
      activations: residuals / stage inputs of the microbatches in flight (schedule, recompute); a
        stage whose forwards are all fused with their backwards: one microbatch's residuals.
      logits: the last stage's float32 ``[microbatch / dp, seq, vocab / tp]`` logits and their
        gradient (one microbatch at a time); 0 elsewhere.
      total: the sum.
    """

    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    total: float

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class StagePrediction:
    """Prediction for one stage of one replica.

    Attributes:
      replica, stage: indices in the plan; island: its island name.
      source: ``"profile"`` or ``"catalog"``: where the island's costs came from.
      compute_s_per_microbatch: seconds of F + B of one microbatch (slowdown included); for a stage
        whose every forward is fused with its backward (a 1F1B last stage), the fused call's seconds.
      busy_s: seconds of the step spent in F and B.
      bubble_fraction: ``1 - busy_s / step pipeline time``.
      memory: peak memory per device; fits: ``memory.total <= device memory``.
    """

    replica: int
    stage: int
    island: str
    source: str
    compute_s_per_microbatch: float
    busy_s: float
    bubble_fraction: float
    memory: MemoryBreakdown
    fits: bool

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["memory"] = self.memory.to_dict()
        return d


class LazyRecords(_Seq):
    """A read-only sequence of :class:`ActionRecord` s built on first use (``Prediction.timeline``: a
    search predicts thousands of plans and reads few timelines). Behaves as the tuple of its records:
    ``len``, indexing, iteration, ``==`` with a tuple or another LazyRecords, ``hash``; pickles and
    copies as that tuple."""

    __slots__ = ("_build", "_items")

    def __init__(self, build):
        self._build, self._items = build, None

    def _get(self) -> Tuple[ActionRecord, ...]:
        if self._items is None:
            self._items, self._build = tuple(self._build()), None
        return self._items

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, i):
        return self._get()[i]

    def __iter__(self):
        return iter(self._get())

    def __eq__(self, other) -> bool:
        if isinstance(other, LazyRecords):
            other = other._get()
        return self._get() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._get())

    def __repr__(self) -> str:
        return repr(self._get())

    def __reduce__(self):
        return (tuple, (self._get(),))


@dataclass(frozen=True)
class Prediction:
    """Predicted step of a plan (every figure PREDICTED, not measured).

    Attributes:
      step_time_s: seconds per optimizer step.
      tokens_per_s: ``global_batch_size x seq_len / step_time_s``.
      stages: one :class:`StagePrediction` per (replica, stage).
      pipeline_s: seconds until the last pipeline action of the step ends.
      allreduce_s: seconds of the gradient sums across stages/replicas and the global norm (under the
        sharded update, ``plan.sharded_update()``: the reduce to the owners and the parameter gather).
      update_s: seconds of the optimizer updates (the slowest island's; under the sharded update each
        stage updates the fraction of its parameters its replica owns).
      critical_path: a readable summary of what bounds the step.
      timeline: the predicted actions as ActionRecords, in the order they ran (``island`` names the
        island, labelled predicted by :func:`predicted_records`); a :class:`LazyRecords`, built on
        first use.
      fits: every stage fits its device memory.
      grad_allreduce: the path of ``step_time_s`` (and of the pipeline, tail and timeline figures) for the
        cross-replica gradient all-reduce of heterogeneous DP: ``"bucketed"`` (``predict``'s
        ``grad_bucket_mb`` set and the plan buckets: :mod:`hethub_jax.planner.predict_buckets`) or
        ``"unbucketed"`` (after the whole backward; also every plan that cannot bucket).
      step_time_unbucketed_s, step_time_bucketed_s: seconds per step on each path; the bucketed one is
        None when the plan cannot bucket (``predict_buckets.bucketing_off_reason``), the unbucketed one
        is always set. ``step_time_s`` is one of them.
      buckets: the bucketed path's terms (None when the plan cannot bucket): ``chunked_replicas``,
        ``ratio`` (chunked / fused last microbatch per chunked replica, MEASURED by the profile or 1.0),
        ``ratio_source``, ``on_core_s`` (the gradient sums on a chunked CPU island's core, added to its
        last action), ``hidden_s`` (bucket work overlapped with the backward), ``exposed_s`` (its part
        after the pipeline), ``bucket_mb``, ``fractions`` (bytes per bucket), ``pipeline_s``,
        ``allreduce_s``, ``faster``: ``"bucketed"`` or ``"unbucketed"`` (the PREDICTED faster path), ``auto_keeps``: the path
        ``train.grad_bucket_mb: auto``'s rule keeps on these PREDICTED steps (``plan.keeps_bucketed_allreduce``).
    """

    step_time_s: float
    tokens_per_s: float
    stages: Tuple[StagePrediction, ...]
    pipeline_s: float
    allreduce_s: float
    update_s: float
    critical_path: str
    timeline: Sequence[ActionRecord]
    fits: bool
    grad_allreduce: str = "unbucketed"
    step_time_unbucketed_s: Optional[float] = None
    step_time_bucketed_s: Optional[float] = None
    buckets: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict (the timeline as a list of record dicts)."""
        return {"predicted": True, "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "pipeline_s": self.pipeline_s, "allreduce_s": self.allreduce_s, "update_s": self.update_s,
                "critical_path": self.critical_path, "fits": self.fits,
                "grad_allreduce": self.grad_allreduce, "step_time_unbucketed_s": self.step_time_unbucketed_s,
                "step_time_bucketed_s": self.step_time_bucketed_s, "buckets": self.buckets,
                "stages": [s.to_dict() for s in self.stages],
                "timeline": [asdict(r) for r in self.timeline]}


# ---- per-stage figures ------------------------------------------------------------------------------

def stage_compute_s(cfg: Any, costs: DeviceCosts, first_layer: int, last_layer: int, is_first: bool,
                    is_last: bool, tokens: float, seq_len: int, tp: int, phase: str, dp: int = 1) -> float:
    """Seconds of one stage action (phase ``"F"``, ``"F_nosave"``, ``"B"`` or ``"B_recompute"``, see
    ``costs.PHASES``) for one microbatch of ``tokens`` tokens per DP rank on a ``(dp, tp)`` mesh: the
    stage's fixed call cost + layers + embedding (first stage) + LM head and loss (last stage); a stage
    whose shape the profile measured whole (``--stage-shapes``) takes those measured seconds instead
    (:func:`_measured_stage_s`). No slowdown applied. ``"B_recompute"`` is floored, part by part, at ``B + max(F_nosave, F - F_nosave)``:
    recomputing costs at least the plain forward it reruns, and recompute ``full`` is never PREDICTED
    faster than ``none`` (separately fitted profile lines can say otherwise by their noise).

    Raises:
      ValueError: for an empty layer range or an unknown phase.
    """
    if last_layer < first_layer:
        raise ValueError(f"empty stage: first_layer {first_layer} > last_layer {last_layer}")
    measured = _measured_stage_s(costs, last_layer - first_layer + 1, is_first, is_last, tokens, tp, phase, dp)
    if measured is not None:
        return measured

    def parts(ph: str) -> Tuple[float, float, float, float]:  # call, one layer, embedding, head
        return (costs.stage_overhead_s(tp, ph, dp, tokens), costs.layer_time_s(cfg, tokens, seq_len, tp, ph, dp),
                costs.embed_time_s(cfg, tokens, tp, ph, dp) if is_first else 0.0,
                costs.head_time_s(cfg, tokens, seq_len, tp, ph, dp) if is_last else 0.0)
    o, lay, emb, head = parts(phase)
    if phase == "B_recompute":
        # A backward that recomputes runs a plain forward and the saved backward: it costs at least
        # F_nosave + B, and a microbatch under recompute full (F_nosave + B_recompute) at least one under
        # none (F + B). Separately fitted lines can break both by their noise (a profile's embedding had
        # F_nosave + B_recompute 17% below F + B, and the planner chose full over none on a 0.05%
        # PREDICTED difference): floor each part (per layer, so that stage times stay linear in layers).
        # The catalog's figures already satisfy both (FLOPs 1 + 2 = 3 forwards, TP all-reduces 2 + 2).
        fn, f, b = parts("F_nosave"), parts("F"), parts("B")
        o, lay, emb, head = (max(x, b_ + max(fn_, f_ - fn_)) for x, fn_, f_, b_ in zip((o, lay, emb, head), fn, f, b))
    t = o
    t += (last_layer - first_layer + 1) * lay
    if is_first:
        t += emb
    if is_last:
        t += head
    return t


def _measured_stage_s(costs: DeviceCosts, layers: int, is_first: bool, is_last: bool, tokens: float, tp: int,
                      phase: str, dp: int) -> Optional[float]:
    """The profile's MEASURED seconds of a whole stage of this shape (``DeviceCosts.measured_stage_s``,
    ``python -m hethub_jax.profile --stage-shapes``), else None: the fitted lines add one layer's
    seconds per layer, measured on stages of one and two layers, and a call's seconds per layer rise
    with its layers on a CPU core (docs/benchmarks.md, issue 17)."""
    fn = getattr(costs, "measured_stage_s", None)
    return None if fn is None else fn(layers, is_first, is_last, tokens, tp, phase, dp)


def stage_memory_bytes(cfg: Any, first_layer: int, last_layer: int, is_first: bool, is_last: bool, *,
                       microbatch_size: int, seq_len: int, dp: int, tp: int, in_flight: int, recompute: str,
                       param_dtype_bytes: Optional[int] = None,
                       compute_dtype_bytes: Optional[int] = None) -> MemoryBreakdown:
    """Peak memory per device of a stage (bytes), see :class:`MemoryBreakdown`.

    ``in_flight``: microbatches whose forward ran and backward has not (``schedule.in_flight_bound``);
    0 for a stage whose every forward is fused with its backward (a last stage under 1F1B, e.g. a
    one-stage heterogeneous-DP replica: the runtime's ``PipelineStage.forward_backward``).
    Activations, with ``R`` one microbatch's residuals (``analytic.layer_activation_bytes`` per layer,
    on the last stage plus ``analytic.head_activation_bytes``): recompute ``none``: ``in_flight x R``;
    ``full``: ``in_flight`` stage inputs plus ``R`` while a backward recomputes its forward. Fused
    (``in_flight=0``): ``R`` under either policy: the fused call is one ``jax.vjp`` of the stage inside
    one jit (``PipelineStage._forward_backward``, which ignores the recompute policy), so one
    microbatch's residuals live while it runs and none outlive it. dtype sizes default to the config's
    ``param_dtype`` and ``dtype``.

    Raises:
      ValueError: for non-positive sizes, ``microbatch_size`` not divisible by ``dp``, or an unknown
        recompute policy.
    """
    if min(microbatch_size, seq_len, dp, tp) < 1 or in_flight < 0:
        raise ValueError(f"sizes must be >= 1 (microbatch_size={microbatch_size}, seq_len={seq_len}, dp={dp}, "
                         f"tp={tp}) and in_flight >= 0 (got {in_flight})")
    if microbatch_size % dp:
        raise ValueError(f"microbatch_size must be divisible by dp: {microbatch_size} % {dp}")
    pb = param_dtype_bytes or analytic.dtype_bytes(cfg.param_dtype)
    ab = compute_dtype_bytes or analytic.dtype_bytes(cfg.dtype)
    n = analytic.stage_params_per_device(cfg, first_layer, last_layer, is_first, is_last, tp)
    tokens = microbatch_size // dp * seq_len
    layers = last_layer - first_layer + 1
    resid = layers * analytic.layer_activation_bytes(cfg, tokens, seq_len, tp, "none", ab)
    if is_last:
        resid += analytic.head_activation_bytes(cfg, tokens, tp, ab)
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute must be 'none' or 'full', got {recompute!r}")
    if in_flight == 0:  # fused forward + backward: one microbatch's residuals during the call, any policy
        act = resid
    elif recompute == "none":
        act = in_flight * resid
    else:
        act = in_flight * analytic.stage_input_bytes(cfg, tokens, is_first, ab) + resid
    logits = analytic.logits_bytes(cfg, tokens, tp) if is_last else 0.0
    params = n * pb
    return MemoryBreakdown(params, params, 2 * params, act, logits, params * 4 + act + logits)


# ---- the step ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _StageCtx:
    key: Tuple[int, int]
    spec: Any
    island: Any
    costs: DeviceCosts
    factor: float          # emulated slowdown relative to the costs' own
    tokens: float          # per DP rank
    t_f: float             # F action (slowdown included)
    t_b: float             # B action
    t_fused: float         # fused F+B of the last stage
    n_params: float        # per device
    is_last: bool = False  # spec.is_last, read once (a pydantic property; _fused asks per action)
    # measured cold-call extra seconds (DeviceCosts.cold_extra_s, slowdown included) of the F, B and
    # fused F+B calls, and whether a call directly after the same kind of call of the stage runs warm
    # (the stage alone on its island, the island alone on its host: nothing else ran between them)
    cold_f: float = 0.0
    cold_b: float = 0.0
    cold_fused: float = 0.0
    warm_repeats: bool = False
    t_fused_b: float = 0.0  # the B record after a fused F+B: the runtime's Python only (measured), emulated
    phase_f: str = "F"      # the phases of the stage's F and B calls (recompute none: F / B; full: F_nosave /
    phase_b: str = "B"      # B_recompute), for the measured in-flight factors (DeviceCosts.in_flight_factor)


def _stage_ctx(cfg: Any, plan: Any, r: int, s: int, costs: Mapping[str, DeviceCosts], seq_len: int,
               warm_repeats: bool = False) -> _StageCtx:
    """The stage's per-action seconds; ``warm_repeats``: see :func:`_cold_calls`."""
    spec = plan.replicas[r].stages[s]
    if spec.island not in costs:
        raise ValueError(f"no costs for island {spec.island!r}; costs given for {sorted(costs)}")
    c, isl = costs[spec.island], plan.island(spec.island)
    slow = float(isl.slowdown)
    factor = slow / c.emulated_slowdown
    tokens = plan.microbatch_size // spec.dp * seq_len
    args = (cfg, c, spec.first_layer, spec.last_layer, spec.is_first, spec.is_last, tokens, seq_len, spec.tp)
    f_phase, b_phase = ("F", "B") if plan.recompute == "none" else ("F_nosave", "B_recompute")
    n = analytic.stage_params_per_device(cfg, spec.first_layer, spec.last_layer, spec.is_first, spec.is_last, spec.tp)
    dp = spec.dp
    # an action on an EMULATED slow island: its own time, then the runtime's wait of (slowdown - 1) x that
    # time as measured (DeviceCosts.emulated_action_s; the wait of a cold call covers its extra too)
    em = lambda busy: c.emulated_action_s(busy, slow)  # noqa: E731
    t_f, t_b, t_fb = (stage_compute_s(*args, ph, dp) for ph in (f_phase, b_phase, "B_recompute"))
    cold = lambda ph, t: em(t + c.cold_extra_s(spec.is_first, spec.is_last, ph)) - em(t)  # noqa: E731
    # the B record after a fused F+B runs the runtime's Python only, and the emulated wait after it
    fused_b = em(c.message_action_s("fused_b")) if c.action_costs else 0.0
    return _StageCtx((r, s), spec, isl, c, factor, tokens, em(t_f), em(t_b), em(t_fb),
                     n, bool(spec.is_last), cold(f_phase, t_f), cold(b_phase, t_b), cold("B_recompute", t_fb),
                     bool(warm_repeats), fused_b, f_phase, b_phase)


@functools.lru_cache(maxsize=4096)
def _cold_calls(arr: ScheduleArrays, s: int, is_last: bool, warm_repeats: bool) -> Tuple[Tuple[int, int], ...]:
    """``(local index, kind)`` of stage ``s``'s calls that run COLD: after a different call (kind 0 F,
    1 B, 2 a last stage's fused F+B; the B of a fused pair is no call). With ``warm_repeats`` (nothing
    but the stage runs on its cores) a call directly after a call of the same kind of the stage runs
    warm and every other one cold; without it (other stages of the island, or other islands of the
    host, run between a stage's calls) every call runs cold. A step's first call is cold (the
    update, or another stage, ran before it)."""
    codes, fused = arr.stage_codes[s], set(arr.fused_f[s]) if is_last else set()
    out, prev = [], -1
    for i in arr.compute[s]:
        if i - 1 in fused and codes[i] == 1:
            continue  # computed by the fused call before it
        kind = 2 if i in fused else codes[i]
        if not warm_repeats or kind != prev:
            out.append((i, kind))
        prev = kind
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _in_flight_calls(arr: ScheduleArrays, s: int, is_last: bool) -> Tuple[Tuple[int, int, int], ...]:
    """``(local index, kind, count)`` of stage ``s``'s F (kind 0) and B (kind 1) calls that the runtime
    does NOT fuse (a last stage's F directly followed by the B of its microbatch, and that B, are left
    out): ``count`` = microbatches in flight while the call runs (forwards run whose backward has not,
    its own included), from the schedule's own action list (``arr.lists[s]``, as the runtime runs it)."""
    fused = set(arr.fused_f[s]) if is_last else set()
    live, out = set(), []
    for i, a in enumerate(arr.lists[s]):
        if a.kind == ActionKind.F:
            live.add(a.microbatch)
            n = len(live)
        elif a.kind == ActionKind.B:
            n = len(live)
            live.discard(a.microbatch)
        else:
            continue
        if i not in fused and i - 1 not in fused:
            out.append((i, 0 if a.kind == ActionKind.F else 1, n))
    return tuple(out)


def _fused(ctx: _StageCtx, acts: Sequence[Action], i: int) -> bool:
    """The runtime fuses a last stage's F with the directly following B of the same microbatch."""
    a = acts[i]
    return (ctx.is_last and a.kind == ActionKind.F and i + 1 < len(acts)
            and acts[i + 1].kind == ActionKind.B and acts[i + 1].microbatch == a.microbatch)


def _stage_times(ctx: _StageCtx, arr: ScheduleArrays, s: int, host_s: float, bridge_s: float, cross_prev: bool,
                 cross_next: bool, fused_update_s: float) -> Tuple[List[float], List[float]]:
    """``(busy, delivery)`` seconds per action of stage ``s`` of ``arr`` (local index): busy: F/B
    compute (a last stage's F directly followed by its B runs fused: the F costs ``t_fused`` (+ the fused
    optimizer update before the stage's last B), the B ``t_fused_b``: the runtime's measured Python of
    that record, 0 when not measured); SEND: the runtime's measured SEND record
    (``DeviceCosts.message_action_s``) + the sender's copy to the host when the peer is on another
    island; RECV: the measured RECV record + the copy onto the stage's devices. An unfused F or B is
    multiplied by the MEASURED factor of its stage position, phase and the microbatches in flight
    while it runs (``DeviceCosts.in_flight_factor``, :func:`_in_flight_calls`; the profile measured it
    on calls that follow other calls, so such a call takes no cold-call extra besides); a call of a
    profile without that measurement takes the cold-call extra (:func:`_cold_calls`). delivery (SENDs):
    the bridge when the peer is on another island, else 0.

    Raises:
      ValueError: if a time is negative or not finite.
    """
    snd, rcv = ctx.costs.message_action_s("send"), ctx.costs.message_action_s("recv")
    tab = [ctx.t_f, ctx.t_b, snd + (host_s if cross_next else 0.0), snd + (host_s if cross_prev else 0.0),
           rcv + host_s, rcv + host_s]
    dtab = [0.0, 0.0, bridge_s if cross_next else 0.0, bridge_s if cross_prev else 0.0, 0.0, 0.0]
    fused = arr.fused_f[s] if ctx.is_last else []
    last = arr.last_fused_f[s] if ctx.is_last else -1
    extra = [ctx.t_fused] if fused else []
    if last >= 0:
        extra.append(ctx.t_fused + fused_update_s)
    for name, x in [("action time", x) for x in tab + extra] + [("delivery time", x) for x in dtab]:
        _checked(x, name, s, f"{ctx.spec.island} stage action")
    codes = arr.stage_codes[s]
    t = list(map(tab.__getitem__, codes))
    for i in fused:
        t[i], t[i + 1] = ctx.t_fused + 0.0, ctx.t_fused_b
    if last >= 0:
        t[last] = ctx.t_fused + fused_update_s
    scaled = set()
    if getattr(ctx.costs, "in_flight", None):  # the measured cost of holding microbatches in flight (unfused F and B calls)
        spec, c = ctx.spec, ctx.costs
        measured = [bool(c.in_flight_points(spec.is_first, spec.is_last, ph)) for ph in (ctx.phase_f, ctx.phase_b)]
        for i, kind, n in (_in_flight_calls(arr, s, ctx.is_last) if any(measured) else ()):
            if measured[kind]:
                t[i] *= c.in_flight_factor(spec.is_first, spec.is_last, ctx.phase_b if kind else ctx.phase_f, n)
                scaled.add(i)
    if ctx.cold_f > 0 or ctx.cold_b > 0 or ctx.cold_fused > 0:  # the measured cost of a call after another
        extra = (ctx.cold_f, ctx.cold_b, ctx.cold_fused)
        for i, kind in _cold_calls(arr, s, ctx.is_last, ctx.warm_repeats):
            if i not in scaled:  # the in-flight factor was measured on calls that follow other calls
                t[i] += extra[kind]
    return t, list(map(dtab.__getitem__, codes))


class _Pipeline:
    """The step's pipelines over flat lists: flat index ``lo[n] + i`` is action ``i`` of key ``keys[n]``
    (keys replica by replica, stage by stage); ``start``/``end`` seconds, ``order`` the flat indices in
    the order they ran, ``prev`` per action the one its process ran before it (-1: none), ``code`` /
    ``recv_msg`` / ``sender`` as in :class:`ScheduleArrays` (message ids over all replicas), ``busy``
    per key seconds of F and B, ``pipeline_s`` the end of the last action."""

    def __init__(self, keys, arrays):
        self.keys, self.arrays = keys, arrays
        self.lo, self.key_of, self.code, self.recv_msg, self.sender = [], [], [], [], []
        self.rbase, self.mbase = {}, {}
        n = m = 0
        for r in sorted({k[0] for k in keys}):
            arr = arrays[r]
            self.rbase[r], self.mbase[r] = n, m
            self.code += arr.code
            self.recv_msg += arr.recv_msg if m == 0 else [x + m if x >= 0 else -1 for x in arr.recv_msg]
            self.sender += arr.sender if n == 0 else [x + n if x >= 0 else -1 for x in arr.sender]
            n, m = n + len(arr.code), m + arr.num_messages
        for j, (r, s) in enumerate(keys):
            o = arrays[r].offsets
            self.lo.append(self.rbase[r] + o[s])
            self.key_of += [j] * (o[s + 1] - o[s])
        self.num_messages = m

    def finish(self, st, en, order, prev, wait=None) -> None:
        """``wait``: per flat action the seconds it waited for the launch lock (:func:`_launch_locks`)
        at its start (None: no waits); its compute starts at ``start + wait``."""
        self.start, self.end, self.order, self.prev = st, en, order, prev
        self.wait = wait
        run = st if wait is None else list(map(operator.add, st, wait))  # the compute's own start
        self.busy = []  # summed action by action, in list order, from 0.0
        for (r, s), lo in zip(self.keys, self.lo):
            get, hi = self.arrays[r].compute_get[s], lo + self.arrays[r].offsets[s + 1] - self.arrays[r].offsets[s]
            self.busy.append(reduce(operator.add, map(operator.sub, get(en[lo:hi]), get(run[lo:hi])), 0.0))
        self.pipeline_s = max(en, default=0.0)

    def events(self) -> List[Tuple[Tuple[int, int], Action, float, float]]:
        """``(key, action, start_s, end_s)`` per action in the order they ran (the Action objects of
        ``arrays[r].lists``), as ``simulate_processes`` returns them; an action that waited for the
        launch lock starts when it got it."""
        keys, key_of, st, en, rb = self.keys, self.key_of, self.start, self.end, self.rbase
        if self.wait is not None:
            st = list(map(operator.add, st, self.wait))
        lists = {r: [a for acts in self.arrays[r].lists for a in acts] for r in rb}
        return [(keys[key_of[g]], lists[keys[key_of[g]][0]][g - rb[keys[key_of[g]][0]]], st[g], en[g])
                for g in self.order]

    def records(self, ctxs) -> Tuple[ActionRecord, ...]:
        """The timeline: one ActionRecord per action, in the order they ran (a compute action's record
        includes its wait for the launch lock, as the runtime's record does)."""
        keys, key_of, st, en = self.keys, self.key_of, self.start, self.end
        labels = {r: self.arrays[r].labels for r in self.rbase}
        isl = [ctxs[k].spec.island for k in keys]
        return tuple(ActionRecord(keys[key_of[g]][1], labels[keys[key_of[g]][0]][g - self.rbase[keys[key_of[g]][0]]],
                                  st[g], en[g], isl[key_of[g]], keys[key_of[g]][0]) for g in self.order)


def _pipeline(cfg: Any, plan: Any, ctxs: Dict[Tuple[int, int], _StageCtx], bridge: LinkModel, seq_len: int,
              fused_update_s: float, proc_of, arrays, corun: Optional[Mapping[Any, float]] = None,
              last_action: Optional[Mapping[Tuple[int, int], Tuple[float, float]]] = None) -> _Pipeline:
    """Times the step's pipelines (``arrays``: per replica its :class:`ScheduleArrays`): with one stage per
    process :func:`_run_replica` per replica, else the process-level simulator
    (:func:`~hethub_jax.planner.simulator.run_processes`, as ``simulate_processes``). ``corun``: optional
    factor per ``(key, id(action))`` (actions of ``arrays[r].lists``, as in :meth:`_Pipeline.events`)
    multiplying that action's seconds; the runtime's measured seconds between actions
    (``DeviceCosts.between_actions_s``) are added to every action. ``last_action``: optional
    ``(factor, extra seconds)`` per stage key for its last compute action (a last stage's last fused
    F+B): the bucketed path's chunked last microbatch (:mod:`hethub_jax.planner.predict_buckets`)."""
    msg_bytes = plan.microbatch_size * seq_len * cfg.hidden_size * analytic.dtype_bytes(cfg.dtype)
    bridge_s = bridge.time_s(msg_bytes)
    keys = list(ctxs)
    pl = _Pipeline(keys, arrays)
    times, dts = [], []
    for r, s in keys:
        ctx, S = ctxs[(r, s)], len(arrays[r].lists)
        isl = ctx.spec.island
        t, dt = _stage_times(ctx, arrays[r], s, ctx.costs.host_copy_s(msg_bytes), bridge_s,
                             s > 0 and ctxs[(r, s - 1)].spec.island != isl,
                             s < S - 1 and ctxs[(r, s + 1)].spec.island != isl, fused_update_s)
        if last_action and (r, s) in last_action:
            i = _last_compute(ctx, arrays[r], s)
            m, add = last_action[(r, s)]
            t[i] = t[i] * m + add
        if corun:
            t = [x * corun.get(((r, s), id(a)), 1.0) for x, a in zip(t, arrays[r].lists[s])]
        over = ctx.costs.between_actions_s()
        if over:  # the runtime's own seconds per action, between the actions' records
            t = [x + over for x in t]
        times.append(t)
        dts.append(dt)
    procs: Dict[Any, List[int]] = {}
    for j, k in enumerate(keys):
        procs.setdefault(proc_of(k), []).append(j)
    locks = _launch_locks(ctxs, proc_of)
    wait = None
    if locks:  # islands of one process launch their multi-device computations one at a time
        lock, hold = [-1] * len(pl.code), [0.0] * len(pl.code)
        for j, k in enumerate(keys):
            if k not in locks:
                continue
            arr, s, lo = arrays[k[0]], k[1], pl.lo[j]
            fused_b = {i + 1 for i in arr.fused_f[s]} if ctxs[k].is_last else set()
            over, f = ctxs[k].costs.between_actions_s(), max(ctxs[k].factor, 1.0)
            for i in arr.compute[s]:
                if i not in fused_b:  # a fused pair's B record computes nothing (Python only)
                    # held while it computes: not the runtime's seconds around it, nor an emulated wait
                    lock[lo + i], hold[lo + i] = locks[k], max(0.0, times[j][i] - over) / f
        hi = pl.lo[1:] + [len(pl.code)]
        wait = [0.0] * len(pl.code)
        st, en, order, prev, blocked, _ = run_processes(list(procs.values()), pl.lo, hi, pl.recv_msg, _send_ids(pl),
                                                        _concat(times), _concat(dts), pl.num_messages,
                                                        lock, hold, wait)
        if blocked:
            raise ScheduleDeadlock(f"schedule deadlock in the plan's pipelines (processes {blocked} wait forever)")
    elif len(procs) == len(keys):  # one stage per process: the plain schedule simulator
        st, en, order, prev = [], [], [], []
        for r in sorted(pl.rbase):
            js = [j for j, k in enumerate(keys) if k[0] == r]
            a, b, o = _run_replica(arrays[r], [times[j] for j in js], [dts[j] for j in js])
            st += a
            en += b
            order += [g + pl.rbase[r] for g in o]
        prev = [g - 1 for g in range(len(st))]
        for lo in pl.lo:
            prev[lo] = -1
    else:
        hi = pl.lo[1:] + [len(pl.code)]
        st, en, order, prev, blocked, _ = run_processes(list(procs.values()), pl.lo, hi, pl.recv_msg, _send_ids(pl),
                                                        _concat(times), _concat(dts), pl.num_messages)
        if blocked:
            raise ScheduleDeadlock(f"schedule deadlock in the plan's pipelines (processes {blocked} wait forever)")
    pl.finish(st, en, order, prev, wait)
    return pl


def _last_compute(ctx: _StageCtx, arr: ScheduleArrays, s: int) -> int:
    """Local index of stage ``s``'s last compute call: a last stage's last fused F (+B), else its last
    F or B action."""
    if ctx.is_last and arr.last_fused_f[s] >= 0:
        return arr.last_fused_f[s]
    return arr.compute[s][-1]


def _serial_tail(cfg: Any, plan: Any, ctxs, locks: Mapping[Tuple[int, int], int],
                 upd: Mapping[Tuple[int, int], float]) -> Tuple[float, float]:
    """(extra seconds of the global norm, seconds of the updates) after the pipelines when the
    stages in ``locks`` (:func:`_launch_locks`) launch their multi-device computations one at a time:
    per lock, the stages' ``sq_norm`` calls (``DeviceCosts.norm_time_s``) and their updates (``upd``,
    per stage) run one after the other, not side by side. The norm's extra is the largest over the
    locks of (sum - largest) of its stages' norms (the concurrent tail counted the largest island's);
    the updates' figure is the largest sum of a lock's stages' updates, which the caller takes when
    it exceeds the concurrent tail's update seconds (an EMULATED slow island's update counts with its
    wait, which in the runtime holds no lock: an upper bound there)."""
    pb = analytic.dtype_bytes(cfg.param_dtype)
    counted = _norm_fractions(cfg, plan)
    norms: Dict[int, List[float]] = {}
    sums: Dict[int, float] = {}
    for k, lock in locks.items():
        c = ctxs[k]
        norms.setdefault(lock, []).append(c.costs.norm_time_s(c.n_params * counted[k], pb, c.spec.dp, c.spec.tp))
        sums[lock] = sums.get(lock, 0.0) + upd[k]
    extra = max((sum(v) - max(v) for v in norms.values()), default=0.0)
    return extra, max(sums.values(), default=0.0)


def _launch_locks(ctxs, proc_of) -> Dict[Tuple[int, int], int]:
    """Per stage key whose compute actions take a launch lock, the lock's id: stages on a mesh of
    more than one device (``dp x tp > 1``) of islands that are threads of one process
    (``DeviceCosts.process``) whose profile MEASURED that the process runs its multi-device
    computations one at a time (``DeviceCosts.serial_launch``: XLA:CPU, ``xla/pjrt/cpu/cpu_client.cc``).
    Only processes where such stages of at least two simulated processes (``proc_of``: islands under
    the runtime's concurrency) meet get a lock: within one simulated process actions already run one
    at a time. Empty when no lock applies."""
    groups: Dict[str, List[Tuple[int, int]]] = {}
    for k, c in ctxs.items():
        if c.costs.serial_launch and c.costs.process is not None and c.spec.dp * c.spec.tp > 1:
            groups.setdefault(c.costs.process, []).append(k)
    out: Dict[Tuple[int, int], int] = {}
    for ks in groups.values():
        if len({proc_of(k) for k in ks}) > 1:
            n = len(set(out.values()))
            out.update({k: n for k in ks})
    return out


def _concat(lists: Sequence[List[float]]) -> List[float]:
    out: List[float] = []
    for x in lists:
        out += x
    return out


def _send_ids(pl: _Pipeline) -> List[int]:
    """Per flat action of ``pl`` the message id its SEND delivers (over all replicas; -1 otherwise)."""
    out: List[int] = []
    for r in sorted(pl.rbase):
        m = pl.mbase[r]
        sm = pl.arrays[r].send_msg
        out += sm if m == 0 else [x + m if x >= 0 else -1 for x in sm]
    return out


def _run_replica(arr: ScheduleArrays, times: List[List[float]], dts: List[List[float]]):
    """``(start, end, order)`` of one replica whose stages each have their own process, as
    :func:`simulate` times it: a SEND's and a RECV's process time is folded into the compute that
    precedes / follows it (the runtime runs them back to back), a SEND takes 0 s and a RECV ends at
    ``max(start, delivery)``; ``order`` is the execution order (flat indices of ``arr``)."""
    ft, dt = [], []
    for s, t in enumerate(times):
        f = list(t)
        for i, pr, ns in zip(arr.compute[s], arr.prev_recv[s], arr.next_send[s]):
            extra = t[i - 1] if pr else 0.0
            extra += t[i + 1] if ns else 0.0
            f[i] = t[i] + extra
        ft += f
        dt += dts[s]
    st, en = run_stages(arr, ft, dt)
    return st, en, arr.exec_order

def _shared_groups(cfg: Any, plan: Any) -> List[Tuple[float, int, List[Tuple[int, int]]]]:
    """(parameters, tensors, holders) of every set of parameters held by several stages: the tied
    embedding (first and last stage of a replica) and every layer / embedding / head across replicas."""
    holders: Dict[str, List[Tuple[int, int]]] = {}
    size = {"embed": analytic.embed_params(cfg), "head": analytic.head_params(cfg)}
    for r, rep in enumerate(plan.replicas):
        for s, st in enumerate(rep.stages):
            names = [f"layer{i}" for i in range(st.first_layer, st.last_layer + 1)]
            if st.is_first or (st.is_last and cfg.tie_word_embeddings):
                names.append("embed")
            if st.is_last:
                names.append("head")
            for n in names:
                holders.setdefault(n, []).append((r, s))
    lp = analytic.layer_params(cfg)
    tensors = {"embed": 1, "head": 1 if cfg.tie_word_embeddings else 2}  # a layer: 7 matrices, 2 norms
    return [(size.get(n, lp), tensors.get(n, 9), h) for n, h in holders.items() if len(h) > 1]


# ---- islands sharing a host's cores (CPU islands of one machine) ------------------------------------

#: rounds of the co-run fixed point (simulate, slow overlapping compute, simulate again)
CORUN_ROUNDS = 4


def _shared_hosts(ctxs) -> Dict[Tuple[int, int], str]:
    """Per stage key, the host whose cores its island shares with at least one other island
    (``DeviceCosts.host`` set and a measured ``corun_factor > 1``, co-run relation or, since session 14,
    ``corun_update_factor > 1``: the updates alone slow each other); stages on hardware of their own are absent."""
    islands: Dict[str, set] = {}
    for c in ctxs.values():
        if c.costs.host is not None and (c.costs.corun_factor > 1 or c.costs.corun_update_factor > 1
                                         or any(e > 0 for _, e in c.costs.corun_relation)):
            islands.setdefault(c.costs.host, set()).add(c.spec.island)
    return {k: c.costs.host for k, c in ctxs.items()
            if c.costs.host in islands and len(islands[c.costs.host]) > 1}


def _overlap(t0: float, t1: float, starts: List[float], ends: List[float]) -> float:
    """Seconds of ``[t0, t1]`` covered by the disjoint sorted intervals ``starts[i], ends[i]``."""
    from bisect import bisect_right
    i, out = max(0, bisect_right(starts, t0) - 1), 0.0
    while i < len(starts) and starts[i] < t1:
        out += max(0.0, min(t1, ends[i]) - max(t0, starts[i]))
        i += 1
    return out


def _corun_factors(events, ctxs, hosts, prev: Optional[Mapping[Any, float]] = None
                   ) -> Dict[Tuple[Tuple[int, int], int], float]:
    """Per ``(key, id(action))`` of a compute action on a shared host: ``1 + extra / t``, ``t`` the
    seconds of the action's computing part and ``extra`` the sum over the computing parts of OTHER
    islands' actions on the same host that overlap it of ``overlap_s x corun_extra(t / t_n)``
    (``DeviceCosts.corun_extra`` of the action's costs: the profile's MEASURED slowdown of a call beside
    a neighbour call ``t_n`` seconds long, by the pair's size ratio; the symmetric ``corun_factor - 1``
    for profiles without the relation, which makes this ``1 + (corun_factor - 1) x`` the overlapped
    fraction). Both ``t`` and ``t_n`` are taken alone: the timeline's seconds over the previous
    round's factor ``prev``. When an action is overlapped by several intervals that overlap each other
    (several stages of one island in processes of their own), the sum is scaled to the seconds
    overlapped by any. An emulated slow island's action computes for its first ``1 / factor`` and then
    waits (DESIGN.md section 9): the wait slows no one, and is itself proportional to the slowed compute."""
    from bisect import bisect_left, bisect_right
    prev = prev or {}
    busy: Dict[Tuple[str, str], List[Tuple[float, float, float]]] = {}
    computing = lambda k, t0, t1: (t0, t0 + (t1 - t0) / max(ctxs[k].factor, 1.0))
    for k, a, t0, t1 in events:
        if k in hosts and a.is_compute and t1 > t0:
            c0, c1 = computing(k, t0, t1)
            busy.setdefault((hosts[k], ctxs[k].spec.island), []).append((c0, c1, (c1 - c0) / prev.get((k, id(a)), 1.0)))
    others, merged = {}, {}
    for host, isl in busy:
        ivs = sorted(iv for (h, i), v in busy.items() if h == host and i != isl for iv in v)
        out: List[List[float]] = []
        for a0, a1, _ in ivs:
            if out and a0 <= out[-1][1]:
                out[-1][1] = max(out[-1][1], a1)
            else:
                out.append([a0, a1])
        others[(host, isl)] = (ivs, [x[0] for x in ivs], max((x[1] - x[0] for x in ivs), default=0.0))
        merged[(host, isl)] = ([x[0] for x in out], [x[1] for x in out])
    factors = {}
    for k, a, t0, t1 in events:
        key = (hosts.get(k), ctxs[k].spec.island)
        if key not in merged or not a.is_compute or t1 <= t0:
            continue
        c0, c1 = computing(k, t0, t1)
        union = _overlap(c0, c1, *merged[key])
        if union <= 0:
            factors[(k, id(a))] = 1.0
            continue
        ivs, starts, longest = others[key]
        t_alone = (c1 - c0) / prev.get((k, id(a)), 1.0)
        costs, total, extra = ctxs[k].costs, 0.0, 0.0
        for n0, n1, n_alone in ivs[bisect_left(starts, c0 - longest):bisect_right(starts, c1)]:
            ov = min(c1, n1) - max(c0, n0)
            if ov > 0 and n_alone > 0:
                total += ov
                extra += ov * costs.corun_extra(t_alone / n_alone)
        factors[(k, id(a))] = 1.0 + extra * min(1.0, union / total) / (c1 - c0) if total > 0 else 1.0
    return factors


def _shared_makespan(jobs: Sequence[float], factor: float) -> float:
    """Seconds until the last of ``jobs`` (seconds alone, started together on one host) ends when
    each runs ``factor`` times slower while another one runs too."""
    rem, t = sorted(j for j in jobs if j > 0), 0.0
    while len(rem) > 1:
        t += rem[0] * factor
        rem = [r - rem[0] for r in rem[1:]]
    return t + (rem[0] if rem else 0.0)


def _emulated_makespan(jobs: Sequence[Tuple[float, float]], factor: float) -> float:
    """Seconds until the last of ``jobs`` ends, each ``(own compute seconds alone, emulated slowdown e)``,
    all started together on one host: while two or more still compute, each computes ``factor`` times
    slower (the co-run slowdown); a job whose own compute ended after ``d`` seconds then waits
    ``(e - 1) d`` (the runtime's EMULATED wait, ``PipelineRuntime._emulate``: a sleep of ``(e - 1)`` times
    the measured busy seconds, which include the co-run slowdown) without computing, so it slows no one.
    With every ``e`` = 1 it is :func:`_shared_makespan`.

    Example (hand check): jobs (0.045, 1) and (0.015, 3), factor 1.76: both compute together at 1/1.76
    until the second's own compute ends at 0.015 x 1.76 = 0.0264 s, its end 3 x 0.0264 = 0.0792 s; the
    first has 0.030 s left, alone: 0.0564 s; makespan 0.0792 s."""
    rem = {i: c for i, (c, _) in enumerate(jobs) if c > 0}
    t, end = 0.0, 0.0
    while rem:
        rate = 1.0 / factor if len(rem) > 1 else 1.0
        dt = min(rem.values()) / rate
        t += dt
        for i in list(rem):
            rem[i] -= dt * rate
            if rem[i] <= 1e-12 * max(1.0, t):
                del rem[i]
                end = max(end, jobs[i][1] * t)
    return end


def _corun_tail(cfg: Any, plan: Any, ctxs, bridge: LinkModel, hosts, upd_per_island: Mapping[str, float],
                reduce_s: float, update_s: float) -> Tuple[float, float]:
    """(gradient sums + norm, update) seconds when islands sharing a host do their sums, norms and
    updates at the same time after the pipelines, in the runtime's two phases with the world all-reduce
    of the loss and the squared norm between them (``PipelineRuntime._forward_backward``, then
    ``_apply_updates``): per host,

    - the sums and norm reads (:func:`_reduction_parts` per island): :func:`_shared_makespan` at the
      host's compute co-run factor (``DeviceCosts.corun_factor``); ``reduce_s``'s island part is scaled
      by the ratio of that makespan to the slowest island alone (the bridge's part is not);
    - the updates, started together after that all-reduce: :func:`_emulated_makespan` of each island's
      own update seconds (``upd_per_island`` over its emulated slowdown) at the measured co-run factor of
      the islands' updates (``DeviceCosts.corun_update_factor``: ``profile.measure_tail_pair`` for
      islands of one process, ``benchmarks/hetero_e2e.py``'s update pair for two processes;
      ``corun_factor`` when not measured), the EMULATED wait after each island's own update not slowed
      and slowing no one. Until session 14 one makespan of (sums + norm + update) at the update factor
      slowed the emulated wait too and ignored the all-reduce between the phases.

    Islands on hosts of their own keep their alone figures."""
    parts, fixed = _reduction_parts(cfg, plan, ctxs, bridge)
    emul = {ctxs[k].spec.island: ctxs[k].factor for k in ctxs}
    alone_red = max(parts.values(), default=0.0)
    alone_upd = max(upd_per_island.values(), default=0.0)
    if alone_red <= 0 and alone_upd <= 0:
        return reduce_s, update_s
    on_host: Dict[str, Dict[str, Tuple[float, float]]] = {}
    for k, h in hosts.items():
        c, i = ctxs[k].costs, ctxs[k].spec.island
        on_host.setdefault(h, {})[i] = (c.corun_factor, c.corun_update_factor or c.corun_factor)
    shared = set(i for isl in on_host.values() for i in isl)
    red = max([_shared_makespan([parts.get(i, 0.0) for i in isl], max(f[0] for f in isl.values()))
               for isl in on_host.values()] + [parts.get(i, 0.0) for i in parts if i not in shared])
    upd = max([_emulated_makespan([(upd_per_island.get(i, 0.0) / max(emul.get(i, 1.0), 1e-12), emul.get(i, 1.0))
                                   for i in isl], max(f[1] for f in isl.values())) for isl in on_host.values()]
              + [t for i, t in upd_per_island.items() if i not in shared])
    isl_part = reduce_s - fixed
    red_scale = red / alone_red if alone_red > 0 else 1.0
    return isl_part * red_scale + fixed, upd


def _reduction_s(cfg: Any, plan: Any, ctxs, bridge: LinkModel) -> float:
    """Seconds of the sums of shared gradients (runtime ``_reduce_shared``: per island
    ``DeviceCosts.shared_sum_s`` of the float32 bytes its holders hold; a ring all-reduce over the
    bridge when the holders are on several islands, or for two islands the bridge's MEASURED all-reduce
    line, :func:`_bridge_allreduce_s`) and of the global norm (each stage reads its gradients once, one
    small all-reduce)."""
    parts, fixed = _reduction_parts(cfg, plan, ctxs, bridge)
    return max(parts.values(), default=0.0) + fixed


def _reduction_parts(cfg: Any, plan: Any, ctxs, bridge: LinkModel) -> Tuple[Dict[str, float], float]:
    """(per island: seconds of its shared-gradient sums and global-norm reads, seconds of the
    cross-island all-reduces and the bridge latency): the parts of :func:`_reduction_s`."""
    held: Dict[Tuple[str, int, int], List[float]] = {}  # float32 bytes, tensors over holders per island and mesh
    cross = 0.0
    own = _owned_fractions(cfg, plan)
    pb = analytic.dtype_bytes(cfg.param_dtype)
    for n, tensors, holders in _shared_groups(cfg, plan):
        nbytes = 4.0 * n
        isl = sorted({ctxs[k].spec.island for k in holders})
        for k in holders:
            c = ctxs[k]
            h = held.setdefault((c.spec.island, c.spec.dp, c.spec.tp), [0.0, 0])
            h[0] += nbytes
            h[1] += tensors
        reps = {k[0]: own[k] for k in holders} if own else {}
        if len(isl) > 1 and len(reps) > 1:  # ZeRO-1: reduce to the owners, gather the parameters
            cross += _zero1_exchange_s(bridge, list(reps.values()), nbytes + pb * n)
        elif len(isl) > 1:
            p = len(isl)
            measured = _bridge_allreduce_s(ctxs, holders, nbytes) if p == 2 else None
            cross += (measured if measured is not None
                      else 2 * (p - 1) * bridge.alpha_s + 2.0 * (p - 1) / p * nbytes / bridge.bandwidth)
    first = {c.spec.island: c for c in ctxs.values()}
    per_island: Dict[str, float] = {}
    for (i, dp, tp), (b, t) in held.items():  # the island's holders on each stage mesh (measured per mesh)
        per_island[i] = per_island.get(i, 0.0) + first[i].costs.shared_sum_s(b, t, dp, tp)
    norm = {}
    counted = _norm_fractions(cfg, plan)
    for k, ctx in ctxs.items():  # each stage's sq_norm of the gradients it counts (runtime `norm_owner`)
        norm[ctx.spec.island] = norm.get(ctx.spec.island, 0.0) + ctx.costs.norm_time_s(
            ctx.n_params * counted[k], pb, ctx.spec.dp, ctx.spec.tp)
    gather = _zero1_gather_host_s(cfg, plan, ctxs) if own else {}
    return ({i: per_island.get(i, 0.0) + norm.get(i, 0.0) + gather.get(i, 0.0) for i in norm},
            cross + (bridge.alpha_s if len(plan.islands) > 1 else 0.0))


def _bridge_allreduce_s(ctxs, holders, nbytes: float) -> Optional[float]:
    """The MEASURED seconds of the bridge's all-reduce of ``nbytes`` between the two islands of ``holders``
    (``DeviceCosts.bridge_allreduce_s``: the slower of the holders' lines), None unless every holder's costs
    carry it (then the ring formula over the bridge's point-to-point line applies)."""
    got = [ctxs[k].costs.bridge_allreduce_s(nbytes) for k in holders]
    return None if not got or any(t is None for t in got) else max(got)


def _zero1_gather_host_s(cfg: Any, plan: Any, ctxs) -> Dict[str, float]:
    """Per island, seconds of the host side of ZeRO-1's parameter gather (runtime ``_exchange_params`` /
    ``_from_owners``) for the tensors whose holders are on several islands: each stage copies every
    such tensor its replica owns to the host once (``multiprocess.host_copy``) and places every such
    tensor it does not own, received from the owner, on its devices (``jax.device_put``): one
    ``DeviceCosts.host_copy_s`` per tensor, of the tensor's parameter bytes per device. The bridge
    transfer itself is :func:`_zero1_exchange_s`."""
    from hethub_jax.parallel.plan import zero1_owners
    sizes = analytic.param_tensors(cfg)
    owners = zero1_owners(sizes, tuple(plan.batch_shares()))
    pb = analytic.dtype_bytes(cfg.param_dtype)
    names = {k: analytic.stage_tensor_names(cfg, c.spec.first_layer, c.spec.last_layer, c.spec.is_first,
                                            c.spec.is_last) for k, c in ctxs.items()}
    islands_of: Dict[str, set] = {}
    for k, ns in names.items():
        for n in ns:
            islands_of.setdefault(n, set()).add(ctxs[k].spec.island)
    out: Dict[str, float] = {}
    for k, ns in names.items():
        c = ctxs[k]
        total = sum(sizes[n] for n in ns)
        per_device = c.n_params / total if total else 0.0  # TP: a device holds its share of each tensor
        t = sum(c.costs.host_copy_s(sizes[n] * per_device * pb) for n in ns if len(islands_of[n]) > 1)
        out[c.spec.island] = out.get(c.spec.island, 0.0) + t
    return out


_OWNED_CACHE: Dict[tuple, Dict[str, int]] = {}


def _norm_fractions(cfg: Any, plan: Any) -> Dict[Tuple[int, int], float]:
    """Per stage (replica, stage), the fraction of its parameters (by size, :func:`analytic.param_tensors`)
    whose gradients it counts in the global norm, as the runtime's ``norm_owner`` picks the counting
    holder of each parameter: its first holder in (replica, stage) order, or under the sharded update
    (ZeRO-1) the first holder in the owning replica (:func:`hethub_jax.parallel.plan.zero1_owners`).
    A tensor held by one stage only is counted there."""
    sizes = analytic.param_tensors(cfg)
    names = {(r, s): analytic.stage_tensor_names(cfg, st.first_layer, st.last_layer, st.is_first, st.is_last)
             for r, rep in enumerate(plan.replicas) for s, st in enumerate(rep.stages)}
    owners = None
    if plan.sharded_update():
        from hethub_jax.parallel.plan import zero1_owners
        owners = zero1_owners(sizes, tuple(plan.batch_shares()))
    counter: Dict[str, Tuple[int, int]] = {}
    for k in sorted(names):
        for n in names[k]:
            if n not in counter and (owners is None or owners[n] == k[0]):
                counter[n] = k
    out = {}
    for k, ns in names.items():
        total = sum(sizes[n] for n in ns)
        out[k] = sum(sizes[n] for n in ns if counter.get(n) == k) / total if total else 0.0
    return out


def _owned_fractions(cfg: Any, plan: Any) -> Dict[Tuple[int, int], float]:
    """Under the sharded update (``plan.sharded_update()``, ZeRO-1): per stage (replica, stage), the
    fraction of its parameters that its replica owns and so updates: the runtime's owners,
    :func:`hethub_jax.parallel.plan.zero1_owners` of :func:`analytic.param_tensors` over the plan's batch
    shares, counting a tensor at its owning replica's first holder only (the runtime's ``norm_owner``:
    a tied embedding on a replica's last stage receives the updated tensor from its first stage).
    Empty when the update is replicated (every stage updates everything)."""
    if not plan.sharded_update():
        return {}
    from hethub_jax.parallel.plan import zero1_owners
    sizes = analytic.param_tensors(cfg)
    shares = tuple(plan.batch_shares())
    key = (tuple(sizes.items()), shares)
    if key not in _OWNED_CACHE:
        if len(_OWNED_CACHE) > 64:
            _OWNED_CACHE.clear()
        _OWNED_CACHE[key] = zero1_owners(sizes, shares)
    owners = _OWNED_CACHE[key]
    out = {}
    for r, rep in enumerate(plan.replicas):
        for s, st in enumerate(rep.stages):
            names = analytic.stage_tensor_names(cfg, st.first_layer, st.last_layer, st.is_first, st.is_last)
            total = sum(sizes[n] for n in names)
            first = lambda n: n != "embed_tokens" or st.is_first  # noqa: E731 - tied: the first stage updates it
            out[(r, s)] = sum(sizes[n] for n in names if owners[n] == r and first(n)) / total if total else 1.0
    return out


def _zero1_exchange_s(bridge: LinkModel, owned: Sequence[float], nbytes: float) -> float:
    """Seconds of ZeRO-1's two point-to-point exchanges over the bridge for ``nbytes`` (float32 gradient
    + parameter bytes) held by ``p = len(owned)`` replicas, replica r owning the fraction ``owned[r]``:
    the gradient reduce to the owners (r sends ``1 - owned[r]`` of the gradient bytes, receives
    ``(p - 1) owned[r]``) and the parameter gather (the same fractions of the parameter bytes), each
    bounded by the busiest rank's larger direction, plus one bridge latency per peer and exchange."""
    p = len(owned)
    if p < 2:
        return 0.0
    busiest = max(max(1.0 - f, (p - 1) * f) for f in owned)
    return 2 * (p - 1) * bridge.alpha_s + busiest * nbytes / bridge.bandwidth


def _update_fusable(plan: Any, cfg: Any, per_replica=None) -> bool:
    """The runtime's ``_update_fusable``: one replica of one stage (nothing shared) whose last
    backward directly follows the forward of the same microbatch."""
    if plan.num_replicas != 1 or plan.replicas[0].num_stages != 1:
        return False
    lists = per_replica[0][0] if per_replica is not None else plan.actions(0)
    acts = [a for a in lists[0] if a.is_compute]
    return (len(acts) >= 2 and acts[-1].kind == ActionKind.B and acts[-2].kind == ActionKind.F
            and acts[-1].microbatch == acts[-2].microbatch)


def predict(cfg: Any, plan: Any, costs: Mapping[str, DeviceCosts], *, seq_len: int,
            bridge: Optional[LinkModel] = None, concurrency: str = "runtime",
            grad_bucket_mb: Optional[Union[float, str]] = None) -> Prediction:
    """Predict one training step of ``plan`` for model ``cfg`` (module docstring: how).

    Args:
      cfg: the model config (``LlamaConfig`` or any object with its fields).
      plan: a :class:`~hethub_jax.parallel.plan.Plan` (validated here against ``cfg``).
      costs: per ISLAND NAME of the plan, the :class:`DeviceCosts` of its device type.
      seq_len: tokens per sample.
      bridge: the link between islands (default :data:`DEFAULT_BRIDGE`).
      concurrency: ``"runtime"`` (default): the stages of one island run one action at a time, as
        today's runtime runs them (one host process drives all of an island's stages and waits for
        each action); ``"stages"``: every stage runs concurrently on its own devices (a runtime with
        one driver per stage; an upper bound on what pipelining over one island can give).
      grad_bucket_mb: the runtime's gradient bucket size, MiB (``train.grad_bucket_mb``; None: buckets
        off). A heterogeneous-DP plan that can bucket (``predict_buckets.bucketing_off_reason``) is
        PREDICTED on BOTH paths (:mod:`hethub_jax.planner.predict_buckets`); ``step_time_s`` is the
        bucketed one when this is set, else the unbucketed one (the default: as before session 15);
        the other path's bucket layout uses :data:`DEFAULT_GRAD_BUCKET_MB`. ``"auto"`` (training's default,
        ``train.grad_bucket_mb: auto``): buckets of :data:`DEFAULT_GRAD_BUCKET_MB`, and ``step_time_s`` is the
        path ``hethub_jax.parallel.plan.keeps_bucketed_allreduce`` keeps given the two PREDICTED step times
        (the rule the runtime applies to its MEASURED warm-up seconds).

    Returns:
      a :class:`Prediction` (every figure predicted).
    Raises:
      ValueError: if the plan is invalid for ``cfg``, ``seq_len < 1``, an island has no costs,
        ``concurrency`` is unknown or ``grad_bucket_mb`` is not ``"auto"``, None or > 0.
    """
    if concurrency not in ("runtime", "stages"):
        raise ValueError(f"concurrency must be 'runtime' or 'stages', got {concurrency!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    from hethub_jax.parallel.plan import keeps_bucketed_allreduce

    auto = isinstance(grad_bucket_mb, str) and grad_bucket_mb == "auto"
    if auto:
        grad_bucket_mb = DEFAULT_GRAD_BUCKET_MB
    if grad_bucket_mb is not None and (isinstance(grad_bucket_mb, (str, bool)) or not grad_bucket_mb > 0):
        raise ValueError(f"grad_bucket_mb must be > 0 MiB, 'auto' or None (off), got {grad_bucket_mb!r}")
    plan.validate(cfg)
    bridge = bridge or DEFAULT_BRIDGE
    keys = [(r, s) for r in range(plan.num_replicas) for s in range(plan.replicas[r].num_stages)]
    alone = _alone_on_cores(plan, keys, costs)
    ctxs = {k: _stage_ctx(cfg, plan, k[0], k[1], costs, seq_len, k in alone) for k in keys}
    pb = analytic.dtype_bytes(cfg.param_dtype)
    arrays = {r: schedule_arrays(plan.schedule, plan.num_stages(r), plan.num_microbatches(r))
              for r in range(plan.num_replicas)}
    fuse = (plan.num_replicas == 1 and plan.num_stages(0) == 1  # else no Action lists are needed
            and _update_fusable(plan, cfg, {0: (arrays[0].lists,)}))
    own = _owned_fractions(cfg, plan)
    upd = {k: c.factor * c.costs.update_time_s(c.n_params * own.get(k, 1.0), pb, c.spec.dp, c.spec.tp)
           for k, c in ctxs.items()}
    fused_update_s = upd[(0, 0)] * (1 + 1 / 7) if fuse else 0.0
    proc_of = (lambda k: ctxs[k].spec.island) if concurrency == "runtime" else (lambda k: k)
    hosts = _shared_hosts(ctxs)

    def timed(last_action=None) -> _Pipeline:
        pl = _pipeline(cfg, plan, ctxs, bridge, seq_len, fused_update_s, proc_of, arrays, None, last_action)
        corun = None
        for _ in range(CORUN_ROUNDS if hosts else 0):  # islands sharing a host's cores slow each other
            corun = _corun_factors(pl.events(), ctxs, hosts, corun)
            pl = _pipeline(cfg, plan, ctxs, bridge, seq_len, fused_update_s, proc_of, arrays, corun, last_action)
        return pl

    pl = timed()
    pipeline_s = pl.pipeline_s
    reduce_raw = reduce_s = 0.0 if fuse else _reduction_s(cfg, plan, ctxs, bridge)
    per_island: Dict[str, float] = {}
    for k, t in upd.items():
        per_island[ctxs[k].spec.island] = per_island.get(ctxs[k].spec.island, 0.0) + t
    update_s = 0.0 if fuse else max(per_island.values())
    if hosts and not fuse:
        reduce_s, update_s = _corun_tail(cfg, plan, ctxs, bridge, hosts, per_island, reduce_s, update_s)
    locks = {} if fuse else _launch_locks(ctxs, proc_of)
    extra_norm_s = 0.0
    if locks:  # the islands' multi-device norms and updates run one at a time (one launcher)
        extra_norm_s, serial_update_s = _serial_tail(cfg, plan, ctxs, locks, upd)
        reduce_s, update_s = reduce_s + extra_norm_s, max(update_s, serial_update_s)
    step = pipeline_s + reduce_s + update_s
    path, step_u, step_b, bk = "unbucketed", step, None, None
    if not fuse and _bucket_off_reason(plan, arrays) is None:
        pl_b, reduce_b, bk = _bucketed(cfg, plan, ctxs, bridge, arrays, timed, reduce_raw, reduce_s - extra_norm_s,
                                       grad_bucket_mb or DEFAULT_GRAD_BUCKET_MB)
        reduce_b += extra_norm_s
        step_b = pl_b.pipeline_s + reduce_b + update_s
        bk["faster"] = "bucketed" if step_b < step_u else "unbucketed"
        # "auto": the runtime's rule (train.grad_bucket_mb auto: bucketed only when faster by more than
        # plan.BUCKETED_MIN_GAIN), applied to the PREDICTED seconds
        bk["auto_keeps"] = "bucketed" if keeps_bucketed_allreduce(step_b, step_u) else "unbucketed"
        if grad_bucket_mb is not None and (not auto or bk["auto_keeps"] == "bucketed"):
            path, pl, pipeline_s, reduce_s, step = "bucketed", pl_b, pl_b.pipeline_s, reduce_b, step_b
    stages = tuple(_stage_prediction(cfg, plan, ctxs[k], None, pl.busy[j], pipeline_s, seq_len,
                                     in_flight=_in_flight(ctxs[k], arrays[k[0]], k[1]))
                   for j, k in enumerate(keys))
    crit = _critical_path(pl, ctxs, pipeline_s, reduce_s, update_s)
    final = pl
    return Prediction(step, plan.global_batch_size * seq_len / step if step > 0 else float("inf"), stages,
                      pipeline_s, reduce_s, update_s, crit, LazyRecords(lambda: final.records(ctxs)),
                      all(s.fits for s in stages), path, step_u, step_b, bk)


#: bucket size, MiB, of the path ``predict`` was not asked for (``train.grad_bucket_mb``'s default)
DEFAULT_GRAD_BUCKET_MB = 25.0


def _bucket_off_reason(plan: Any, arrays) -> Optional[str]:
    from hethub_jax.planner.predict_buckets import bucketing_off_reason
    return bucketing_off_reason(plan, arrays)


def _bucketed(cfg: Any, plan: Any, ctxs, bridge: LinkModel, arrays, timed, reduce_raw: float, reduce_final: float,
              bucket_mb: float):
    """The bucketed path of a plan that buckets (:mod:`hethub_jax.planner.predict_buckets`, items 1-3):
    ``(pipeline, gradient sums + norm seconds after it, terms dict)``. ``timed(last_action)`` times the
    pipelines (co-run rounds included); ``reduce_raw`` / ``reduce_final``: the unbucketed reduction before
    / after the host co-run adjustment (its island part is scaled by the same ratio here)."""
    from hethub_jax.planner import predict_buckets as pbk
    sums, norm, gather, cross_grad, fixed = _tail_split(cfg, plan, ctxs, bridge)
    terms = pbk.bucketed_terms(cfg, plan, ctxs, sums, bucket_mb * 2**20)
    last = {k: (terms.ratio[k], terms.on_core_s[k]) for k, ch in terms.chunked.items() if ch}
    pl = timed(last)
    # the bucket thread's work: each chunked island's own gradient sums as soon as ITS bucket is final (on a
    # host-computing island they ran inside the chunked action: on_core_s), the cross-island transfer of a
    # bucket once EVERY replica has it; one bucket at a time each, split by the buckets' bytes
    ready: List[float] = [float("-inf")] * len(terms.fractions)
    own_exposed: Dict[str, float] = {}
    hidden_sums: Dict[str, float] = {}
    for j, k in enumerate(pl.keys):
        ctx = ctxs[k]
        g = pl.lo[j] + _last_compute(ctx, arrays[k[0]], k[1])
        st = pl.start[g] + (pl.wait[g] if pl.wait is not None else 0.0)
        rs = pbk.ready_times(st, max(st, pl.end[g]), pbk.forward_fraction(ctx), terms.fractions, terms.chunked[k])
        ready = [max(a, b) for a, b in zip(ready, rs)]
        i = ctx.spec.island
        if terms.chunked[k] and not pbk.computes_on_host(ctx.costs):
            hidden_sums[i] = sums.get(i, 0.0)
            own_exposed[i] = pbk.exposed_s(rs, [sums.get(i, 0.0) * f for f in terms.fractions], pl.pipeline_s)
    cross_exposed = pbk.exposed_s(ready, [cross_grad * f for f in terms.fractions], pl.pipeline_s)
    chunked_isl = {ctxs[k].spec.island for k, ch in terms.chunked.items() if ch}

    def tail_sums(i: str) -> float:  # the island's sums left after the pipeline
        return own_exposed.get(i, 0.0 if i in chunked_isl else sums.get(i, 0.0))
    islands = set(norm) | set(sums) | set(gather)
    isl_b = max((norm.get(i, 0.0) + gather.get(i, 0.0) + tail_sums(i) for i in islands), default=0.0)
    isl_u = reduce_raw - fixed
    scale = (reduce_final - fixed) / isl_u if isl_u > 0 else 1.0
    reduce_b = isl_b * scale + (fixed - cross_grad) + cross_exposed
    hidden = cross_grad + max(hidden_sums.values(), default=0.0)
    exposed = cross_exposed + max(own_exposed.values(), default=0.0)
    name = lambda k: f"r{k[0]} ({ctxs[k].spec.island})"  # noqa: E731
    return pl, reduce_b, {
        "bucket_mb": float(bucket_mb), "fractions": list(terms.fractions),
        "chunked_replicas": {name(k): ch for k, ch in terms.chunked.items()},
        "ratio": {name(k): v for k, v in terms.ratio.items()},
        "ratio_source": {name(k): v for k, v in terms.ratio_source.items()},
        "on_core_s": {name(k): v for k, v in terms.on_core_s.items()},
        "hidden_s": hidden, "exposed_s": exposed, "cross_s": cross_grad, "cross_exposed_s": cross_exposed,
        "pipeline_s": pl.pipeline_s, "allreduce_s": reduce_b}


def _tail_split(cfg: Any, plan: Any, ctxs, bridge: LinkModel):
    """The unbucketed reduction's parts (:func:`_reduction_parts`) split for the bucketed path:
    ``(sums per island, norm reads per island, ZeRO-1 gather host work per island, the cross-island
    GRADIENT transfer s, the fixed part of _reduction_parts)``. The gradient transfer is ZeRO-1's reduce
    to the owners (:func:`_zero1_exchange_s` of the gradient bytes, one latency per peer) or the ring
    all-reduce; the fixed part also holds the parameter gather and one bridge latency."""
    parts, fixed = _reduction_parts(cfg, plan, ctxs, bridge)
    pb = analytic.dtype_bytes(cfg.param_dtype)
    counted = _norm_fractions(cfg, plan)
    own = _owned_fractions(cfg, plan)
    gather = _zero1_gather_host_s(cfg, plan, ctxs) if own else {}
    norm: Dict[str, float] = {}
    for k, c in ctxs.items():
        norm[c.spec.island] = norm.get(c.spec.island, 0.0) + c.costs.norm_time_s(
            c.n_params * counted[k], pb, c.spec.dp, c.spec.tp)
    sums = {i: max(0.0, v - norm.get(i, 0.0) - gather.get(i, 0.0)) for i, v in parts.items()}
    cross = 0.0
    for n, _, holders in _shared_groups(cfg, plan):
        isl = sorted({ctxs[k].spec.island for k in holders})
        reps = {k[0]: own[k] for k in holders} if own else {}
        if len(isl) > 1 and len(reps) > 1:
            p, owned = len(reps), list(reps.values())
            busiest = max(max(1.0 - f, (p - 1) * f) for f in owned)
            cross += (p - 1) * bridge.alpha_s + busiest * 4.0 * n / bridge.bandwidth
        elif len(isl) > 1:
            p = len(isl)
            cross += 2 * (p - 1) * bridge.alpha_s + 2.0 * (p - 1) / p * 4.0 * n / bridge.bandwidth
    return sums, norm, gather, cross, fixed


def _alone_on_cores(plan: Any, keys, costs: Mapping[str, DeviceCosts]) -> set:
    """The stage keys that run alone on their cores: the only stage of their island (over every
    replica) on an island that shares no host with another island (``DeviceCosts.host``)."""
    per_island: Dict[str, int] = {}
    for r, s in keys:
        i = plan.replicas[r].stages[s].island
        per_island[i] = per_island.get(i, 0) + 1
    hosts: Dict[str, int] = {}
    for i in per_island:
        h = getattr(costs.get(i), "host", None)
        if h is not None:
            hosts[h] = hosts.get(h, 0) + 1
    ok = {i for i, n in per_island.items()
          if n == 1 and hosts.get(getattr(costs.get(i), "host", None), 0) <= 1}
    return {k for k in keys if plan.replicas[k[0]].stages[k[1]].island in ok}


def _in_flight(ctx: _StageCtx, arr: ScheduleArrays, s: int) -> int:
    """Microbatches in flight on the runtime's list of stage ``s`` (``schedule.max_in_flight``;
    ``in_flight_bound`` promises the same for GPipe and 1F1B); none when every forward is fused with its
    backward (a last stage): ``stage_memory_bytes`` then counts the fused call's one microbatch."""
    return 0 if ctx.is_last and arr.all_fused[s] else arr.in_flight[s]


def _stage_prediction(cfg, plan, ctx: _StageCtx, acts: Optional[Sequence[Action]], busy: float, pipeline_s: float,
                      seq_len: int, in_flight: Optional[int] = None) -> StagePrediction:
    """The stage's figures; ``in_flight`` (microbatches in flight) is counted on ``acts`` when not given
    (0: every forward fused with its backward, see :func:`_in_flight`). A fused stage's compute per
    microbatch is its fused call's seconds (``t_fused``), else its F + B."""
    r, s = ctx.key
    spec = ctx.spec
    if in_flight is None:  # microbatches in flight on the list (see _in_flight)
        in_flight = max_in_flight(acts)
        if all(_fused(ctx, acts, i) for i, a in enumerate(acts) if a.kind == ActionKind.F):
            in_flight = 0
    mem = stage_memory_bytes(cfg, spec.first_layer, spec.last_layer, spec.is_first, spec.is_last,
                             microbatch_size=plan.microbatch_size, seq_len=seq_len, dp=spec.dp, tp=spec.tp,
                             in_flight=in_flight, recompute=plan.recompute)
    per_mb = ctx.t_fused if ctx.is_last and in_flight == 0 else ctx.t_f + ctx.t_b
    return StagePrediction(r, s, spec.island, ctx.costs.source, per_mb, busy,
                           1.0 - busy / pipeline_s if pipeline_s > 0 else 0.0, mem,
                           mem.total <= ctx.costs.memory_bytes)


def _critical_path(pl: _Pipeline, ctxs, pipeline_s: float, reduce_s: float, update_s: float) -> str:
    """Walks back from the last action (the first to end last, in run order): a RECV that waited
    continues at its SEND, anything else at the previous action of its process. Summarises compute
    seconds per stage on that path."""
    st, en, prev, code, key_of = pl.start, pl.end, pl.prev, pl.code, pl.key_of
    if not en:
        return "empty step"
    if pl.wait is not None:  # compute seconds only: not a wait for the launch lock
        st = list(map(operator.add, st, pl.wait))
    top = pl.pipeline_s
    last = []  # the actions that end last (each stage's end times never decrease along its list)
    for lo, hi in zip(pl.lo, pl.lo[1:] + [len(en)]):
        g = hi - 1
        while g >= lo and en[g] == top:
            last.append(g)
            g -= 1
    g = min(last, key=pl.order.index)
    on_path: List[Optional[float]] = [None] * len(pl.keys)
    sender, recv_msg = pl.sender, pl.recv_msg
    while g >= 0:
        c = code[g]
        if c < 2:
            k = key_of[g]
            x = on_path[k]
            on_path[k] = (0.0 if x is None else x) + en[g] - st[g]
            g = prev[g]
        elif c < 4:
            g = prev[g]
        else:
            p, t0 = prev[g], st[g]
            if (p < 0 or en[p] < t0 + 1e-15) and en[g] > t0:
                snd = sender[recv_msg[g]]
                g = snd if snd >= 0 else p
            else:
                g = p
    parts = ", ".join(f"r{k[0]}s{k[1]} ({ctxs[k].spec.island}) {t:.4g} s"
                      for k, t in sorted((pl.keys[j], t) for j, t in enumerate(on_path) if t is not None))
    return (f"pipeline {pipeline_s:.4g} s: compute on the critical path {parts}; then gradient "
            f"sums + norm {reduce_s:.4g} s, update {update_s:.4g} s")


# ---- predicted against measured -----------------------------------------------------------------------

#: ``island`` label prefix of predicted records in a Chrome trace (their own process group)
PREDICTED_LABEL = "predicted"


def predicted_records(cfg: Any, plan: Any, costs: Mapping[str, DeviceCosts], *, seq_len: int,
                      bridge: Optional[LinkModel] = None, offset_s: float = 0.0,
                      prediction: Optional[Prediction] = None) -> List[ActionRecord]:
    """The PREDICTED ActionRecords of one step of ``plan``, for a Chrome trace beside the measured ones:
    each record's ``island`` is ``"predicted: <island>"`` and its times start at ``offset_s`` (pass the
    measured step's first start to line them up). ``to_chrome_trace(..., predicted=...)`` puts them in
    their own process group labelled predicted. Uses ``prediction`` when given, else :func:`predict`."""
    p = prediction or predict(cfg, plan, costs, seq_len=seq_len, bridge=bridge)
    return [ActionRecord(r.stage, r.action, r.start_s + offset_s, r.end_s + offset_s,
                         f"{PREDICTED_LABEL}: {r.island}", r.replica) for r in p.timeline]


def compare_step(prediction: Prediction, measured_step_s: float) -> Tuple[str, Dict[str, float]]:
    """A "predicted vs measured step time" line and the metrics dict to log with the step.

    Returns:
      ``(line, metrics)``: ``metrics`` has ``predicted_step_time_s``, ``measured_step_time_s``,
      ``predicted_over_measured`` and ``predicted_tokens_per_s``; the line says which is which.
    Raises:
      ValueError: if ``measured_step_s`` is not positive.
    """
    if not measured_step_s > 0:
        raise ValueError(f"measured step time must be > 0 s, got {measured_step_s}")
    ratio = prediction.step_time_s / measured_step_s
    sources = sorted({s.source for s in prediction.stages})
    line = (f"step time: predicted {prediction.step_time_s:.4g} s ({'/'.join(sources)}) vs measured "
            f"{measured_step_s:.4g} s (predicted/measured {ratio:.3f})")
    return line, {"predicted_step_time_s": prediction.step_time_s, "measured_step_time_s": float(measured_step_s),
                  "predicted_over_measured": ratio, "predicted_tokens_per_s": prediction.tokens_per_s}


def costs_for_plan(plan: Any, profiles: Optional[Mapping[str, Any]] = None,
                   device_types: Optional[Mapping[str, str]] = None, efficiency: float = 0.4) -> Dict[str, DeviceCosts]:
    """Per island name, its :class:`DeviceCosts`: ``DeviceCosts.from_profile(profiles[name])`` when a
    profile (path or dict) is given for the island, else the catalog entry ``device_types[name]``
    (default: ``"cpu"`` for platform ``cpu``) at ``efficiency``.

    Raises:
      ValueError: for a non-cpu island with neither a profile nor a device type, or an unknown type.
    """
    profiles, device_types = profiles or {}, device_types or {}
    out: Dict[str, DeviceCosts] = {}
    for isl in plan.islands:
        if isl.name in profiles:
            out[isl.name] = DeviceCosts.from_profile(profiles[isl.name])
            continue
        kind = device_types.get(isl.name) or ("cpu" if isl.platform == "cpu" else None)
        if kind is None:
            raise ValueError(f"island {isl.name!r} (platform {isl.platform!r}) needs a profile or a device type "
                             f"(one of hethub_jax.planner.catalog.CATALOG)")
        out[isl.name] = DeviceCosts.from_catalog(kind, efficiency)
    return out


def tail_parts(cfg: Any, plan: Any, costs: Mapping[str, DeviceCosts], *, seq_len: int,
               bridge: Optional[LinkModel] = None) -> Dict[str, Any]:
    """The PREDICTED tail of a step (what :func:`predict` adds after the pipelines), part by part, so that
    each part can be set against its measured counterpart (``benchmarks/hetero_e2e.py``,
    ``figures.parts_planned_last_step``).

    Returns a dict of seconds (all PREDICTED):
      ``per_island``: per island name ``{"sums_s", "norm_s", "zero1_gather_host_s", "update_s"}``: the
        island's sums of shared gradients (``DeviceCosts.shared_sum_s``), its stages' global-norm reads
        (``DeviceCosts.norm_time_s``), the host side of the ZeRO-1 parameter gather
        (:func:`_zero1_gather_host_s`; 0 without the sharded update) and its stages' optimizer updates
        (``DeviceCosts.update_time_s`` of the owned parameters, times the emulated slowdown);
      ``bridge_s``: the cross-island transfers (ZeRO-1's reduce to the owners and parameter gather,
        :func:`_zero1_exchange_s`, or the ring all-reduce) and one bridge latency;
      ``allreduce_s``, ``update_s``: :func:`predict`'s two tail figures for the same plan (with the
        host co-run and launcher adjustments that the per-island parts above do not include).
    A step whose update is fused into the last F+B (one replica, one stage) has no tail: every part 0.

    Raises:
      ValueError: as :func:`predict`.
    """
    pred = predict(cfg, plan, costs, seq_len=seq_len, bridge=bridge)
    bridge = bridge or DEFAULT_BRIDGE
    keys = [(r, s) for r in range(plan.num_replicas) for s in range(plan.replicas[r].num_stages)]
    alone = _alone_on_cores(plan, keys, costs)
    ctxs = {k: _stage_ctx(cfg, plan, k[0], k[1], costs, seq_len, k in alone) for k in keys}
    islands = sorted({c.spec.island for c in ctxs.values()})
    zero = {i: {"sums_s": 0.0, "norm_s": 0.0, "zero1_gather_host_s": 0.0, "update_s": 0.0} for i in islands}
    if pred.allreduce_s == 0.0 and pred.update_s == 0.0:
        return {"per_island": zero, "bridge_s": 0.0, "allreduce_s": 0.0, "update_s": 0.0}
    pb = analytic.dtype_bytes(cfg.param_dtype)
    parts, fixed = _reduction_parts(cfg, plan, ctxs, bridge)
    own = _owned_fractions(cfg, plan)
    gather = _zero1_gather_host_s(cfg, plan, ctxs) if own else {}
    counted = _norm_fractions(cfg, plan)
    out = zero
    for k, c in ctxs.items():
        i = c.spec.island
        out[i]["norm_s"] += c.costs.norm_time_s(c.n_params * counted[k], pb, c.spec.dp, c.spec.tp)
        out[i]["update_s"] += c.factor * c.costs.update_time_s(c.n_params * own.get(k, 1.0), pb, c.spec.dp, c.spec.tp)
    for i in islands:
        out[i]["zero1_gather_host_s"] = gather.get(i, 0.0)
        out[i]["sums_s"] = max(0.0, parts.get(i, 0.0) - out[i]["norm_s"] - out[i]["zero1_gather_host_s"])
    return {"per_island": out, "bridge_s": fixed, "allreduce_s": pred.allreduce_s, "update_s": pred.update_s}
