"""The straightforward (slow) reference implementations of the planner's process-level simulator and
of ``predict``'s pipeline timing, kept verbatim from before the fast array simulator (issue 14), for
``tests/test_fast_simulator.py`` to compare the fast code against, output for output.

``simulate_processes`` runs one Python generator per process under a heap of process clocks;
``reference_predict`` is ``hethub_jax.planner.predictor.predict`` with the old per-action pipeline
code (``_action_times``, ``_pipeline``, ``_simulate_replica``, ``_critical_path``) and an eagerly built
timeline; the cost side (stage contexts, reductions, updates, memory) is the package's own.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

from hethub_jax.parallel.schedule import Action, ActionKind, ScheduleDeadlock, max_in_flight, message_key
from hethub_jax.parallel.trace import ActionRecord
from hethub_jax.planner import analytic
from hethub_jax.planner import predictor as P
from hethub_jax.planner.costs import LinkModel
from hethub_jax.planner.simulator import _checked, simulate

Key = Tuple[int, int]
_StageCtx = P._StageCtx


def simulate_processes(lists: Mapping[Key, Sequence[Action]], process_of: Mapping[Key, Any],
                       action_time: Callable[[Key, int], float],
                       delivery_time: Callable[[Key, Action], float]) -> Tuple[Tuple[Key, Action, float, float], ...]:
    """The generator-per-process implementation ``hethub_jax.planner.simulator.simulate_processes`` had
    before the flat-list rewrite, kept as the independent reference: same arguments, result and errors
    (the model is described in that function's docstring)."""
    procs: Dict[Any, List[Key]] = {}
    for k in lists:
        procs.setdefault(process_of[k], []).append(k)
    ptr = {k: 0 for k in lists}
    clock = {p: 0.0 for p in procs}
    delivered: Dict[tuple, float] = {}
    events: List[Tuple[Key, Action, float, float]] = []

    def mkey(k: Key, a: Action) -> tuple:
        return (k[0],) + message_key(k[1], a)

    def ready(k: Key, a: Action, now: float) -> bool:
        return not a.is_recv or delivered.get(mkey(k, a), float("inf")) <= now

    def run(p: Any):
        keys = procs[p]
        while any(ptr[k] < len(lists[k]) for k in keys):
            progressed = False
            for k in keys:
                while ptr[k] < len(lists[k]) and ready(k, lists[k][ptr[k]], clock[p]):
                    i, a = ptr[k], lists[k][ptr[k]]
                    start = clock[p]
                    clock[p] = start + _checked(action_time(k, i), "action_time", k[1], a)
                    if a.is_send:
                        delivered[mkey(k, a)] = clock[p] + _checked(delivery_time(k, a), "delivery_time", k[1], a)
                    events.append((k, a, start, clock[p]))
                    ptr[k] += 1
                    progressed = True
                    yield a.is_send
            if not progressed:
                yield None

    _drive(procs, {p: run(p) for p in procs}, clock, lambda p: [
        delivered[mkey(k, lists[k][ptr[k]])] for k in procs[p]
        if ptr[k] < len(lists[k]) and mkey(k, lists[k][ptr[k]]) in delivered],
        lambda p: [f"{k} at {lists[k][ptr[k]]}" for k in procs[p] if ptr[k] < len(lists[k])])
    return tuple(events)


def _drive(procs: Mapping[Any, Any], gens: Mapping[Any, Any], clock: Dict[Any, float],
           known_waits: Callable[[Any], List[float]], stuck: Callable[[Any], List[str]]) -> None:
    """Runs the process generators of :func:`simulate_processes` in time order: always the process with
    the smallest clock next (ties: first listed); a process with nothing ready jumps to its earliest
    known delivery, or sleeps until some SEND runs. Raises ScheduleDeadlock if all sleep."""
    order = {p: n for n, p in enumerate(procs)}
    heap = [(0.0, n, p) for p, n in order.items()]
    heapq.heapify(heap)
    blocked: set = set()
    while heap:
        _, _, p = heapq.heappop(heap)
        try:
            sent = next(gens[p])
        except StopIteration:
            continue
        if sent:  # a new message may unblock waiting processes
            for q in blocked:
                heapq.heappush(heap, (clock[q], order[q], q))
            blocked.clear()
        if sent is None:  # nothing ready: wait for the earliest known delivery after now
            waits = known_waits(p)
            if not waits:
                blocked.add(p)
                continue
            clock[p] = max(clock[p], min(waits))
        heapq.heappush(heap, (clock[p], order[p], p))
    if blocked:
        raise ScheduleDeadlock("schedule deadlock: no process can progress; waiting: "
                               + "; ".join(x for p in blocked for x in stuck(p)))


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
              fused_update_s: float, proc_of, per_replica):
    """(events as (key, action, start, end), busy seconds per key) of the step's pipelines;
    ``per_replica``: the action lists of each replica (:func:`_replica_lists`)."""
    msg_bytes = plan.microbatch_size * seq_len * cfg.hidden_size * analytic.dtype_bytes(cfg.dtype)
    lists = {k: per_replica[k[0]][k[1]] for k in ctxs}
    times: Dict[Tuple[int, int], List[float]] = {}
    for k, ctx in ctxs.items():
        cross = {p: ctxs[(k[0], p)].spec.island != ctx.spec.island
                 for p in range(plan.replicas[k[0]].num_stages)}
        times[k] = _action_times(ctx, lists[k], msg_bytes, cross, fused_update_s)
        over = getattr(ctx.costs, "action_overhead_s", 0.0)
        if over:  # the runtime's own (measured) seconds per action
            times[k] = [t + over for t in times[k]]

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


