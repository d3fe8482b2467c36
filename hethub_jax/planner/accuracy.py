"""Predicted against measured, action class by action class (pure Python, no JAX).

:func:`action_breakdown` lays a measured step (the runtime's ``ActionRecord``s,
``hethub_jax.parallel.trace``) beside the predicted timeline of the same plan
(``Prediction.timeline``) and says where the seconds differ: inside compute actions (F, B), in
sends and receives, between actions (idle: waits on other islands, the runtime's own work), or after
the pipeline (gradient sums, norm, update). ``benchmarks/predictor_accuracy.py --breakdown`` prints it
per configuration (docs/benchmarks.md, "Predictor accuracy").
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Sequence, Tuple

__all__ = ["action_kind", "action_breakdown", "format_breakdown", "round_orders", "spread_summary"]


def action_kind(action: str) -> str:
    """``"F"``, ``"B"``, ``"SEND"`` or ``"RECV"`` of an action's text (``str(Action)``:
    ``"F3"``, ``"SEND_ACT3->1"``, ``"RECV_GRAD2<-1"``).

    Raises:
      ValueError: for any other text.
    """
    if action.startswith("SEND"):
        return "SEND"
    if action.startswith("RECV"):
        return "RECV"
    if action[:1] in ("F", "B"):
        return action[:1]
    raise ValueError(f"not a pipeline action: {action!r}")


def _arrivals(records: Sequence[Any]) -> Dict[Tuple[int, str, int, int, int], float]:
    """Per message ``(replica, kind, microbatch, src stage, dst stage)`` the end of its SEND."""
    out = {}
    for r in records:
        if r.action.startswith("SEND"):
            head, peer = r.action.split("->")
            kind, mb = head.rstrip("0123456789")[len("SEND_"):], int(head[len(head.rstrip("0123456789")):])
            out[(r.replica, kind, mb, r.stage, int(peer))] = r.end_s
    return out


def _recv_wait(r: Any, arrivals: Mapping[Tuple[int, str, int, int, int], float]) -> float:
    """Seconds a predicted RECV record waits for its message: from its start until its SEND ended
    (0 when the SEND is not in the records)."""
    head, peer = r.action.split("<-")
    kind, mb = head.rstrip("0123456789")[len("RECV_"):], int(head[len(head.rstrip("0123456789")):])
    sent = arrivals.get((r.replica, kind, mb, int(peer), r.stage))
    return 0.0 if sent is None else min(r.end_s - r.start_s, max(0.0, sent - r.start_s))


def _side(records: Iterable[Any], start_s: float, predicted: bool) -> Tuple[Dict[str, list], Dict[str, list]]:
    """(per ``"island/stage/kind"`` ``[count, seconds]``, per island ``[pipeline end, busy seconds]``).
    A predicted RECV's record runs from when its process is free until its message has arrived and
    been placed: the part before its SEND ended is waiting (idle), not the RECV's own cost. A
    measured RECV starts once its message has arrived (the runtime runs it only then)."""
    records = list(records)
    arrivals = _arrivals(records) if predicted else {}
    acts: Dict[str, list] = {}
    ends: Dict[str, list] = {}
    for r in records:
        kind = action_kind(r.action)
        dur = r.end_s - r.start_s - (_recv_wait(r, arrivals) if predicted and kind == "RECV" else 0.0)
        a = acts.setdefault(f"{r.island}/{r.stage}/{kind}", [0, 0.0])
        a[0], a[1] = a[0] + 1, a[1] + dur
        e = ends.setdefault(str(r.island), [0.0, 0.0])
        e[0], e[1] = max(e[0], r.end_s - start_s), e[1] + dur
    return acts, ends


def action_breakdown(prediction: Any, measured: Iterable[Any], start_s: float,
                     islands: Mapping[str, Tuple[float, float]]) -> Dict[str, Any]:
    """Measured against predicted seconds of ONE step of a plan with one replica per island name.

    Args:
      prediction: the plan's ``Prediction`` (its ``timeline`` starts at 0, ``allreduce_s`` and
        ``update_s`` follow the pipeline).
      measured: the step's measured ``ActionRecord``s of every island (``island`` set).
      start_s: the step's start on the records' clock (seconds; the earliest island's start).
      islands: per island name, ``(start_s, step_s)``: when that island's ``train_step`` began and
        its measured step time (seconds).

    Returns:
      ``{"actions": {"island/stage/kind": {"count", "measured_s", "predicted_s"}}, "islands":
      {island: {"measured_pipeline_end_s", "predicted_pipeline_end_s", "measured_busy_s",
      "predicted_busy_s", "measured_idle_s", "predicted_idle_s", "measured_tail_s",
      "predicted_tail_s"}}}``: summed durations (seconds) of each stage's actions of a kind (F, B,
      SEND, RECV; ``count`` measured); per island the end of its last pipeline action after
      ``start_s``, its busy seconds (summed durations), idle = end - busy (waits on other islands and
      the runtime's work between actions), and the tail after the pipeline (measured: the island's
      step end - its pipeline end; predicted: ``allreduce_s + update_s``). Keys missing on one side
      read 0. When every process of the prediction runs one stage, the predictor folds the SEND and
      RECV host copies into the neighbouring compute records (docs/predictor.md, "Timeline"): its
      SEND rows read 0 there and its F/B rows include the copies.
    """
    m_acts, m_ends = _side(measured, start_s, False)
    p_acts, p_ends = _side(prediction.timeline, 0.0, True)
    acts = {k: {"count": m_acts.get(k, p_acts.get(k, [0]))[0], "measured_s": m_acts.get(k, [0, 0.0])[1],
                "predicted_s": p_acts.get(k, [0, 0.0])[1]} for k in sorted(set(m_acts) | set(p_acts))}
    out: Dict[str, Any] = {"actions": acts, "islands": {}}
    for isl in sorted(set(m_ends) | set(p_ends) | set(islands)):
        m_end, m_busy = m_ends.get(isl, [0.0, 0.0])
        p_end, p_busy = p_ends.get(isl, [0.0, 0.0])
        t0, step_s = islands.get(isl, (start_s, m_end))
        out["islands"][isl] = {
            "measured_pipeline_end_s": m_end, "predicted_pipeline_end_s": p_end,
            "measured_busy_s": m_busy, "predicted_busy_s": p_busy,
            "measured_idle_s": m_end - m_busy, "predicted_idle_s": p_end - p_busy,
            "measured_tail_s": (t0 + step_s) - (start_s + m_end),
            "predicted_tail_s": float(prediction.allreduce_s + prediction.update_s)}
    return out


def format_breakdown(b: Mapping[str, Any]) -> str:
    """:func:`action_breakdown` as indented lines of milliseconds."""
    lines = [f"    {k:14s} x{r['count']:<3d} measured {1e3 * r['measured_s']:8.2f} ms  "
             f"predicted {1e3 * r['predicted_s']:8.2f} ms" for k, r in b["actions"].items()]
    for isl, r in b["islands"].items():
        ms = {k: 1e3 * v for k, v in r.items()}
        lines.append(f"    island {isl}: pipeline end measured {ms['measured_pipeline_end_s']:.1f} / predicted "
                     f"{ms['predicted_pipeline_end_s']:.1f} ms, idle {ms['measured_idle_s']:.1f} / "
                     f"{ms['predicted_idle_s']:.1f} ms, tail {ms['measured_tail_s']:.1f} / "
                     f"{ms['predicted_tail_s']:.1f} ms")
    return "\n".join(lines)


def round_orders(names: Sequence[str], rounds: int) -> list:
    """The order in which to measure ``names`` in each of ``rounds`` rounds: round ``r`` starts at
    position ``r x len(names) // rounds`` of ``names`` and wraps (a rotation), so that every
    configuration is measured once per round, at a different point of each round, and a drift of the
    machine's speed during the run spreads over the configurations instead of landing on the ones
    measured last. Returns a list of ``rounds`` lists.

    Raises:
      ValueError: if ``rounds < 1`` or ``names`` is empty.
    """
    names = list(names)
    if rounds < 1 or not names:
        raise ValueError(f"need rounds >= 1 and at least one configuration, got {rounds} and {len(names)}")
    out = []
    for r in range(rounds):
        k = (r * len(names)) // rounds
        out.append(names[k:] + names[:k])
    return out


def spread_summary(predicted_s: float, per_round_s: Sequence[float]) -> Dict[str, Any]:
    """Predicted seconds against one configuration's measured seconds in several rounds (one figure
    per round, e.g. the minimum step time of that round's fresh runtime).

    Returns ``{"rounds_s"`` (the figures, in round order), ``"min_s"``, ``"median_s"``, ``"max_s"``,
    ``"spread"`` (max / min: the machine's noise on this configuration), ``"ape"`` (absolute error of
    the prediction against the median, as a fraction of it), ``"ape_min"`` (against the minimum),
    ``"within_spread"`` (min <= predicted <= max: the error is not larger than the measurement's own
    spread), ``"ape_beyond_spread"`` (distance from the prediction to the nearest end of
    ``[min, max]`` as a fraction of the median; 0 when within)``}``.

    Raises:
      ValueError: for no rounds or a non-positive figure.
    """
    xs = [float(x) for x in per_round_s]
    if not xs or min(xs) <= 0:
        raise ValueError(f"need at least one positive measured figure, got {per_round_s!r}")
    s = sorted(xs)
    n = len(s)
    med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    lo, hi = s[0], s[-1]
    beyond = max(0.0, lo - predicted_s, predicted_s - hi)
    return {"rounds_s": xs, "min_s": lo, "median_s": med, "max_s": hi, "spread": hi / lo,
            "ape": abs(predicted_s - med) / med, "ape_min": abs(predicted_s - lo) / lo,
            "within_spread": lo <= predicted_s <= hi, "ape_beyond_spread": beyond / med}
