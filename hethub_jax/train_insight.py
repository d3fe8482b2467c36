"""Training-loop hooks that compare the run with its prediction and show it in people's tools (issue 17).

Used by ``hethub_jax.train._build_hooks`` beside the hooks of ``hethub_jax.train_hooks`` (same protocol:
``on_start`` / ``on_step`` / ``on_end`` with a ``TrainState``):

* :class:`PredictionHook`: PREDICTED vs MEASURED step time (and bubble) in every step's metrics record
  (``state.extra``), the progress bar's label (``train (step time 1.12 s measured / 0.491 s PREDICTED)``),
  a text line every ``log_every`` steps and a summary at the end (a ``prediction`` record in the metrics
  file). The first step includes compilation and is left out of the summary and the label.
* :class:`TimelineHook`: at the end, the last step's Gantt chart PNG, measured above PREDICTED
  (``hethub_jax.timeline``).
* :class:`TensorBoardHook`: TensorBoard scalars through ``tensorboardX`` (the ``tensorboard`` extra):
  loss, val_loss, tokens/s, MFU (real accelerators only), predicted and measured step time, bubble.

No JAX import.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable, List, Mapping, Optional

from hethub_jax.train_hooks import Console, MetricsWriter, TrainState, _NoOp

__all__ = ["PredictionHook", "TimelineHook", "TensorBoardHook", "GatherRecordsHook", "TENSORBOARD_MISSING",
           "mfu_inputs", "step_times"]

TENSORBOARD_MISSING = ("--tensorboard needs tensorboardX (not installed): pip install 'hethub-jax[tensorboard]' "
                       "(or pip install tensorboardX)")


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


def step_times(measured_s: float, predicted_s: float) -> str:
    """``"1.12 s measured / 0.491 s PREDICTED"``: a step time (seconds, 3 significant digits) measured and
    PREDICTED side by side, as the progress bar, the step lines and the end summary show them."""
    return f"{measured_s:.3g} s measured / {predicted_s:.3g} s PREDICTED"


class PredictionHook(_NoOp):
    """PREDICTED vs MEASURED step time of the run's plan.

    Adds to each step's metrics record: ``predicted_step_time_s``, ``measured_step_time_s``,
    ``predicted_over_measured``, ``predicted_tokens_per_s`` (``predictor.compare_step``),
    ``predicted_bubble`` and ``measured_bubble`` (this rank's stages, ``train_predict.measured_bubble``).

    Args:
      pred: ``train_predict.RunPrediction``; writer: the metrics file (for the end's ``prediction`` record).
      console: text output; log_every: a comparison line every this many steps (0: only at the end).
    """

    def __init__(self, pred: Any, writer: MetricsWriter, console: Console, log_every: int | None):
        self.pred, self.writer, self.console, self.log_every = pred, writer, console, log_every
        self.measured: List[float] = []

    def on_step(self, state: TrainState) -> None:
        from hethub_jax.planner.predictor import compare_step
        from hethub_jax.train_predict import measured_bubble
        if not state.step_time_s > 0:
            return
        _, m = compare_step(self.pred.prediction, state.step_time_s)
        state.extra.update(m, predicted_bubble=self.pred.bubble_fraction,
                           measured_bubble=measured_bubble(state.records))
        first = state.step == state.start_step + 1
        text = step_times(state.step_time_s, m["predicted_step_time_s"])
        if not first:
            self.measured.append(state.step_time_s)
            if self.console.bar is not None:  # the progress bar shows it as it goes
                self.console.bar.set_description_str(f"train (step time {text})", refresh=False)
        if self.log_every and state.step % self.log_every == 0:
            self.console.say(f"step {state.step}/{state.total_steps}: step time {text} (predicted/measured "
                             f"{m['predicted_over_measured']:.2f})" + (" [includes compilation]" if first else ""))

    def summary(self) -> Optional[dict]:
        """Median MEASURED step time after the first step against the PREDICTED one; None before 2 steps."""
        if not self.measured:
            return None
        med, p = statistics.median(self.measured), self.pred.prediction.step_time_s
        return {"kind": "prediction", "predicted_step_time_s": p, "median_measured_step_time_s": med,
                "steps": len(self.measured), "prediction_error": abs(p - med) / med,
                "predicted_over_measured": p / med, "source": self.pred.source}

    def on_end(self, state: TrainState) -> None:
        s = self.summary()
        if s is None:
            return
        self.writer.write(s)
        self.console.say(f"step time (median of {s['steps']} step(s) after the first): "
                         f"{step_times(s['median_measured_step_time_s'], s['predicted_step_time_s'])} (error "
                         f"{100 * s['prediction_error']:.1f}%; prediction from {self.pred.source})")


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
    """

    def __init__(self, path: str, slowdown: Mapping[str, float], predicted: Optional[Callable[[float], list]],
                 console: Console):
        self.path, self.slowdown, self.predicted, self.console = path, dict(slowdown), predicted, console
        self.bars: Optional[dict] = None

    def on_end(self, state: TrainState) -> None:
        if not state.records:
            return
        from hethub_jax.timeline import write_timeline_png
        pred = self.predicted(0.0) if self.predicted else None
        self.bars = write_timeline_png(self.path, state.records, pred, slowdown=self.slowdown,
                                       title=f"step {state.step}")
        self.console.say(f"timeline of step {state.step} (measured" + (" and PREDICTED" if pred else "")
                         + f"): {self.path}")


class TensorBoardHook(_NoOp):
    """TensorBoard scalars (``tensorboardX.SummaryWriter``), one point per step:
    ``train/loss``, ``train/tokens_per_s``, ``eval/val_loss`` (at evaluations), ``perf/step_time_s``
    (MEASURED), ``perf/predicted_step_time_s``, ``perf/bubble`` and ``perf/predicted_bubble`` (from the
    fields a :class:`PredictionHook` placed before it adds), and ``perf/mfu`` when ``flops_per_token``
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
                         ("measured_bubble", "perf/bubble"), ("predicted_bubble", "perf/predicted_bubble")):
            if state.extra.get(key) is not None:
                add(tag, state.extra[key], s)
        if state.evaluated and state.val_loss is not None:
            add("eval/val_loss", state.val_loss, s)

    def on_end(self, state: TrainState) -> None:
        self.w.flush()
        self.w.close()
