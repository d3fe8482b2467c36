"""Performance predictor: step time, tokens/s, bubble and memory of a plan (pure Python, no JAX).

How a prediction is made (DESIGN.md section 7; details and formulas in ``docs/predictor.md``):
  1. per stage and action, seconds from the island's :class:`~hethub_jax.planner.costs.DeviceCosts`
     (a profile or the catalog): the stage's fixed call cost + its layers + embedding (first stage) +
     LM head and loss (last stage), in the phase the runtime runs (``hethub_jax.parallel.runtime``:
     recompute ``none`` runs F = ``forward_saving``, B = ``backward_saved``; ``full`` runs F =
     ``forward``, B = ``backward_recompute``; on the last stage a forward directly followed by the
     backward of the same microbatch runs fused as one forward + backward, the B action then costs
     only the call), times the island's emulated slowdown (the runtime waits (f - 1) x each measured
     compute action and update, DESIGN.md section 9);
  2. the step's timeline from :func:`hethub_jax.planner.simulator.simulate` over ``plan.actions(r)``
     of every replica (the very lists the runtime executes); messages between islands take the
     sender's device-to-host copy, the bridge (``LinkModel``) and the receiver's host-to-device copy;
     when one process runs several stages (one island with several stages or replicas), the process
     executes them one action at a time in the runtime's order
     (:func:`hethub_jax.planner.simulator.simulate_processes`); islands sharing one host's cores
     (``DeviceCosts.on_shared_host``) slow their overlapping compute by the profile's measured co-run
     factor (a fixed point over the simulated timeline, :func:`_corun_factors`);
  3. after the pipelines: the sum of gradients of parameters held by several stages (tied
     embeddings, data-parallel replicas), the global norm, and every stage's optimizer update (the
     stages of one island one after the other);
  4. memory per device of every stage (:func:`stage_memory_bytes`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hethub_jax.parallel.schedule import Action, ActionKind, get_schedule, max_in_flight
from hethub_jax.parallel.trace import ActionRecord
from hethub_jax.planner import analytic
from hethub_jax.planner.costs import DeviceCosts, LinkModel
from hethub_jax.planner.simulator import simulate, simulate_processes

__all__ = ["MemoryBreakdown", "StagePrediction", "Prediction", "stage_compute_s", "stage_memory_bytes",
           "predict", "DEFAULT_BRIDGE", "predicted_records", "compare_step", "PREDICTED_LABEL", "costs_for_plan"]

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
      activations: residuals / stage inputs of the microbatches in flight (schedule, recompute).
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
      compute_s_per_microbatch: seconds of F + B of one microbatch (slowdown included).
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


@dataclass(frozen=True)
class Prediction:
    """Predicted step of a plan (every figure PREDICTED, not measured).

    Attributes:
      step_time_s: seconds per optimizer step.
      tokens_per_s: ``global_batch_size x seq_len / step_time_s``.
      stages: one :class:`StagePrediction` per (replica, stage).
      pipeline_s: seconds until the last pipeline action of the step ends.
      allreduce_s: seconds of the gradient sums across stages/replicas and the global norm.
      update_s: seconds of the optimizer updates (the slowest island's).
      critical_path: a readable summary of what bounds the step.
      timeline: the predicted actions as ActionRecords (``island`` names the island, labelled
        predicted by :func:`predicted_records`).
      fits: every stage fits its device memory.
    """

    step_time_s: float
    tokens_per_s: float
    stages: Tuple[StagePrediction, ...]
    pipeline_s: float
    allreduce_s: float
    update_s: float
    critical_path: str
    timeline: Tuple[ActionRecord, ...]
    fits: bool

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict (the timeline as a list of record dicts)."""
        return {"predicted": True, "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "pipeline_s": self.pipeline_s, "allreduce_s": self.allreduce_s, "update_s": self.update_s,
                "critical_path": self.critical_path, "fits": self.fits,
                "stages": [s.to_dict() for s in self.stages],
                "timeline": [asdict(r) for r in self.timeline]}


# ---- per-stage figures ------------------------------------------------------------------------------

def stage_compute_s(cfg: Any, costs: DeviceCosts, first_layer: int, last_layer: int, is_first: bool,
                    is_last: bool, tokens: float, seq_len: int, tp: int, phase: str, dp: int = 1) -> float:
    """Seconds of one stage action (phase ``"F"``, ``"F_nosave"``, ``"B"`` or ``"B_recompute"``, see
    ``costs.PHASES``) for one microbatch of ``tokens`` tokens per DP rank on a ``(dp, tp)`` mesh: the
    stage's fixed call cost + layers + embedding (first stage) + LM head and loss (last stage). No
    slowdown applied.

    Raises:
      ValueError: for an empty layer range or an unknown phase.
    """
    if last_layer < first_layer:
        raise ValueError(f"empty stage: first_layer {first_layer} > last_layer {last_layer}")
    t = costs.stage_overhead_s(tp, phase, dp)
    t += (last_layer - first_layer + 1) * costs.layer_time_s(cfg, tokens, seq_len, tp, phase, dp)
    if is_first:
        t += costs.embed_time_s(cfg, tokens, tp, phase, dp)
    if is_last:
        t += costs.head_time_s(cfg, tokens, seq_len, tp, phase, dp)
    return t


def stage_memory_bytes(cfg: Any, first_layer: int, last_layer: int, is_first: bool, is_last: bool, *,
                       microbatch_size: int, seq_len: int, dp: int, tp: int, in_flight: int, recompute: str,
                       param_dtype_bytes: Optional[int] = None,
                       compute_dtype_bytes: Optional[int] = None) -> MemoryBreakdown:
    """Peak memory per device of a stage (bytes), see :class:`MemoryBreakdown`.

    ``in_flight``: microbatches whose forward ran and backward has not (``schedule.in_flight_bound``).
    Activations (``analytic.layer_activation_bytes``, on the last stage plus
    ``analytic.head_activation_bytes``): recompute ``none``: ``in_flight x`` the stage's residuals
    (pass ``in_flight=0`` for a last stage whose forward is fused with its backward); ``full``: ``in_flight`` stage inputs plus one microbatch's residuals while its backward
    runs. dtype sizes default to the config's ``param_dtype`` and ``dtype``.

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
    if recompute == "none":
        act = in_flight * resid
    elif recompute == "full":
        act = in_flight * analytic.stage_input_bytes(cfg, tokens, is_first, ab) + resid
    else:
        raise ValueError(f"recompute must be 'none' or 'full', got {recompute!r}")
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


def _stage_ctx(cfg: Any, plan: Any, r: int, s: int, costs: Mapping[str, DeviceCosts], seq_len: int) -> _StageCtx:
    spec = plan.replicas[r].stages[s]
    if spec.island not in costs:
        raise ValueError(f"no costs for island {spec.island!r}; costs given for {sorted(costs)}")
    c, isl = costs[spec.island], plan.island(spec.island)
    factor = float(isl.slowdown) / c.emulated_slowdown
    tokens = plan.microbatch_size // spec.dp * seq_len
    args = (cfg, c, spec.first_layer, spec.last_layer, spec.is_first, spec.is_last, tokens, seq_len, spec.tp)
    f_phase, b_phase = ("F", "B") if plan.recompute == "none" else ("F_nosave", "B_recompute")
    n = analytic.stage_params_per_device(cfg, spec.first_layer, spec.last_layer, spec.is_first, spec.is_last, spec.tp)
    dp = spec.dp
    return _StageCtx((r, s), spec, isl, c, factor, tokens, factor * stage_compute_s(*args, f_phase, dp),
                     factor * stage_compute_s(*args, b_phase, dp), factor * stage_compute_s(*args, "B_recompute", dp),
                     n, bool(spec.is_last))


@lru_cache(maxsize=8)
def _schedule_lists(schedule: str, num_stages: int, num_microbatches: int):
    """``(lists, labels)``: the action lists ``get_schedule(schedule)(num_stages, num_microbatches)`` as
    tuples (shared between calls: read only) and ``str(action)`` per ``id(action)``. Cached: a search
    predicts many plans of the same (schedule, stages, microbatches), and building the lists and their
    labels is most of a prediction's time at thousands of microbatches."""
    lists = tuple(tuple(acts) for acts in get_schedule(schedule)(num_stages, num_microbatches))
    return lists, {id(a): str(a) for acts in lists for a in acts}


def _replica_lists(plan: Any):
    """Per replica index, :func:`_schedule_lists` of its (schedule, stages, microbatches): the same
    actions as ``plan.actions(r)``, built once per replica."""
    return {r: _schedule_lists(plan.schedule, plan.num_stages(r), plan.num_microbatches(r))
            for r in range(plan.num_replicas)}


def _fused(ctx: _StageCtx, acts: Sequence[Action], i: int) -> bool:
    """The runtime fuses a last stage's F with the directly following B of the same microbatch."""
    a = acts[i]
    return (ctx.is_last and a.kind == ActionKind.F and i + 1 < len(acts)
            and acts[i + 1].kind == ActionKind.B and acts[i + 1].microbatch == a.microbatch)


def _action_times(ctx: _StageCtx, acts: Sequence[Action], msg_bytes: float, cross: Mapping[int, bool],
                  fused_update_s: float) -> List[float]:
    """Seconds the stage's process is busy with each action: F/B compute; SEND: the sender's copy to
    the host when the peer is on another island (else 0); RECV: the copy onto the stage's devices."""
    out = []
    num_b = sum(a.kind == ActionKind.B for a in acts)
    b_seen = 0
    for i, a in enumerate(acts):
        if a.kind == ActionKind.F:
            if _fused(ctx, acts, i):
                last = b_seen == num_b - 1
                out.append(ctx.t_fused + (fused_update_s if last else 0.0))
            else:
                out.append(ctx.t_f)
        elif a.kind == ActionKind.B:
            b_seen += 1
            out.append(0.0 if i > 0 and _fused(ctx, acts, i - 1) else ctx.t_b)
        elif a.is_send:
            out.append(ctx.costs.host_copy_s(msg_bytes) if cross[a.peer] else 0.0)
        else:
            out.append(ctx.costs.host_copy_s(msg_bytes))
    return out


def _pipeline(cfg: Any, plan: Any, ctxs: Dict[Tuple[int, int], _StageCtx], bridge: LinkModel, seq_len: int,
              fused_update_s: float, proc_of, per_replica, corun=None):
    """(events as (key, action, start, end), busy seconds per key) of the step's pipelines;
    ``per_replica``: the action lists of each replica (:func:`_replica_lists`); ``corun``: optional
    factor per ``(key, id(action))`` multiplying that action's seconds (:func:`_corun_factors`)."""
    msg_bytes = plan.microbatch_size * seq_len * cfg.hidden_size * analytic.dtype_bytes(cfg.dtype)
    lists = {k: per_replica[k[0]][k[1]] for k in ctxs}
    times: Dict[Tuple[int, int], List[float]] = {}
    for k, ctx in ctxs.items():
        cross = {p: ctxs[(k[0], p)].spec.island != ctx.spec.island
                 for p in range(plan.replicas[k[0]].num_stages)}
        times[k] = _action_times(ctx, lists[k], msg_bytes, cross, fused_update_s)
        if corun:
            times[k] = [t * corun.get((k, id(a)), 1.0) for t, a in zip(times[k], lists[k])]
        if ctx.costs.action_overhead_s:  # the runtime's own (measured) seconds per action
            times[k] = [t + ctx.costs.action_overhead_s for t in times[k]]

    def delivery(k: Tuple[int, int], a: Action) -> float:
        return bridge.time_s(msg_bytes) if ctxs[(k[0], a.peer)].spec.island != ctxs[k].spec.island else 0.0

    procs = [proc_of(k) for k in ctxs]
    if len(set(procs)) == len(procs):  # one stage per process: the plain schedule simulator
        events = []
        for r in range(plan.num_replicas):
            keys = [(r, s) for s in range(plan.replicas[r].num_stages)]
            events += _simulate_replica(r, keys, lists, times, delivery)
    else:
        events = list(simulate_processes(lists, {k: proc_of(k) for k in ctxs},
                                         lambda k, i: times[k][i], delivery))
    busy = {k: 0.0 for k in ctxs}
    for k, a, t0, t1 in events:
        if a.is_compute:
            busy[k] += t1 - t0
    return events, busy


def _simulate_replica(r, keys, lists, times, delivery):
    """:func:`simulate` over the replica's lists; a SEND's and a RECV's process time is folded into
    the compute that precedes / follows it (the runtime runs them back to back), so the timeline
    equals :func:`simulate_processes`' for one stage per process."""
    fold = {}
    for k in keys:
        acts, t = lists[k], times[k]
        for i, a in enumerate(acts):
            if a.is_compute:
                extra = (t[i - 1] if i > 0 and acts[i - 1].is_recv else 0.0)
                extra += t[i + 1] if i + 1 < len(acts) and acts[i + 1].is_send else 0.0
                fold[(k[1], a.kind, a.microbatch)] = t[i] + extra
    tl = simulate([lists[k] for k in keys], lambda s, a: fold[(s, a.kind, a.microbatch)],
                  lambda s, d, a: delivery((r, s), a))
    return [((r, s), a, t0, t1) for s, a, t0, t1 in tl.events]


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
    (``DeviceCosts.host`` set and a measured ``corun_factor > 1``); stages on hardware of their own
    are absent."""
    islands: Dict[str, set] = {}
    for c in ctxs.values():
        if c.costs.host is not None and c.costs.corun_factor > 1:
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


def _corun_factors(events, ctxs, hosts) -> Dict[Tuple[Tuple[int, int], int], float]:
    """Per ``(key, id(action))`` of a compute action on a shared host: ``1 + (corun_factor - 1) x``
    the fraction of the action's computing part overlapped by the computing parts of OTHER islands'
    actions on the same host (the profile's measured co-run slowdown, applied for the time both
    compute). An emulated slow island's action computes for its first ``1 / factor`` and then waits
    (DESIGN.md section 9): the wait slows no one, and is itself proportional to the slowed compute."""
    busy: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
    computing = lambda k, t0, t1: (t0, t0 + (t1 - t0) / max(ctxs[k].factor, 1.0))
    for k, a, t0, t1 in events:
        if k in hosts and a.is_compute and t1 > t0:
            busy.setdefault((hosts[k], ctxs[k].spec.island), []).append(computing(k, t0, t1))
    merged = {}
    for host, isl in busy:
        ivs = sorted(iv for (h, i), v in busy.items() if h == host and i != isl for iv in v)
        out: List[List[float]] = []
        for a0, a1 in ivs:
            if out and a0 <= out[-1][1]:
                out[-1][1] = max(out[-1][1], a1)
            else:
                out.append([a0, a1])
        merged[(host, isl)] = ([x[0] for x in out], [x[1] for x in out])
    factors = {}
    for k, a, t0, t1 in events:
        key = (hosts.get(k), ctxs[k].spec.island)
        if key in merged and a.is_compute and t1 > t0:
            c0, c1 = computing(k, t0, t1)
            frac = _overlap(c0, c1, *merged[key]) / (c1 - c0)
            factors[(k, id(a))] = 1.0 + (ctxs[k].costs.corun_factor - 1.0) * frac
    return factors


def _shared_makespan(jobs: Sequence[float], factor: float) -> float:
    """Seconds until the last of ``jobs`` (seconds alone, started together on one host) ends when
    each runs ``factor`` times slower while another one runs too."""
    rem, t = sorted(j for j in jobs if j > 0), 0.0
    while len(rem) > 1:
        t += rem[0] * factor
        rem = [r - rem[0] for r in rem[1:]]
    return t + (rem[0] if rem else 0.0)


def _corun_tail(cfg: Any, plan: Any, ctxs, bridge: LinkModel, hosts, upd_per_island: Mapping[str, float],
                reduce_s: float, update_s: float) -> Tuple[float, float]:
    """(gradient sums + norm, update) seconds when islands sharing a host do their sums, norms and
    updates at the same time after the pipelines: per host :func:`_shared_makespan` of each island's
    (sums + norm + update) at the host's measured co-run factor; both figures are scaled by the
    ratio of that makespan to the slowest island alone."""
    parts, fixed = _reduction_parts(cfg, plan, ctxs, bridge)
    tail = {i: parts.get(i, 0.0) + u for i, u in upd_per_island.items()}
    alone = max(tail.values(), default=0.0)
    if alone <= 0:
        return reduce_s, update_s
    on_host: Dict[str, Dict[str, float]] = {}
    for k, h in hosts.items():
        on_host.setdefault(h, {})[ctxs[k].spec.island] = ctxs[k].costs.corun_factor
    shared = set(i for isl in on_host.values() for i in isl)
    new = max([_shared_makespan([tail[i] for i in isl], max(isl.values())) for isl in on_host.values()]
              + [t for i, t in tail.items() if i not in shared])
    scale = new / alone
    isl_part = reduce_s - fixed
    return isl_part * scale + fixed, update_s * scale


def _reduction_s(cfg: Any, plan: Any, ctxs, bridge: LinkModel) -> float:
    """Seconds of the sums of shared gradients (runtime ``_reduce_shared``: per island
    ``DeviceCosts.shared_sum_s`` of the float32 bytes its holders hold; a ring all-reduce over the
    bridge when the holders are on several islands) and of the global norm (each stage reads its
    gradients once, one small all-reduce)."""
    parts, fixed = _reduction_parts(cfg, plan, ctxs, bridge)
    return max(parts.values(), default=0.0) + fixed


def _reduction_parts(cfg: Any, plan: Any, ctxs, bridge: LinkModel) -> Tuple[Dict[str, float], float]:
    """(per island: seconds of its shared-gradient sums and global-norm reads, seconds of the
    cross-island all-reduces and the bridge latency): the parts of :func:`_reduction_s`."""
    held: Dict[str, List[float]] = {}  # float32 bytes and tensors summed over the holders on each island
    cross = 0.0
    for n, tensors, holders in _shared_groups(cfg, plan):
        nbytes = 4.0 * n
        isl = sorted({ctxs[k].spec.island for k in holders})
        for k in holders:
            h = held.setdefault(ctxs[k].spec.island, [0.0, 0])
            h[0] += nbytes
            h[1] += tensors
        if len(isl) > 1:
            p = len(isl)
            cross += 2 * (p - 1) * bridge.alpha_s + 2.0 * (p - 1) / p * nbytes / bridge.bandwidth
    first = {c.spec.island: c for c in ctxs.values()}
    per_island = {i: first[i].costs.shared_sum_s(b, t) for i, (b, t) in held.items()}
    norm = {}
    for k, ctx in ctxs.items():
        pb = analytic.dtype_bytes(cfg.param_dtype)
        norm[ctx.spec.island] = norm.get(ctx.spec.island, 0.0) + ctx.costs.update_time_s(ctx.n_params, pb,
                                                                                           ctx.spec.dp) / 7
    return ({i: per_island.get(i, 0.0) + norm.get(i, 0.0) for i in norm},
            cross + (bridge.alpha_s if len(plan.islands) > 1 else 0.0))


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
            bridge: Optional[LinkModel] = None, concurrency: str = "runtime") -> Prediction:
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

    Returns:
      a :class:`Prediction` (every figure predicted).
    Raises:
      ValueError: if the plan is invalid for ``cfg``, ``seq_len < 1``, an island has no costs, or
        ``concurrency`` is unknown.
    """
    if concurrency not in ("runtime", "stages"):
        raise ValueError(f"concurrency must be 'runtime' or 'stages', got {concurrency!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    plan.validate(cfg)
    bridge = bridge or DEFAULT_BRIDGE
    keys = [(r, s) for r in range(plan.num_replicas) for s in range(plan.replicas[r].num_stages)]
    ctxs = {k: _stage_ctx(cfg, plan, k[0], k[1], costs, seq_len) for k in keys}
    pb = analytic.dtype_bytes(cfg.param_dtype)
    lists = _replica_lists(plan)
    fuse = _update_fusable(plan, cfg, lists)
    upd = {k: c.factor * c.costs.update_time_s(c.n_params, pb, c.spec.dp) for k, c in ctxs.items()}
    fused_update_s = upd[(0, 0)] * (1 + 1 / 7) if fuse else 0.0
    proc_of = (lambda k: ctxs[k].spec.island) if concurrency == "runtime" else (lambda k: k)
    events, busy = _pipeline(cfg, plan, ctxs, bridge, seq_len, fused_update_s, proc_of,
                             {r: v[0] for r, v in lists.items()})
    hosts = _shared_hosts(ctxs)
    for _ in range(CORUN_ROUNDS if hosts else 0):  # islands sharing a host's cores slow each other
        events, busy = _pipeline(cfg, plan, ctxs, bridge, seq_len, fused_update_s, proc_of,
                                 {r: v[0] for r, v in lists.items()}, _corun_factors(events, ctxs, hosts))
    pipeline_s = max((t1 for _, _, _, t1 in events), default=0.0)
    reduce_s = 0.0 if fuse else _reduction_s(cfg, plan, ctxs, bridge)
    per_island: Dict[str, float] = {}
    for k, t in upd.items():
        per_island[ctxs[k].spec.island] = per_island.get(ctxs[k].spec.island, 0.0) + t
    update_s = 0.0 if fuse else max(per_island.values())
    if hosts and not fuse:
        reduce_s, update_s = _corun_tail(cfg, plan, ctxs, bridge, hosts, per_island, reduce_s, update_s)
    step = pipeline_s + reduce_s + update_s
    stages = tuple(_stage_prediction(cfg, plan, ctxs[k], lists[k[0]][0][k[1]], busy[k], pipeline_s, seq_len)
                   for k in keys)
    timeline = tuple(ActionRecord(k[1], lists[k[0]][1][id(a)], t0, t1, ctxs[k].spec.island, k[0])
                     for k, a, t0, t1 in events)
    crit = _critical_path(events, ctxs, pipeline_s, reduce_s, update_s, proc_of)
    return Prediction(step, plan.global_batch_size * seq_len / step if step > 0 else float("inf"), stages,
                      pipeline_s, reduce_s, update_s, crit, timeline, all(s.fits for s in stages))


def _stage_prediction(cfg, plan, ctx: _StageCtx, acts: Sequence[Action], busy: float, pipeline_s: float,
                      seq_len: int) -> StagePrediction:
    r, s = ctx.key
    spec = ctx.spec
    # microbatches in flight on the runtime's list (schedule.max_in_flight; in_flight_bound promises
    # the same for GPipe and 1F1B); none when every forward is fused with its backward (last stage)
    in_flight = max_in_flight(acts)
    if all(_fused(ctx, acts, i) for i, a in enumerate(acts) if a.kind == ActionKind.F):
        in_flight = 0
    mem = stage_memory_bytes(cfg, spec.first_layer, spec.last_layer, spec.is_first, spec.is_last,
                             microbatch_size=plan.microbatch_size, seq_len=seq_len, dp=spec.dp, tp=spec.tp,
                             in_flight=in_flight, recompute=plan.recompute)
    return StagePrediction(r, s, spec.island, ctx.costs.source, ctx.t_f + ctx.t_b, busy,
                           1.0 - busy / pipeline_s if pipeline_s > 0 else 0.0, mem,
                           mem.total <= ctx.costs.memory_bytes)


def _critical_path(events, ctxs, pipeline_s: float, reduce_s: float, update_s: float, proc_of) -> str:
    """Walks back from the last action: a RECV that waited continues at its SEND, anything else at the
    previous action of its process. Summarises compute seconds per stage on that path."""
    if not events:
        return "empty step"
    by_key: Dict[Any, List[tuple]] = {}
    send_of = {}
    for e in sorted(events, key=lambda x: (x[2], x[3])):
        by_key.setdefault(proc_of(e[0]), []).append(e)
        if e[1].is_send:
            send_of[(e[0][0], e[0][1], e[1].peer, e[1].kind, e[1].microbatch)] = e
    pos = {id(e): i for k, es in by_key.items() for i, e in enumerate(es)}
    e = max(events, key=lambda x: x[3])
    on_path: Dict[Tuple[int, int], float] = {}
    while e is not None:
        k, a, t0, t1 = e
        if a.is_compute:
            on_path[k] = on_path.get(k, 0.0) + t1 - t0
        i = pos[id(e)]
        prev = by_key[proc_of(k)][i - 1] if i > 0 else None
        if a.is_recv and (prev is None or prev[3] < t0 + 1e-15) and t1 > t0:
            kind = ActionKind.SEND_ACT if a.kind == ActionKind.RECV_ACT else ActionKind.SEND_GRAD
            snd = send_of.get((k[0], a.peer, k[1], kind, a.microbatch))
            e = snd if snd is not None else prev
        else:
            e = prev
    parts = ", ".join(f"r{k[0]}s{k[1]} ({ctxs[k].spec.island}) {t:.4g} s" for k, t in sorted(on_path.items()))
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
