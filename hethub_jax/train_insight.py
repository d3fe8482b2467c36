"""Training-loop hooks that compare the run with its prediction and show it in people's tools (issue 17).

Used by ``hethub_jax.train._build_hooks`` beside the hooks of ``hethub_jax.train_hooks`` (same protocol:
``on_start`` / ``on_step`` / ``on_end`` with a ``TrainState``):

* :class:`PredictionHook`: PREDICTED vs MEASURED step time (and bubble) in every step's metrics record
  (``state.extra``; the progress bar and step lines of ``train_hooks`` show it: ``PREDICTED 0.491 s
  (PREDICTED/measured 0.45)``) and a summary at the end (a ``prediction`` record in the metrics file).
  The first step includes compilation and is left out of the medians.
* :class:`TimelineHook`: at the end, the last step's Gantt chart PNG, measured above PREDICTED
  (``hethub_jax.timeline``).
* :class:`TensorBoardHook`: TensorBoard scalars through ``tensorboardX`` (the ``tensorboard`` extra):
  loss, val_loss, tokens/s, MFU (real accelerators only), predicted and measured step time, their ratio,
  bubble.

No JAX import.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable, List, Mapping, Optional

from hethub_jax.train_hooks import Console, MetricsWriter, TrainState, _NoOp

__all__ = ["PredictionHook", "TimelineHook", "TensorBoardHook", "GatherRecordsHook", "TENSORBOARD_MISSING",
           "mfu_inputs"]

TENSORBOARD_MISSING = ("--tensorboard needs tensorboardX (not installed): pip install '.[tensorboard]' "
                       "from the repository root (or pip install tensorboardX)")


def mfu_inputs(cfg: Any, plan: Any, pred: Any, seq_len: int) -> tuple:
    """``(flops_per_token, peak_flops)`` for MFU, or ``(None, None)`` when MFU would mislead: any cpu or
    emulated island, or a device whose datasheet peak is unknown (profile-only costs).

    flops_per_token: model FLOPs per token of forward + backward without recompute,
    ``3 x (L x layer_flops + head_flops) / tokens`` (``planner.analytic``; backward = 2 x forward:
    Narayanan et al. 2021, section 5.1). peak_flops: sum over the plan's devices of the catalog's dense
    peak FLOP/s (``planner.catalog``)."""
    from hethub_jax.planner import analytic
    from hethub_jax.planner.catalog import mfu_not_applicable
    if pred is None or mfu_not_applicable(plan):
        return None, None
    peak = 0.0
    for isl in plan.islands:
        spec = getattr(pred.costs.get(isl.name), "spec", None)
        if spec is None:
            return None, None
        peak += isl.num_processes * isl.devices_per_process * spec.peak_flops
    fpt = 3.0 * (cfg.num_hidden_layers * analytic.layer_flops(cfg, seq_len, seq_len)
                 + analytic.head_flops(cfg, seq_len)) / seq_len
    return fpt, peak


class PredictionHook(_NoOp):
    """PREDICTED vs MEASURED step time (and bubble) of the run's plan.

    One form of comparison everywhere: the ratio PREDICTED / MEASURED (``predicted_over_measured``:
    below 1 the prediction is too fast, above 1 too slow; ``|ratio - 1|`` is the relative error that
    ``benchmarks/hetero_e2e.py`` reports as ``prediction_error``). Adds to each step's metrics record
    (``predictor.compare_step``): ``predicted_step_time_s``, ``measured_step_time_s``,
    ``predicted_over_measured`` (this step's), ``predicted_tokens_per_s``, and ``predicted_bubble`` (the
    mean over stages, ``RunPrediction.bubble_fraction``; the measured one, ``measured_bubble``, is the
    runtime's ``StepResult.bubble``, same definition: docs/training.md).
    The progress bar and the step lines show them (``train_hooks.predicted_text``: the ratio to the
    median measured step time); the end writes a ``prediction`` record and a summary line. The first
    step includes compilation and is left out of the medians.

    Args:
      pred: ``train_predict.RunPrediction``; writer: the metrics file (for the end's ``prediction`` record).
      console: text output; log_every: accepted for compatibility, unused (the step lines are
        ``train_hooks.ConsoleHook``'s, which show these figures).
    """

    def __init__(self, pred: Any, writer: MetricsWriter, console: Console, log_every: int | None = None):
        self.pred, self.writer, self.console = pred, writer, console
        self.measured: List[float] = []
        self.bubbles: List[float] = []

    def on_step(self, state: TrainState) -> None:
        from hethub_jax.planner.predictor import compare_step
        if not state.step_time_s > 0:
            return
        _, m = compare_step(self.pred.prediction, state.step_time_s)
        state.extra.update(m, predicted_bubble=self.pred.bubble_fraction)
        if not state.first_step:
            self.measured.append(state.step_time_s)
            if state.bubble is not None:
                self.bubbles.append(state.bubble)

    def summary(self) -> Optional[dict]:
        """The ``prediction`` record: median MEASURED step time (and bubble) after the first step against
        the PREDICTED ones; None before 2 steps."""
        if not self.measured:
            return None
        med, p = statistics.median(self.measured), self.pred.prediction.step_time_s
        return {"kind": "prediction", "predicted_step_time_s": p, "median_measured_step_time_s": med,
                "predicted_over_measured": p / med, "steps": len(self.measured),
                "predicted_bubble": self.pred.bubble_fraction,
                "median_measured_bubble": statistics.median(self.bubbles) if self.bubbles else None,
                "source": self.pred.source}

    def on_end(self, state: TrainState) -> None:
        s = self.summary()
        if s is None:
            return
        self.writer.write(s)
        bub = s["median_measured_bubble"]
        self.console.say(
            f"step time: median {s['median_measured_step_time_s']:.3g} s measured ({s['steps']} step(s) after the "
            f"first), PREDICTED {s['predicted_step_time_s']:.3g} s (PREDICTED/measured "
            f"{s['predicted_over_measured']:.2f}); bubble (idle fraction of the pipeline time, mean over stages): "
            + (f"median {100 * bub:.1f}% measured, " if bub is not None else "")
            + f"PREDICTED {100 * s['predicted_bubble']:.1f}%" + one_stage_replicas_note(getattr(self.pred, "plan", None))
            + f"; prediction from {self.pred.source}")


def one_stage_replicas_note(plan: Any) -> str:
    """For a heterogeneous-DP plan whose every replica is one pipeline stage (``plan.num_replicas > 1``, one
    stage each), the clause the end's bubble figure needs: such a plan has no pipeline bubble, so the MEASURED
    figure (``parallel.trace.bubble_from_terms``: idle time against the longest process's pipeline) is the
    replicas' imbalance, a faster replica idling until the slowest ends its backward, before the gradient
    all-reduce; the batch shares are chosen to make it small (the PREDICTED figure: the same wait between the
    PREDICTED replica times). ``""`` for any other plan or
    ``None`` (a new user's question, session 17)."""
    try:
        n = plan.num_replicas if plan is not None else 0
        if n < 2 or any(plan.num_stages(r) != 1 for r in range(n)):
            return ""
    except (AttributeError, TypeError):
        return ""
    return (" (one-stage replicas: no pipeline bubble; the measured figure is the replicas' imbalance, the faster "
            "replica's wait for the slowest before the gradient all-reduce)")


class GatherRecordsHook(_NoOp):
    """Under MPI, at the end: every rank's action records of the last step go to the logging rank (which
    then holds all stages' records in ``state.records`` for the trace and the timeline). Collective: every
    rank of ``comm`` must have this hook. Records are sent as JSON bytes through ``comm.allgather``
    (lengths first, then padded). Times are each rank's ``time.perf_counter()``: comparable between
    processes of one machine (one monotonic clock), shifted between machines."""

    def __init__(self, comm: Any, log: bool):
        self.comm, self.log = comm, log

    def on_end(self, state: TrainState) -> None:
        import dataclasses
        import json

        import numpy as np

        from hethub_jax.parallel.trace import ActionRecord
        mine = json.dumps([dataclasses.asdict(r) for r in state.records]).encode()
        sizes = np.asarray(self.comm.allgather(np.array([len(mine)], np.int64))).reshape(-1)
        buf = np.zeros(int(sizes.max()), np.uint8)
        buf[:len(mine)] = np.frombuffer(mine, np.uint8)
        parts = np.asarray(self.comm.allgather(buf))
        if self.log:
            state.records = [ActionRecord(**d) for p, n in zip(parts, sizes)
                             for d in json.loads(bytes(p[:int(n)]).decode())]


class TimelineHook(_NoOp):
    """At the end: the last step's Gantt chart PNG (``timeline.write_timeline_png``), with the PREDICTED
    step of the same plan below it when ``predicted`` is given.

    Args:
      path: the PNG; slowdown: per island, its emulated slowdown factor.
      predicted: ``offset_s -> PREDICTED ActionRecords`` (``RunPrediction.records``) or None.
      console: where to say that it was written.
      predicted_step_s: the PREDICTED whole step's seconds (for the PREDICTED panel's title), or None.
    """

    def __init__(self, path: str, slowdown: Mapping[str, float], predicted: Optional[Callable[[float], list]],
                 console: Console, predicted_step_s: Optional[float] = None):
        self.path, self.slowdown, self.predicted, self.console = path, dict(slowdown), predicted, console
        self.predicted_step_s = predicted_step_s
        self.bars: Optional[dict] = None

    def on_end(self, state: TrainState) -> None:
        if not state.records:
            return
        from hethub_jax.timeline import write_timeline_png
        pred = self.predicted(0.0) if self.predicted else None
        self.bars = write_timeline_png(self.path, state.records, pred, slowdown=self.slowdown,
                                       title=f"step {state.step}",
                                       step_s={"measured": state.step_time_s, "predicted": self.predicted_step_s})
        self.console.say(f"timeline of step {state.step} (measured" + (" and PREDICTED" if pred else "")
                         + f"): {self.path}")


class TensorBoardHook(_NoOp):
    """TensorBoard scalars (``tensorboardX.SummaryWriter``), one point per step:
    ``train/loss``, ``train/tokens_per_s``, ``eval/val_loss`` (at evaluations), ``perf/step_time_s``
    (MEASURED), ``perf/predicted_step_time_s``, ``perf/predicted_over_measured``, ``perf/bubble`` (MEASURED)
    and ``perf/predicted_bubble`` (``state.bubble`` and the fields :class:`PredictionHook` placed before
    it adds), and ``perf/mfu`` when ``flops_per_token``
    and ``peak_flops`` are given (real accelerators only: never for CPU or emulated islands).

    Args:
      logdir: event file directory; flops_per_token: model FLOPs per token (forward + backward);
      peak_flops: the devices' summed peak FLOP/s (dense, datasheet).
    Raises:
      ImportError: with :data:`TENSORBOARD_MISSING` when tensorboardX is not installed.
    """

    def __init__(self, logdir: str, flops_per_token: Optional[float] = None, peak_flops: Optional[float] = None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError(TENSORBOARD_MISSING) from None
        self.w = SummaryWriter(logdir)
        self.flops_per_token, self.peak = flops_per_token, peak_flops

    def on_start(self, state: TrainState) -> None:
        if state.evaluated and state.val_loss is not None:
            self.w.add_scalar("eval/val_loss", state.val_loss, 0)

    def on_step(self, state: TrainState) -> None:
        s, add = state.step, self.w.add_scalar
        if state.finite:
            add("train/loss", state.loss, s)
        if math.isfinite(state.tokens_per_s):
            add("train/tokens_per_s", state.tokens_per_s, s)
            if self.flops_per_token and self.peak:
                add("perf/mfu", state.tokens_per_s * self.flops_per_token / self.peak, s)
        add("perf/step_time_s", state.step_time_s, s)
        for key, tag in (("predicted_step_time_s", "perf/predicted_step_time_s"),
                         ("predicted_over_measured", "perf/predicted_over_measured"),
                         ("predicted_bubble", "perf/predicted_bubble")):
            if state.extra.get(key) is not None:
                add(tag, state.extra[key], s)
        if state.bubble is not None:
            add("perf/bubble", state.bubble, s)
        if state.evaluated and state.val_loss is not None:
            add("eval/val_loss", state.val_loss, s)

    def on_end(self, state: TrainState) -> None:
        self.w.flush()
        self.w.close()
