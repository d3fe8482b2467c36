"""Records of executed or simulated pipeline actions, and Chrome traces of them (pure Python, no JAX).

:class:`ActionRecord` is the common record of the runtime (``hethub_jax.parallel.runtime``, measured)
and the simulator (``hethub_jax.planner.simulator``, predicted); :func:`to_chrome_trace` writes a
Perfetto-loadable trace of either (DESIGN.md sections 6 and 7). It lives beside ``schedule.py`` so
that the runtime does not depend on the planner.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from hethub_jax.parallel.schedule import Action

__all__ = ["ActionRecord", "RecordLike", "to_chrome_trace", "bubble_terms", "bubble_from_terms"]


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


RecordLike = Union[ActionRecord, Mapping[str, Any], Tuple[int, Action, float, float]]


def bubble_terms(records: Iterable[ActionRecord], start_s: Optional[float] = None,
                 keys: Optional[Iterable[Tuple[int, int]]] = None) -> Tuple[float, float, int]:
    """``(pipeline_s, busy_s, stages)`` of one step's records, the terms of :func:`bubble_from_terms`.

    Args:
      records: the step's records (one process's, or all); start_s: the step's start on their clock
        (default: the earliest record's start); keys: count only these stages ``(replica, stage)``
        (default: every stage in ``records``).

    Returns:
      ``pipeline_s``: seconds from ``start_s`` to the end of the last record; ``busy_s``: seconds in F
      and B records (summed over stages); ``stages``: number of stages counted. ``(0, 0, 0)`` without
      records."""
    keys = None if keys is None else set(keys)
    recs = [r for r in records if keys is None or (r.replica, r.stage) in keys]
    if not recs:
        return 0.0, 0.0, 0
    t0 = min(r.start_s for r in recs) if start_s is None else min(start_s, min(r.start_s for r in recs))
    pipeline = max(r.end_s for r in recs) - t0
    busy = sum(r.end_s - r.start_s for r in recs if r.action[:1] in ("F", "B"))
    return pipeline, busy, len({(r.replica, r.stage) for r in recs})


def bubble_from_terms(rows: Iterable[Tuple[float, float, int]]) -> Optional[float]:
    """The bubble fraction of a step from each process's :func:`bubble_terms`: the simulator's definition
    (``planner.simulator.Timeline.bubble_fraction``), the mean over all stages of ``1 - busy / pipeline``,
    with ``pipeline`` the longest process's pipeline time (from its own step start: durations, so the
    clocks of different machines need not agree) = ``1 - sum(busy) / (stages x pipeline)``. None when
    nothing was counted."""
    rows = list(rows)
    pipeline = max((r[0] for r in rows), default=0.0)
    busy, n = sum(r[1] for r in rows), sum(r[2] for r in rows)
    return 1.0 - busy / (n * pipeline) if pipeline > 0 and n else None


def _as_record(e: RecordLike) -> ActionRecord:
    if isinstance(e, ActionRecord):
        return e
    if isinstance(e, Mapping):
        return ActionRecord(int(e["stage"]), str(e["action"]), float(e["start_s"]), float(e["end_s"]),
                            e.get("island"), int(e.get("replica", 0)))
    s, a, t0, t1 = e
    return ActionRecord(int(s), str(a), float(t0), float(t1))


def to_chrome_trace(events: Union[Any, Iterable[RecordLike]], path: Union[str, os.PathLike],
                    *, include_comm: bool = True, predicted: Optional[Iterable[RecordLike]] = None) -> Dict[str, Any]:
    """Write a Chrome trace (JSON Object Format, loadable in Perfetto / chrome://tracing).

    Args:
      events: a simulator ``Timeline`` (anything with an ``events`` attribute), or an iterable of
        :class:`ActionRecord`, of dicts with keys ``stage, action, start_s, end_s`` (optional
        ``island``, ``replica``), or of ``(stage, action, start_s, end_s)`` tuples
        (``Timeline.events``).
      path: output file.
      include_comm: if False, only F and B records are written.
      predicted: optional PREDICTED records of the same step (``hethub_jax.planner.predictor.
        predicted_records``), same clock as ``events``: written in their own process groups (pids after
        the measured ones), each labelled ``"PREDICTED ..."``, events with ``cat`` ``"predicted"``.

    Layout: one complete event (``"ph": "X"``) per record with ``name`` the action text (``"F3"``),
    ``ts``/``dur`` in microseconds relative to the earliest record, ``pid`` one per (replica, island)
    (one per replica when no island is given), ``tid`` the stage index, ``cat`` ``"compute"`` or
    ``"comm"``; plus ``"ph": "M"`` metadata events naming each pid and tid. Zero-length SENDs keep
    ``dur`` 0.

    Returns:
      the trace dict that was written.
    """
    recs = [(_as_record(e), False) for e in getattr(events, "events", events)]
    recs += [(_as_record(e), True) for e in (getattr(predicted, "events", predicted) or ())]
    if not include_comm:
        recs = [(r, p) for r, p in recs if r.action[:1] in ("F", "B")]
    t0 = min((r.start_s for r, _ in recs), default=0.0)
    pids: Dict[Tuple[bool, int, Optional[str]], int] = {}
    for r, p in sorted(recs, key=lambda x: x[1]):  # measured groups first, then predicted
        pids.setdefault((p, r.replica, r.island), len(pids))
    trace: List[Dict[str, Any]] = []
    threads = set()
    for r, p in recs:
        pid = pids[(p, r.replica, r.island)]
        threads.add((pid, r.stage))
        cat = "predicted" if p else "compute" if r.action[:1] in ("F", "B") else "comm"
        trace.append({
            "name": r.action, "cat": cat, "ph": "X",
            "ts": (r.start_s - t0) * 1e6, "dur": max(0.0, r.end_s - r.start_s) * 1e6,
            "pid": pid, "tid": r.stage,
            "args": {"stage": r.stage, "replica": r.replica, "island": r.island, "predicted": p},
        })
    for (p, replica, island), pid in pids.items():
        label = ("PREDICTED " if p else "") + f"replica {replica}" + (f" / island {island}" if island is not None else "")
        trace.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
    for pid, stage in sorted(threads):
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": stage,
                      "args": {"name": f"stage {stage}"}})
    out = {"traceEvents": trace, "displayTimeUnit": "ms"}
    with open(path, "w") as f:
        json.dump(out, f)
    return out