def reference_predict(cfg: Any, plan: Any, costs, *, seq_len: int, bridge=None, concurrency: str = "runtime"):
    """``predict`` as it was before the fast simulator (same checks, same figures)."""
    if concurrency not in ("runtime", "stages"):
        raise ValueError(f"concurrency must be 'runtime' or 'stages', got {concurrency!r}")
    plan.validate(cfg)
    bridge = bridge or P.DEFAULT_BRIDGE
    keys = [(r, s) for r in range(plan.num_replicas) for s in range(plan.replicas[r].num_stages)]
    ctxs = {k: P._stage_ctx(cfg, plan, k[0], k[1], costs, seq_len) for k in keys}
    pb = analytic.dtype_bytes(cfg.param_dtype)
    lists = {r: [list(a) for a in plan.actions(r)] for r in range(plan.num_replicas)}
    fuse = P._update_fusable(plan, cfg)
    upd = {k: c.factor * c.costs.update_time_s(c.n_params, pb, c.spec.dp) for k, c in ctxs.items()}
    fused_update_s = upd[(0, 0)] * (1 + 1 / 7) if fuse else 0.0
    proc_of = (lambda k: ctxs[k].spec.island) if concurrency == "runtime" else (lambda k: k)
    events, busy = _pipeline(cfg, plan, ctxs, bridge, seq_len, fused_update_s, proc_of, lists)
    pipeline_s = max((t1 for _, _, _, t1 in events), default=0.0)
    reduce_s = 0.0 if fuse else P._reduction_s(cfg, plan, ctxs, bridge)
    per_island: Dict[str, float] = {}
    for k, t in upd.items():
        per_island[ctxs[k].spec.island] = per_island.get(ctxs[k].spec.island, 0.0) + t
    update_s = 0.0 if fuse else max(per_island.values())
    step = pipeline_s + reduce_s + update_s
    stages = []
    for k in keys:
        ctx, acts = ctxs[k], lists[k[0]][k[1]]
        in_flight = max_in_flight(acts)
        if all(_fused(ctx, acts, i) for i, a in enumerate(acts) if a.kind == ActionKind.F):
            in_flight = 0
        stages.append(P._stage_prediction(cfg, plan, ctx, acts, busy[k], pipeline_s, seq_len, in_flight=in_flight))
    timeline = tuple(ActionRecord(k[1], str(a), t0, t1, ctxs[k].spec.island, k[0]) for k, a, t0, t1 in events)
    crit = _critical_path(events, ctxs, pipeline_s, reduce_s, update_s, proc_of)
    return P.Prediction(step, plan.global_batch_size * seq_len / step if step > 0 else float("inf"), tuple(stages),
                        pipeline_s, reduce_s, update_s, crit, timeline, all(s.fits for s in stages))
