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
"""
from __future__ import annotations

from dataclasses import dataclass
import heapq
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hethub_jax.parallel.schedule import Action, ScheduleDeadlock, execution_order, message_key
from hethub_jax.parallel.trace import ActionRecord

__all__ = ["Timeline", "simulate", "simulate_processes"]

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




def simulate_processes(lists: Mapping[Key, Sequence[Action]], process_of: Mapping[Key, Any],
                       action_time: Callable[[Key, int], float],
                       delivery_time: Callable[[Key, Action], float]) -> Tuple[Tuple[Key, Action, float, float], ...]:
    """Time action lists of stages that share processes, as ``hethub_jax.parallel.runtime`` runs them.

    Keys are ``(replica, stage)`` pairs; a SEND/RECV's ``peer`` is a stage of the same replica. Every
    process runs one action at a time: it sweeps its stages in the order of ``lists`` (keys of one
    process in insertion order), running each stage's next actions while they are ready (a RECV is
    ready once its message is delivered), and waits for the next delivery when none is ready -- the
    runtime's loop (``PipelineRuntime._run``). Processes run concurrently. With one stage per process
    the result equals :func:`simulate`'s.

    Args:
      lists: per key, its ordered action list (``plan.actions(r)[s]``).
      process_of: per key, the process (any hashable) that runs it.
      action_time: ``(key, index) -> seconds`` the process is busy with ``lists[key][index]`` (F, B,
        and the sender's / receiver's share of a SEND / RECV); >= 0.
      delivery_time: ``(key, send_action) -> seconds`` from the end of a SEND until its message is
        available to the receiver; >= 0.

    Returns:
      ``(key, action, start_s, end_s)`` per action, in the order they ran.
    Raises:
      ScheduleDeadlock: if some process waits forever.
      ValueError: if a callback returns a negative or non-finite time.
    """
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
