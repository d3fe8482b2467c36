"""Discrete-event timing of pipeline schedules (pure Python, no JAX).

:func:`simulate` times the very action lists the runtime executes (``hethub_jax.parallel.schedule``).
Its :class:`Timeline` converts to the :class:`~hethub_jax.parallel.trace.ActionRecord` s that
:func:`hethub_jax.parallel.trace.to_chrome_trace` writes (DESIGN.md sections 6 and 7).

Timing model of :func:`simulate` (all times in seconds, the step starts at 0):
  * each stage executes its list in order, one action at a time;
  * F and B occupy the stage for ``compute_time(stage, action)``;
  * a SEND occupies the sender for 0 s (non-blocking) and its message is delivered at
    ``send_end + comm_time(src_stage, dst_stage, send_action)``;
  * a RECV starts when the stage reaches it and ends at ``max(start, delivery time)``; the wait is
    idle time (it is not "busy").

:func:`simulate_processes` times stages that share a process (the runtime's one driver per island).

``predict`` (``hethub_jax.planner.predictor``) times thousands of actions per plan and many plans per
search, so the same timings also run on flat integer lists: :func:`schedule_arrays` reduces a
(schedule, stages, microbatches) to kind codes and message ids once (cached), :func:`run_stages` is
:func:`simulate`'s walk and :func:`run_processes` :func:`simulate_processes`' process sweep over them, with
the same float operations in the same order (equal results; ``tests/test_fast_simulator.py`` checks them
against the straightforward implementations kept in ``tests/sim_reference.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
import heapq
from operator import itemgetter
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hethub_jax.parallel.schedule import (Action, ActionKind, ScheduleDeadlock, execution_order, get_schedule,
                                          message_key)
from hethub_jax.parallel.trace import ActionRecord

__all__ = ["Timeline", "simulate", "simulate_processes", "ScheduleArrays", "schedule_arrays", "run_processes",
           "run_stages"]

Key = Tuple[int, int]  # (replica, stage)


@dataclass(frozen=True)
class Timeline:
    """Result of :func:`simulate`.

    Attributes:
      events: one ``(stage, action, start_s, end_s)`` tuple per action, in execution order; ``action``
        is the :class:`Action` object.
      makespan_s: end of the last action, seconds (the step time; the step starts at 0).
      busy_s: per stage, seconds spent in F and B.
      bubble_fraction: per stage, ``1 - busy_s / makespan_s`` (0 when makespan is 0).
    """

    events: Tuple[Tuple[int, Action, float, float], ...]
    makespan_s: float
    busy_s: Tuple[float, ...]
    bubble_fraction: Tuple[float, ...]

    @property
    def mean_bubble_fraction(self) -> float:
        """Bubble over all stages: ``1 - sum(busy_s) / (num_stages * makespan_s)``."""
        if self.makespan_s == 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.makespan_s)

    def records(self, island_of_stage: Optional[Sequence[str]] = None, replica: int = 0) -> List[ActionRecord]:
        """The events as :class:`ActionRecord` s (for :func:`to_chrome_trace`), optionally tagged with
        the island of each stage (``island_of_stage[stage]``) and a replica index."""
        return [ActionRecord(s, str(a), t0, t1, island_of_stage[s] if island_of_stage else None, replica)
                for s, a, t0, t1 in self.events]


def simulate(actions_per_stage: Sequence[Sequence[Action]],
             compute_time: Callable[[int, Action], float],
             comm_time: Callable[[int, int, Action], float]) -> Timeline:
    """Time a schedule by discrete-event simulation (timing model in the module docstring).

    Args:
      actions_per_stage: per pipeline stage, its ordered action list (from ``schedule.get_schedule``).
      compute_time: ``(stage, action) -> seconds`` for F and B actions (only called for those); >= 0.
      comm_time: ``(src_stage, dst_stage, send_action) -> seconds`` from the end of a SEND until the
        message is available to the receiver; called once per SEND; >= 0.

    Returns:
      A :class:`Timeline`. The times do not depend on the interleaving used to walk the stages: each
      start time is fixed by the stage's previous action and, for a RECV, by its SEND.
    Raises:
      ScheduleDeadlock: if the lists wait on each other in a cycle or a RECV has no SEND.
      ValueError: if a callback returns a negative or non-finite time.
    """
    S = len(actions_per_stage)
    clock = [0.0] * S
    busy = [0.0] * S
    delivered: Dict[tuple, float] = {}
    events: List[Tuple[int, Action, float, float]] = []
    for s, i in execution_order(actions_per_stage):
        a = actions_per_stage[s][i]
        start = clock[s]
        if a.is_compute:
            end = start + _checked(compute_time(s, a), "compute_time", s, a)
            busy[s] += end - start
        elif a.is_send:
            end = start
            delivered[message_key(s, a)] = end + _checked(comm_time(s, a.peer, a), "comm_time", s, a)
        else:  # a RECV: execution_order guarantees its SEND already ran
            end = max(start, delivered[message_key(s, a)])
        clock[s] = end
        events.append((s, a, start, end))
    makespan = max(clock) if clock else 0.0
    bubble = tuple(1.0 - b / makespan if makespan > 0 else 0.0 for b in busy)
    return Timeline(tuple(events), makespan, tuple(busy), bubble)


def _checked(t: float, name: str, stage: int, a: Action) -> float:
    t = float(t)
    if not t >= 0 or t == float("inf"):
        raise ValueError(f"{name} returned {t} s for stage {stage}, {a}; times must be finite and >= 0")
    return t




# ---- flat integer form of action lists (the fast simulators below run on it) -----------------------

#: integer code of each action kind in :class:`ScheduleArrays` (codes < 2: compute, 2-3: SEND, 4-5: RECV)
KIND_CODE = {ActionKind.F: 0, ActionKind.B: 1, ActionKind.SEND_ACT: 2, ActionKind.SEND_GRAD: 3,
             ActionKind.RECV_ACT: 4, ActionKind.RECV_GRAD: 5}
_CODE_OF_ID = {id(k): c for k, c in KIND_CODE.items()}  # Enum hashing is slow; the members are singletons


def _flatten(groups: Sequence[Tuple[int, int, Sequence[Action]]]):
    """:func:`_flatten_codes` of ``(replica, stage, actions)`` lists."""
    code_of = _CODE_OF_ID
    return _flatten_codes([(r, s, [code_of[id(a.kind)] for a in acts], [a.microbatch for a in acts],
                            [a.peer for a in acts]) for r, s, acts in groups])


def _flatten_codes(groups: Sequence[Tuple[int, int, Sequence[int], Sequence[int], Sequence[Optional[int]]]]):
    """``(code, recv_msg, send_msg, sender, num_messages, offsets)`` of the lists ``(replica, stage, kind
    codes, microbatches, peers)`` laid end to end (flat index = position in that concatenation). A
    message id numbers each distinct ``(replica,) + message_key`` (first seen first); ``recv_msg`` /
    ``send_msg`` give per flat action the id it waits for / delivers (-1 for other actions),
    ``sender[id]`` the flat index of the SEND (-1 if none), ``offsets[n]`` the flat start of group ``n``
    (one more entry: the total)."""
    ids: Dict[tuple, int] = {}
    code: List[int] = []
    rmsg: List[int] = []
    smsg: List[int] = []
    sender: List[int] = []
    offsets = [0]
    for r, s, codes, mbs, peers in groups:
        for c, mb, peer in zip(codes, mbs, peers):
            m = -1
            if c >= 2:  # (replica, ACT 0 / GRAD 1, source stage, destination stage, microbatch): message_key
                key = (r, c & 1, s, peer, mb) if c < 4 else (r, c & 1, peer, s, mb)
                m = ids.get(key, -1)
                if m < 0:
                    m = ids[key] = len(ids)
                    sender.append(-1)
                if c < 4:
                    sender[m] = len(code)
            code.append(c)
            rmsg.append(m if c >= 4 else -1)
            smsg.append(m if 2 <= c < 4 else -1)
        offsets.append(len(code))
    return code, rmsg, smsg, sender, len(ids), offsets


def _slot_codes(schedule: str, S: int, M: int) -> Optional[List[Tuple[List[int], List[int], List[Optional[int]]]]]:
    """Per stage ``(kind codes, microbatches, peers)`` of ``get_schedule(schedule)(S, M)`` without building
    its Action objects, for the built-in ``gpipe`` and ``1f1b`` (the slot orders and the slot layout of
    ``hethub_jax.parallel.schedule``; ``tests/test_fast_simulator.py`` checks them against the lists);
    ``None`` for any other schedule."""
    if schedule not in ("gpipe", "1f1b"):
        return None
    out = []
    for s in range(S):
        if schedule == "gpipe":
            slots = [(0, m) for m in range(M)] + [(1, m) for m in range(M)]
        else:  # 1F1B: warm-up forwards, steady (F, B) pairs, cool-down backwards
            w = min(S - s - 1, M)
            slots = [(0, m) for m in range(w)]
            for i in range(M - w):
                slots += [(0, w + i), (1, i)]
            slots += [(1, m) for m in range(M - w, M)]
        codes: List[int] = []
        mbs: List[int] = []
        peers: List[Optional[int]] = []
        fwd = ([(4, s - 1)] if s > 0 else []) + [(0, None)] + ([(2, s + 1)] if s < S - 1 else [])
        bwd = ([(5, s + 1)] if s < S - 1 else []) + [(1, None)] + ([(3, s - 1)] if s > 0 else [])
        for b, m in slots:
            for c, peer in (bwd if b else fwd):
                codes.append(c)
                mbs.append(m)
                peers.append(peer)
        out.append((codes, mbs, peers))
    return out


class ScheduleArrays:
    """One schedule's action lists for ``S`` stages and ``M`` microbatches as flat integer lists, built
    once (:func:`schedule_arrays` caches them; read only). Flat index ``offsets[s] + i`` is
    ``lists[s][i]``.

    Attributes:
      lists: per stage its actions (tuples of :class:`Action`, ``get_schedule(name)(S, M)``), built on
        first use.
      offsets: ``S + 1`` flat starts; code, recv_msg, send_msg, sender, num_messages: see ``_flatten``.
      stage_codes: per stage its slice of ``code``.
      exec_order: flat indices in :func:`~hethub_jax.parallel.schedule.execution_order`.
      stage_of: per flat index its stage.
      compute: per stage the local indices of its F and B, in order; compute_get: per stage a function
        from the stage's list of per-action values to the tuple of its compute actions'; prev_recv / next_send: per
        compute action whether a RECV directly precedes / a SEND directly follows it.
      fused_f: per stage the local indices of F directly followed by the B of the same microbatch (the
        runtime fuses them on a last stage); last_fused_f: the one of them followed by the stage's last
        B, or -1; all_fused: every F of the stage is such an F.
      in_flight: per stage :func:`~hethub_jax.parallel.schedule.max_in_flight` of its list.
      labels: ``str(action)`` per flat index, built on first use.
    """

    def __init__(self, stages: Sequence[Tuple[Sequence[int], Sequence[int], Sequence[Optional[int]]]],
                 lists: Callable[[], Sequence[Sequence[Action]]]):
        """``stages``: per stage ``(kind codes, microbatches, peers)`` of its actions; ``lists``: returns
        the action lists themselves (called on first use of :attr:`lists`)."""
        self._lists_fn, self._lists = lists, None
        (self.code, self.recv_msg, self.send_msg, self.sender, self.num_messages,
         self.offsets) = _flatten_codes([(0, s, c, m, p) for s, (c, m, p) in enumerate(stages)])
        self.stage_codes = [list(c) for c, _, _ in stages]
        self.stage_of = [s for s, (c, _, _) in enumerate(stages) for _ in c]
        self.compute, self.compute_get, self.prev_recv, self.next_send = [], [], [], []
        self.fused_f, self.last_fused_f, self.all_fused, self.in_flight = [], [], [], []
        for codes, mbs, _ in stages:
            comp = [i for i, c in enumerate(codes) if c < 2]
            self.compute.append(comp)
            self.compute_get.append(_getter(comp))
            self.prev_recv.append([i > 0 and codes[i - 1] >= 4 for i in comp])
            self.next_send.append([i + 1 < len(codes) and 2 <= codes[i + 1] < 4 for i in comp])
            fused = [i for i in comp if codes[i] == 0 and i + 1 < len(codes) and codes[i + 1] == 1
                     and mbs[i + 1] == mbs[i]]
            last_b = max((i for i in comp if codes[i] == 1), default=-1)
            self.fused_f.append(fused)
            self.last_fused_f.append(last_b - 1 if last_b - 1 in set(fused) else -1)
            self.all_fused.append(len(fused) == sum(c == 0 for c in codes))
            self.in_flight.append(_max_in_flight(codes, mbs))
        self._labels: Optional[List[str]] = None
        self._exec_order: Optional[List[int]] = None

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[Action]]) -> "ScheduleArrays":
        """From the action lists themselves."""
        lists = tuple(tuple(a) for a in lists)
        code_of = _CODE_OF_ID
        return cls([([code_of[id(a.kind)] for a in acts], [a.microbatch for a in acts], [a.peer for a in acts])
                    for acts in lists], lambda: lists)

    @property
    def lists(self) -> Tuple[Tuple[Action, ...], ...]:
        """Per stage its actions (tuples of :class:`Action`; built on first use)."""
        if self._lists is None:
            self._lists = tuple(tuple(a) for a in self._lists_fn())
        return self._lists

    @property
    def exec_order(self) -> List[int]:
        """Flat indices in :func:`~hethub_jax.parallel.schedule.execution_order` (built on first use)."""
        if self._exec_order is None:
            self._exec_order = self._sweep()
        return self._exec_order

    def _sweep(self) -> List[int]:
        order = sweep_order(self.offsets, self.recv_msg, self.send_msg, self.num_messages)
        if order is None:
            execution_order(self.lists)  # raises ScheduleDeadlock naming the stuck actions
        return order

    @property
    def labels(self) -> List[str]:
        """``str(action)`` per flat index (built on first use)."""
        if self._labels is None:
            self._labels = [str(a) for acts in self.lists for a in acts]
        return self._labels


def _getter(idx: Sequence[int]) -> Callable[[Sequence[Any]], Tuple[Any, ...]]:
    """``lambda xs: tuple(xs[i] for i in idx)`` at C speed."""
    if len(idx) == 1:
        return lambda xs: (xs[idx[0]],)
    return itemgetter(*idx) if idx else (lambda xs: ())


def sweep_order(offsets: Sequence[int], recv_msg: Sequence[int], send_msg: Sequence[int],
                num_messages: int) -> Optional[List[int]]:
    """:func:`~hethub_jax.parallel.schedule.execution_order`'s sweep over flat lists (``_flatten_codes``):
    stages in index order, each running its next actions while they are ready (a RECV once its SEND
    ran), until all ran. Returns the flat indices in that order, or ``None`` if the lists deadlock."""
    nxt, sent, order = list(offsets[:-1]), [False] * num_messages, []
    while len(order) < offsets[-1]:
        done = len(order)
        for s in range(len(nxt)):
            g, h = nxt[s], offsets[s + 1]
            while g < h and (recv_msg[g] < 0 or sent[recv_msg[g]]):
                if send_msg[g] >= 0:
                    sent[send_msg[g]] = True
                order.append(g)
                g += 1
            nxt[s] = g
        if len(order) == done:
            return None
    return order


def _max_in_flight(codes: Sequence[int], mbs: Sequence[int]) -> int:
    """:func:`~hethub_jax.parallel.schedule.max_in_flight` over kind codes and microbatches."""
    live, peak = set(), 0
    for c, m in zip(codes, mbs):
        if c == 0:
            live.add(m)
            if len(live) > peak:
                peak = len(live)
        elif c == 1:
            live.discard(m)
    return peak


@lru_cache(maxsize=16)
def schedule_arrays(schedule: str, num_stages: int, num_microbatches: int) -> ScheduleArrays:
    """:class:`ScheduleArrays` of ``get_schedule(schedule)(num_stages, num_microbatches)``, cached (a
    search predicts many plans of the same schedule, stages and microbatches); for ``gpipe`` and
    ``1f1b`` built without the Action objects (those only on first use of ``lists``).

    Raises:
      ValueError: for an unknown schedule or sizes < 1.
    """
    make = get_schedule(schedule)
    if num_stages < 1 or num_microbatches < 1:
        make(num_stages, num_microbatches)  # raises, naming the size
    stages = _slot_codes(schedule, num_stages, num_microbatches)
    if stages is None:
        return ScheduleArrays.from_lists(make(num_stages, num_microbatches))
    return ScheduleArrays(stages, lambda: make(num_stages, num_microbatches))


# ---- processes that run several stages one action at a time --------------------------------------------

def _earliest_delivery(keys: Sequence[int], ptr: Sequence[int], hi: Sequence[int], recv_msg: Sequence[int],
                       dlv: Sequence[float]) -> float:
    """Seconds of the earliest known delivery among the messages the next actions of lists ``keys``
    wait for (``inf``: none is on its way)."""
    w = float("inf")
    for k in keys:
        g = ptr[k]
        if g < hi[k] and dlv[recv_msg[g]] < w:
            w = dlv[recv_msg[g]]
    return w


def run_processes(procs: Sequence[Sequence[int]], lo: Sequence[int], hi: Sequence[int], recv_msg: Sequence[int],
                  send_msg: Sequence[int], t: Sequence[float], dt: Sequence[float], num_messages: int,
                  lock: Optional[Sequence[int]] = None, hold: Optional[Sequence[float]] = None,
                  waits: Optional[List[float]] = None):
    """The timing of :func:`simulate_processes` over flat lists (its docstring has the model).

    Lists ``n`` occupy flat indices ``lo[n] .. hi[n]-1``; ``procs[p]`` names the lists process ``p``
    sweeps, in order (processes are numbered by first appearance: ties in time go to the lower
    number). Per flat action: ``recv_msg`` / ``send_msg`` (message id or -1, see ``_flatten``), ``t``
    seconds of process time and, for a SEND, ``dt`` seconds until delivery (all finite and >= 0;
    not checked here).

    Optional launch lock (several processes sharing one launcher that runs one computation at a time,
    first come first served: XLA:CPU's multi-device executions of one process, see
    ``hethub_jax.planner.predictor``): ``lock`` per flat action a lock id (-1: none) and ``hold`` the
    seconds from the action's start for which it holds that lock (its computing part, <= ``t``). An
    action whose lock is held when its process reaches it waits until it is free (``waits[g]``, when
    a list is given, receives the seconds; its ``start`` is when its process reached it, its ``end``
    includes the wait), then holds it for ``hold[g]``. Processes reach actions in time order (the
    earliest clock runs next), so the lock goes to the earliest request.

    Returns:
      ``(start, end, order, prev, blocked, ptr)``: per flat action its start and end (seconds), the
      flat indices in the order they ran, per flat action the one its process ran before it (-1 for
      the first), the processes left waiting forever (empty unless the lists deadlock) and per list
      the flat index of its next unrun action.
    """
    n, inf = len(t), float("inf")
    st, en, prev, dlv, ptr = [0.0] * n, [0.0] * n, [-1] * n, [inf] * num_messages, list(lo)
    order: List[int] = []
    rec = order.append
    P = len(procs)
    clock, sweep, last = [0.0] * P, [0] * P, [-1] * P
    rem = [sum(hi[k] - lo[k] for k in ks) for ks in procs]
    at_sweep = list(rem)  # actions left when the current sweep began (progress: fewer left now)
    heap = [(0.0, p) for p in range(P)]
    free = [0.0] * (max(lock) + 1 if lock else 0)  # per lock id: when it is free again
    blocked: List[int] = []
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        p = pop(heap)[1]
        c, r, r0, keys, j, lg = clock[p], rem[p], at_sweep[p], procs[p], sweep[p], last[p]
        nk = len(keys)
        hc, hn = heap[0] if heap else (inf, P)  # p runs on while it is before the next process
        while r:
            if j < nk:  # the sweep: run list keys[j]'s next actions while they are ready
                k = keys[j]
                g, h, y = ptr[k], hi[k], False
                while g < h:
                    m = recv_msg[g]
                    if m >= 0 and dlv[m] > c:
                        break
                    st[g] = c
                    if lock is not None and lock[g] >= 0:
                        f = free[lock[g]]
                        if f > c:
                            if waits is not None:
                                waits[g] = f - c
                            c = f
                        free[lock[g]] = c + hold[g]
                    c += t[g]
                    en[g] = c
                    prev[g] = lg
                    lg = g
                    rec(g)
                    r -= 1
                    m = send_msg[g]
                    g += 1
                    if m >= 0:
                        dlv[m] = c + dt[g - 1]
                        if blocked:  # a new message may unblock waiting processes
                            for q in blocked:
                                push(heap, (clock[q], q))
                            blocked = []
                            hc, hn = heap[0]
                    if c >= hc and r and (c > hc or p > hn):  # another process is earlier: it runs next
                        y = True
                        break
                ptr[k] = g
                if y:
                    push(heap, (c, p))
                    break
                j += 1
                continue
            j = 0
            if r != r0:  # the sweep ran something: sweep again
                r0 = r
                continue
            w = _earliest_delivery(keys, ptr, hi, recv_msg, dlv)  # nothing was ready: jump to it
            if w == inf:
                blocked.append(p)
                break
            if w > c:
                c = w
            if c >= hc and (c > hc or p > hn):
                push(heap, (c, p))
                break
        clock[p], rem[p], at_sweep[p], sweep[p], last[p] = c, r, r0, j, lg
    return st, en, order, prev, blocked, ptr


def simulate_processes(lists: Mapping[Key, Sequence[Action]], process_of: Mapping[Key, Any],
                       action_time: Callable[[Key, int], float],
                       delivery_time: Callable[[Key, Action], float]) -> Tuple[Tuple[Key, Action, float, float], ...]:
    """Time action lists of stages that share processes, as ``hethub_jax.parallel.runtime`` runs them.

    Keys are ``(replica, stage)`` pairs; a SEND/RECV's ``peer`` is a stage of the same replica. Every
    process runs one action at a time: it sweeps its stages in the order of ``lists`` (keys of one
    process in insertion order), running each stage's next actions while they are ready (a RECV is
    ready once its message is delivered), and waits for the next delivery when none is ready -- the
    runtime's loop (``PipelineRuntime._run``). Processes run concurrently, always the one with the
    earliest clock next (ties: the one listed first); a process with nothing ready jumps to the
    earliest delivery already known to it, or sleeps until some SEND runs. With one stage per process
    the result equals :func:`simulate`'s.

    Args:
      lists: per key, its ordered action list (``plan.actions(r)[s]``).
      process_of: per key, the process (any hashable) that runs it.
      action_time: ``(key, index) -> seconds`` the process is busy with ``lists[key][index]`` (F, B,
        and the sender's / receiver's share of a SEND / RECV); >= 0; called once per action.
      delivery_time: ``(key, send_action) -> seconds`` from the end of a SEND until its message is
        available to the receiver; >= 0; called once per SEND.

    Returns:
      ``(key, action, start_s, end_s)`` per action, in the order they ran.
    Raises:
      ScheduleDeadlock: if some process waits forever.
      ValueError: if a callback returns a negative or non-finite time.
    """
    keys = list(lists)
    procs: Dict[Any, List[int]] = {}
    for n, k in enumerate(keys):
        procs.setdefault(process_of[k], []).append(n)
    code, rmsg, smsg, _, nmsg, off = _flatten([(k[0], k[1], lists[k]) for k in keys])
    flat = [(k, i, a) for k in keys for i, a in enumerate(lists[k])]
    t = [_checked(action_time(k, i), "action_time", k[1], a) for k, i, a in flat]
    dt = [_checked(delivery_time(k, a), "delivery_time", k[1], a) if a.is_send else 0.0 for k, i, a in flat]
    st, en, order, _, blocked, ptr = run_processes(list(procs.values()), off[:-1], off[1:], rmsg, smsg, t, dt, nmsg)
    if blocked:
        plist = list(procs.values())
        raise ScheduleDeadlock("schedule deadlock: no process can progress; waiting: " + "; ".join(
            f"{keys[n]} at {flat[ptr[n]][2]}" for p in blocked for n in plist[p] if ptr[n] < off[n + 1]))
    return tuple((flat[g][0], flat[g][2], st[g], en[g]) for g in order)


def run_stages(arr: ScheduleArrays, t: Sequence[float], dt: Sequence[float]) -> Tuple[List[float], List[float]]:
    """:func:`simulate`'s timing over flat lists (one process per stage): ``t`` per flat action of
    ``arr`` the seconds of an F or B (other entries unused), ``dt`` per SEND the seconds until delivery
    (all finite and >= 0; not checked here). Walks ``arr.exec_order``: F and B end at start + ``t``, a
    SEND takes 0 s, a RECV ends at ``max(start, delivery)``; each start is its stage's previous end.

    Returns:
      ``(start, end)`` seconds per flat action (the same floats as :func:`simulate`).
    """
    n = len(arr.code)
    st, en = [0.0] * n, [0.0] * n
    clock, dlv = [0.0] * len(arr.lists), [0.0] * max(arr.num_messages, 1)
    code, rmsg, smsg, stage_of = arr.code, arr.recv_msg, arr.send_msg, arr.stage_of
    for g in arr.exec_order:
        s = stage_of[g]
        c = st[g] = clock[s]
        k = code[g]
        if k < 2:
            c = c + t[g]
        elif k < 4:
            dlv[smsg[g]] = c + dt[g]
        else:
            d = dlv[rmsg[g]]
            if d > c:
                c = d
        en[g] = clock[s] = c
    return st, en
