"""Gantt charts of one pipeline step: measured and PREDICTED side by side, as a PNG (matplotlib).

One row per (replica, island, stage); one bar per action, coloured by what it is: forward, backward,
forward+backward (fused: the runtime runs a last stage's forward directly followed by the backward of
the same microbatch as one call; the B action then only hands over its result), send, receive, or
emulated wait. The bars are the pipeline's actions only: the step's gradient all-reduce and optimizer
update follow them and are not drawn, so each panel's title gives the pipeline span "of step" the
whole step time when it is known. On an island with an emulated slowdown ``f`` (DESIGN.md section 9) the
runtime waits ``(f - 1) x`` the measured compute time at the end of every F and B action, so such an
action's record is drawn as its first ``1/f`` (forward or backward: the real computation) and the
remaining ``(f - 1)/f`` (emulated wait). The PREDICTED chart (``planner.predictor.predicted_records``)
is drawn the same way below the measured one, on the same time scale (milliseconds from each step's
first action), so a person sees where the prediction is off.

Pure Python except :func:`write_timeline_png`, which imports matplotlib (Agg backend, no display).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional

__all__ = ["Bar", "CATEGORIES", "COLOURS", "FUSED", "gantt_bars", "panel_title", "write_timeline_png"]

#: the category of a last stage's fused forward+backward action
FUSED = "forward+backward (fused)"
#: bar categories, in legend order
CATEGORIES = ("forward", "backward", FUSED, "send", "receive", "emulated wait")
#: their colours (matplotlib's tab10 palette)
COLOURS = {"forward": "tab:blue", "backward": "tab:orange", FUSED: "tab:red", "send": "tab:green",
           "receive": "tab:purple", "emulated wait": "tab:gray"}
_PREDICTED_PREFIX = "predicted: "


@dataclasses.dataclass(frozen=True)
class Bar:
    """One bar of the chart: ``row`` label, ``start_s`` (seconds from the step's first action),
    ``duration_s`` (seconds), ``category`` (one of :data:`CATEGORIES`), ``action`` text (``"F3"``)."""

    row: str
    start_s: float
    duration_s: float
    category: str
    action: str


def _category(action: str) -> str:
    if action.startswith("SEND"):
        return "send"
    if action.startswith("RECV"):
        return "receive"
    return "forward" if action.startswith("F") else "backward"


def gantt_bars(records: Iterable[Any], slowdown: Optional[Mapping[str, float]] = None) -> List[Bar]:
    """The bars of one step's ``ActionRecord``s (measured, or predicted with islands ``"predicted: x"``).

    Args:
      records: ``parallel.trace.ActionRecord``s (``stage, action, start_s, end_s, island, replica``).
      slowdown: per island name, its emulated slowdown factor ``f >= 1`` (default 1): each F/B record of
        such an island becomes two bars, the computation (``1/f`` of it) and the emulated wait.
    Returns:
      bars sorted by row then start; rows are ``"r{replica} {island} s{stage}"``. A forward whose next
      action on its row is the backward of the same microbatch (only a last stage has no send between
      them) is the runtime's fused forward+backward: category :data:`FUSED`.
    """
    recs = list(records)
    slowdown = slowdown or {}
    t0 = min((r.start_s for r in recs), default=0.0)
    bars: List[Bar] = []
    row_of = lambda r: f"r{r.replica} {_base(r.island or '')} s{r.stage}".replace("  ", " ")
    fused = set()
    by_row: Dict[str, List[Any]] = {}
    for r in recs:
        by_row.setdefault(row_of(r), []).append(r)
    for rs in by_row.values():
        rs.sort(key=lambda r: r.start_s)
        fused |= {id(a) for a, b in zip(rs, rs[1:])
                  if a.action.startswith("F") and b.action.startswith("B") and a.action[1:] == b.action[1:]}
    for r in recs:
        base = _base(r.island or "")
        row = row_of(r)
        cat, start, dur = _category(r.action), r.start_s - t0, max(0.0, r.end_s - r.start_s)
        if id(r) in fused:
            cat = FUSED
        f = float(slowdown.get(base, 1.0))
        if cat in ("forward", "backward", FUSED) and f > 1:
            bars.append(Bar(row, start, dur / f, cat, r.action))
            bars.append(Bar(row, start + dur / f, dur - dur / f, "emulated wait", r.action))
        else:
            bars.append(Bar(row, start, dur, cat, r.action))
    return sorted(bars, key=lambda b: (b.row, b.start_s))


def _base(island: str) -> str:
    return island[len(_PREDICTED_PREFIX):] if island.startswith(_PREDICTED_PREFIX) else island


def panel_title(label: str, title: str, pipeline_s: float, step_s: Optional[float] = None) -> str:
    """``"MEASURED: step 20, pipeline 1256 ms of step 1.41 s"``; without ``step_s``: ``"..., pipeline
    1256 ms (pipeline actions only; gradient all-reduce and update not drawn)"``. Seconds in, text out."""
    head = f"{label}: {title}, pipeline {pipeline_s * 1e3:.4g} ms"
    if step_s is not None and step_s > 0:
        return f"{head} of step {step_s:.3g} s"
    return f"{head} (pipeline actions only; gradient all-reduce and update not drawn)"


def _draw(ax: Any, bars: List[Bar], rows: List[str], title: str) -> int:
    """Draw ``bars`` on ``ax`` (one ``broken_barh`` call per bar); returns the number drawn."""
    n = 0
    for b in bars:
        y = rows.index(b.row)
        ax.broken_barh([(b.start_s * 1e3, max(b.duration_s * 1e3, 1e-3))], (y - 0.4, 0.8),
                       facecolors=COLOURS[b.category], edgecolor="black", linewidth=0.2)
        n += 1
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return n


def write_timeline_png(path: str, measured: Iterable[Any], predicted: Optional[Iterable[Any]] = None, *,
                       slowdown: Optional[Mapping[str, float]] = None, title: str = "one training step",
                       step_s: Optional[Mapping[str, Optional[float]]] = None,
                       dpi: int = 110) -> Dict[str, List[Bar]]:
    """Write the Gantt chart PNG of one measured step (and the PREDICTED step of the same plan below it).

    Args:
      path: the PNG to write (its directory is created).
      measured: the step's ``ActionRecord``s (``StepResult.records``); predicted: PREDICTED records or None.
      slowdown: per island, its emulated slowdown (see :func:`gantt_bars`).
      step_s: ``{"measured": seconds, "predicted": seconds}``, the whole steps' times (pipeline,
        all-reduce and update) for the panel titles (:func:`panel_title`); missing: not known.
    Returns:
      ``{"measured": bars, "predicted": bars}``: exactly the bars drawn (one ``broken_barh`` each).
    Raises:
      ImportError: matplotlib is not installed (it is a dependency of hethub-jax).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    out = {"measured": gantt_bars(measured, slowdown),
           "predicted": gantt_bars(predicted, slowdown) if predicted is not None else []}
    panels = [(k, v) for k, v in out.items() if v or k == "measured"]
    rows = sorted({b.row for _, v in panels for b in v})
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.9 * len(rows) * len(panels)), sharex=True,
                             squeeze=False)
    for ax, (kind, bars) in zip(axes[:, 0], panels):
        span = max((b.start_s + b.duration_s for b in bars), default=0.0)
        label = "MEASURED" if kind == "measured" else "PREDICTED"
        _draw(ax, bars, rows, panel_title(label, title, span, (step_s or {}).get(kind)))
    axes[-1, 0].set_xlabel("ms from the step's first action")
    fig.legend(handles=[Patch(color=COLOURS[c], label=c) for c in CATEGORIES], loc="upper center",
               ncol=len(CATEGORIES), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return out
