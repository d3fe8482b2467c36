"""Discrete-event timing of pipeline schedules, and Chrome traces (pure Python, no JAX).

:func:`simulate` times the very action lists the runtime executes (``hethub_jax.parallel.schedule``);
:func:`to_chrome_trace` writes a Perfetto-loadable trace of a simulated timeline or of the runtime's
measured :class:`ActionRecord` s (DESIGN.md sections 6 and 7).

Timing model of :func:`simulate` (all times in seconds, the step starts at 0):
  * each stage executes its list in order, one action at a time;
  * F and B occupy the stage for ``compute_time(stage, action)``;
  * a SEND occupies the sender for 0 s (non-blocking) and its message is delivered at
    ``send_end + comm_time(src_stage, dst_stage, send_action)``;
  * a RECV starts when the stage reaches it and ends at ``max(start, delivery time)``; the wait is
    idle time (it is not "busy").
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from hethub_jax.parallel.schedule import Action, execution_order, message_key

__all__ = ["ActionRecord", "Timeline", "simulate", "to_chrome_trace"]


@dataclass(frozen=True)
class ActionRecord:
    """One executed (or simulated) action: the common record of the simulator and the runtime.

    Attributes:
      stage: pipeline stage index (within its replica).
      action: the action's text, ``str(Action)``: ``"F3"``, ``"B3"``, ``"SEND_ACT3->1"``, ...
      start_s, end_s: start and end in seconds, on any clock shared by all records of one trace
        (the simulator starts the step at 0; the runtime may use ``time.perf_counter()``).
      island: optional island name, used to group stages in a trace.
      replica: optional data-parallel replica index (heterogeneous DP), default 0.
    """

    stage: int
    action: str
    start_s: float
    end_s: float
    island: Optional[str] = None
    replica: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


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


RecordLike = Union[ActionRecord, Mapping[str, Any], Tuple[int, Action, float, float]]


def _as_record(e: RecordLike) -> ActionRecord:
    if isinstance(e, ActionRecord):
        return e
    if isinstance(e, Mapping):
        return ActionRecord(int(e["stage"]), str(e["action"]), float(e["start_s"]), float(e["end_s"]),
                            e.get("island"), int(e.get("replica", 0)))
    s, a, t0, t1 = e
    return ActionRecord(int(s), str(a), float(t0), float(t1))


def to_chrome_trace(events: Union[Timeline, Iterable[RecordLike]], path: Union[str, os.PathLike],
                    *, include_comm: bool = True) -> Dict[str, Any]:
    """Write a Chrome trace (JSON Object Format, loadable in Perfetto / chrome://tracing).

    Args:
      events: a :class:`Timeline`, or an iterable of :class:`ActionRecord`, of dicts with keys
        ``stage, action, start_s, end_s`` (optional ``island``, ``replica``), or of
        ``(stage, action, start_s, end_s)`` tuples (``Timeline.events``).
      path: output file.
      include_comm: if False, only F and B records are written.

    Layout: one complete event (``"ph": "X"``) per record with ``name`` the action text (``"F3"``),
    ``ts``/``dur`` in microseconds relative to the earliest record, ``pid`` one per (replica, island)
    (one per replica when no island is given), ``tid`` the stage index, ``cat`` ``"compute"`` or
    ``"comm"``; plus ``"ph": "M"`` metadata events naming each pid and tid. Zero-length SENDs keep
    ``dur`` 0.

    Returns:
      the trace dict that was written.
    """
    recs = [_as_record(e) for e in (events.events if isinstance(events, Timeline) else events)]
    if not include_comm:
        recs = [r for r in recs if r.action[:1] in ("F", "B")]
    t0 = min((r.start_s for r in recs), default=0.0)
    pids: Dict[Tuple[int, Optional[str]], int] = {}
    trace: List[Dict[str, Any]] = []
    threads = set()
    for r in recs:
        pid = pids.setdefault((r.replica, r.island), len(pids))
        threads.add((pid, r.stage))
        trace.append({
            "name": r.action, "cat": "compute" if r.action[:1] in ("F", "B") else "comm", "ph": "X",
            "ts": (r.start_s - t0) * 1e6, "dur": max(0.0, r.end_s - r.start_s) * 1e6,
            "pid": pid, "tid": r.stage,
            "args": {"stage": r.stage, "replica": r.replica, "island": r.island},
        })
    for (replica, island), pid in pids.items():
        label = f"replica {replica}" + (f" / island {island}" if island is not None else "")
        trace.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
    for pid, stage in sorted(threads):
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": stage,
                      "args": {"name": f"stage {stage}"}})
    out = {"traceEvents": trace, "displayTimeUnit": "ms"}
    with open(path, "w") as f:
        json.dump(out, f)
    return out
