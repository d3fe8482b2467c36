"""The training loop's state and hooks (used by ``hethub_jax.train``; docs/training.md).

The loop (``hethub_jax.train._train_loop``) runs one optimizer step, records its outcome in a
:class:`TrainState`, then calls every hook's ``on_step(state)``; after the last step it calls every
hook's ``on_end(state)`` (and ``on_start(state)`` once before the first step). Hooks run in the order
of their list (``hethub_jax.train._build_hooks``), so a hook sees what the hooks before it wrote into
the state: :class:`EvalHook` comes first (the others report ``val_loss``), :class:`CheckpointHook`
before :class:`MetricsHook` and :class:`ConsoleHook` (they report the final checkpoint's path).

A step whose loss is not finite ends the run: the hooks still see it (the metrics record is written),
but :class:`CheckpointHook`, :class:`ProgressHook` and :class:`ConsoleHook` skip it
(``state.finite`` is False), then the loop stops with exit status 1.

This module imports no JAX: the hooks call what they are given (the runtime's ``eval_loss``, the
checkpoint module, an open metrics file).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Protocol, Sequence

from tqdm import tqdm

__all__ = ["TrainState", "Hook", "Console", "PlainLinesBar", "MetricsWriter", "EvalHook", "CheckpointHook", "TraceHook",
           "MetricsHook", "ProgressHook", "ConsoleHook", "fmt_rate", "step_time_text", "predicted_text", "val_loss_text"]


@dataclasses.dataclass
class TrainState:
    """What the hooks see of the run. The loop fills the step fields after each optimizer step.

    Attributes:
      start_step: steps done before this run (0, or the resumed checkpoint's step).
      total_steps: ``train.steps``: the run ends after this step.
      t_start: ``time.perf_counter()`` (seconds) when the loop started.
      step: the last completed optimizer step (``start_step`` before the first).
      loss: its mean token cross-entropy over the global batch, nats (nan before the first step).
      grad_norm: global L2 norm of its gradient before clipping.
      lr: the learning rate it used.
      num_tokens: non-pad (loss_mask 1) tokens of its global batch.
      step_time_s: its wall time on this rank, seconds.
      tokens_per_s: ``num_tokens / step_time_s`` (nan if the time is 0).
      wall_s: seconds from ``t_start`` to the end of the step (after the loop: to the end of the loop).
      records: this rank's action records (``hethub_jax.parallel.trace.ActionRecord``) of the step.
      bubble: its MEASURED bubble fraction over all stages (``StepResult.bubble``; None if not measured).
      evaluated: whether ``val_loss`` was computed at this step (or, before the first step, at step 0).
      val_loss: the newest validation loss, nats (None before any evaluation).
      val_loss_step: the step ``val_loss`` was computed at (0: before training; None before any).
      first_val_loss: the validation loss at step 0 (None without ``train.eval_at_start``).
      timed_tokens, timed_seconds: tokens and step seconds summed over the steps after this run's
        first one (which includes compilation).
      timed_step_times: the step times (seconds) of those steps, in order.
      extra: fields a hook placed before :class:`MetricsHook` adds to this step's metrics record
        (cleared at every step).
      checkpoint_path: the final checkpoint's directory, set by :class:`CheckpointHook` at the end.
      status: 0, or 1 after a non-finite loss.
    """

    start_step: int
    total_steps: int
    t_start: float
    step: int = 0
    loss: float = math.nan
    grad_norm: float = math.nan
    lr: float = math.nan
    num_tokens: int = 0
    step_time_s: float = math.nan
    tokens_per_s: float = math.nan
    wall_s: float = 0.0
    records: list = dataclasses.field(default_factory=list)
    bubble: float | None = None
    evaluated: bool = False
    val_loss: float | None = None
    val_loss_step: int | None = None
    first_val_loss: float | None = None
    timed_tokens: float = 0.0
    timed_seconds: float = 0.0
    timed_step_times: list = dataclasses.field(default_factory=list)
    extra: dict = dataclasses.field(default_factory=dict)
    checkpoint_path: Any = None
    status: int = 0

    def record_step(self, step: int, result: Any, lr: float) -> None:
        """Take in the outcome of optimizer step ``step`` (a ``runtime.StepResult``)."""
        self.step, self.loss, self.grad_norm, self.lr = step, result.loss, result.grad_norm, lr
        self.num_tokens, self.step_time_s = result.num_tokens, result.step_time_s
        self.records = result.records
        self.bubble = getattr(result, "bubble", None)
        self.tokens_per_s = result.num_tokens / result.step_time_s if result.step_time_s > 0 else math.nan
        if step > self.start_step + 1:  # the first step includes compilation
            self.timed_tokens += result.num_tokens
            self.timed_seconds += result.step_time_s
            self.timed_step_times.append(result.step_time_s)
        self.wall_s = time.perf_counter() - self.t_start
        self.evaluated = False
        self.extra = {}

    @property
    def finite(self) -> bool:
        """Whether the last step's loss is finite (the run goes on)."""
        return math.isfinite(self.loss)

    @property
    def first_step(self) -> bool:
        """Whether the last step is this run's first (its time includes compilation)."""
        return self.step == self.start_step + 1

    @property
    def median_step_time_s(self) -> float | None:
        """Median step time (seconds) of the steps after this run's first; None before the second step."""
        return statistics.median(self.timed_step_times) if self.timed_step_times else None

    @property
    def mean_tokens_per_s(self) -> float | None:
        """Tokens/s over the steps after this run's first one; None if there were none."""
        return self.timed_tokens / self.timed_seconds if self.timed_seconds > 0 else None


class Hook(Protocol):
    """Something the loop calls: once before the first step, after every step, once at the end."""

    def on_start(self, state: TrainState) -> None: ...

    def on_step(self, state: TrainState) -> None: ...

    def on_end(self, state: TrainState) -> None: ...


class _NoOp:
    """Base class: every call does nothing (a hook overrides the calls it needs)."""

    def on_start(self, state: TrainState) -> None:
        pass

    def on_step(self, state: TrainState) -> None:
        pass

    def on_end(self, state: TrainState) -> None:
        pass


def fmt_rate(x: float) -> str:
    """``12345.6`` -> ``"12.3k"``; below 1000 a whole number."""
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def step_time_text(state: "TrainState") -> str:
    """The last step's MEASURED time with the median of the steps after the first, labelled, as the
    progress line and the step lines show it: ``"step 1.23 s (median 1.20 s)"``; the run's first step:
    ``"step 9.87 s (includes compilation)"``. Seconds, 3 significant digits."""
    med = state.median_step_time_s
    if state.first_step or med is None:
        return f"step {state.step_time_s:.3g} s (includes compilation)"
    return f"step {state.step_time_s:.3g} s (median {med:.3g} s)"


def predicted_text(state: "TrainState") -> str:
    """``"PREDICTED 0.459 s (PREDICTED/measured 0.65)"``: the PREDICTED step time and its ratio to the
    MEASURED median step time of the steps after the first (no ratio at the first step, whose time
    includes compilation), from the fields :class:`hethub_jax.train_insight.PredictionHook` placed in
    ``state.extra``; "" without a prediction."""
    p = state.extra.get("predicted_step_time_s")
    if p is None:
        return ""
    med = state.median_step_time_s
    return f"PREDICTED {p:.3g} s" + (f" (PREDICTED/measured {p / med:.2f})" if med else "")


def val_loss_text(state: "TrainState") -> str:
    """``"val_loss 5.7812 (step 200)"``: the newest validation loss with the step it was computed at."""
    return f"val_loss {state.val_loss:.4f} (step {state.val_loss_step})"


# ---------------------------------------------------------------------------------------------------
# output channels

class Console:
    """Text output of the logging rank: lines on stdout, and progress on stderr if ``progress``. On other
    ranks every call does nothing.

    Progress is a tqdm bar redrawn in place when stderr is a terminal (``mode="bar"``; lines then go
    through ``tqdm.write`` so that they do not break it), else (``mode="lines"``: a log file, a pipe, every
    rank under ``mpiexec``) a :class:`PlainLinesBar`, one plain progress line every ``line_interval_s``
    seconds and no carriage returns. ``mode="auto"`` chooses by ``sys.stderr.isatty()``. The ETA counts
    only steps after the first (which includes compilation): see :meth:`restart_clock`.
    """

    #: the redrawn bar: tqdm's default without its unlabelled rate (the postfix labels the step time)
    BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"

    def __init__(self, log: bool, progress: bool, total: int, initial: int, mode: str = "auto",
                 line_interval_s: float = 30.0):
        if mode not in ("auto", "bar", "lines"):
            raise ValueError(f"progress mode must be auto, bar or lines, got {mode!r}")
        self.log = log
        self.bar = None
        self.lines = (mode == "lines") or (mode == "auto" and not sys.stderr.isatty())
        if log and progress:
            if self.lines:
                self.bar = PlainLinesBar(total=total, initial=initial, unit="step", file=sys.stderr,
                                         mininterval=line_interval_s, miniters=1, smoothing=0.1, desc="train",
                                         leave=False, bar_format=PlainLinesBar.FORMAT)
            else:
                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                                mininterval=0.5, smoothing=0.1, desc="train", bar_format=self.BAR_FORMAT)

    def say(self, msg: str) -> None:
        if not self.log:
            return
        if self.bar is not None and not self.lines:
            self.bar.write(msg, file=sys.stdout)
        else:
            print(msg, flush=True)

    def restart_clock(self, advance: int = 0) -> None:
        """Advance the bar by ``advance`` steps and restart its clock and rate averages there (tqdm's
        ``reset``, keeping the count), so that its rate and ETA leave out the time so far. Used for the
        run's first step, which includes compilation (and the step-0 evaluation): the ETA shows ``?``
        until the next step, and the bar's elapsed time counts from the end of the first step."""
        bar = self.bar
        if bar is None:
            return
        n = bar.n + advance
        bar.quiet = True  # no line for the momentary count of 0 (PlainLinesBar)
        bar.reset(total=bar.total)
        bar.quiet = False
        bar.n = bar.last_print_n = bar.initial = n
        bar.refresh()

    def close(self) -> None:
        """Close the progress bar (in lines mode after a last line); later lines are printed directly."""
        if self.bar is not None:
            if self.lines and self.bar.n != self.bar.last_print_n:
                self.bar.refresh()
            self.bar.close()
            self.bar = None


class PlainLinesBar(tqdm):
    """A tqdm progress bar that writes one plain line per refresh (``display``, tqdm's override point for
    other front ends) instead of redrawing one line with carriage returns: readable in a log file or
    through ``mpiexec``'s pipes. ``FORMAT``: steps, percentage, ETA and postfix (which labels the step
    time: :class:`ProgressHook`), no bar and no unlabelled tqdm rate."""

    FORMAT = "{desc}: {n_fmt}/{total_fmt} steps ({percentage:.0f}%), ETA {remaining}{postfix}"
    quiet = False  # True: display nothing (Console.restart_clock)

    def display(self, msg=None, pos=None):
        if msg == "" or self.quiet:  # tqdm clearing its line (close): nothing drawn, so no "\r" after
            return False
        self.fp.write((str(self) if msg is None else msg) + "\n")
        self.fp.flush()
        return True

    def clear(self, nolock=False):
        pass


class MetricsWriter:
    """JSON-lines writer: one record per line, flushed after each line (a crash loses at most the
    line being written). ``path=None`` writes nothing (metrics off, or not the logging rank)."""

    def __init__(self, path: str | None, append: bool):
        self.f = None
        if path is not None:
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            self.f = open(path, "a" if append else "w", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record, default=_json_default) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


# ---------------------------------------------------------------------------------------------------
# hooks

class EvalHook(_NoOp):
    """Validation loss: at step 0 if ``at_start`` (and the run starts at step 0), every ``every``
    steps, and at the last step. Sets ``state.val_loss`` and ``state.evaluated``.

    Args:
      eval_loss: ``batch -> (summed loss, token count)`` (``PipelineRuntime.eval_loss``).
      batches: the validation batches (the same ones at every evaluation).
    """

    def __init__(self, eval_loss: Callable[[Any], tuple[float, float]], batches: Iterable[Any],
                 every: int, at_start: bool):
        self.eval_loss, self.batches = eval_loss, list(batches)
        self.every, self.at_start = every, at_start

    def evaluate(self) -> float:
        """Token-weighted mean loss over the validation batches, nats."""
        s = n = 0.0
        for b in self.batches:
            ls, c = self.eval_loss(b)
            s, n = s + ls, n + c
        return s / n

    def on_start(self, state: TrainState) -> None:
        if self.at_start and state.start_step == 0:
            state.val_loss = state.first_val_loss = self.evaluate()
            state.val_loss_step, state.evaluated = 0, True

    def on_step(self, state: TrainState) -> None:
        if state.step % self.every == 0 or state.step == state.total_steps:
            state.val_loss = self.evaluate()
            state.val_loss_step, state.evaluated = state.step, True


class CheckpointHook(_NoOp):
    """Orbax checkpoints (every rank saves its own state): every ``every`` steps (0: never) before the
    last, and after the last step if the run ended well (``state.checkpoint_path``).

    Args:
      save: ``step -> directory of the checkpoint`` (``hethub_jax.train._save_checkpoint``).
      wait: called at the end, after the final save: waits for asynchronous saves to be on disk.
    """

    def __init__(self, save: Callable[[int], Any], every: int | None, wait: Callable[[], Any] | None = None):
        self.save, self.every, self.wait = save, every, wait

    def on_step(self, state: TrainState) -> None:
        if state.finite and self.every and state.step % self.every == 0 and state.step != state.total_steps:
            self.save(state.step)

    def on_end(self, state: TrainState) -> None:
        if state.status == 0:
            state.checkpoint_path = self.save(state.total_steps)
        if self.wait is not None:
            self.wait()  # asynchronous saves: finished (or their error raised) before the run ends


class TraceHook(_NoOp):
    """At the end: the last step's action records as a Chrome trace (``train.trace_file``), with the
    PREDICTED step of the same plan in its own process groups (labelled PREDICTED) when ``predicted``
    (``offset_s -> ActionRecords``, ``train_predict.RunPrediction.records``) is given."""

    def __init__(self, path: str, predicted: Callable[[float], list] | None = None):
        self.path, self.predicted = path, predicted

    def on_end(self, state: TrainState) -> None:
        if state.records:
            from hethub_jax.parallel.trace import to_chrome_trace
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            t0 = min(r.start_s for r in state.records)
            to_chrome_trace(state.records, self.path,
                            predicted=self.predicted(t0) if self.predicted is not None else None)


class MetricsHook(_NoOp):
    """The metrics file's ``eval`` (step 0), ``step`` and ``end`` records (field units in
    docs/training.md). The ``run`` record is written by whoever opens the writer."""

    def __init__(self, writer: MetricsWriter, emulated: bool, trace_file: str | None):
        self.writer, self.emulated, self.trace_file = writer, emulated, trace_file

    def on_start(self, state: TrainState) -> None:
        if state.evaluated:
            self.writer.write({"kind": "eval", "step": 0, "val_loss": state.val_loss,
                               "wall_s": time.perf_counter() - state.t_start})

    def on_step(self, state: TrainState) -> None:
        rec = {"kind": "step", "step": state.step, "loss": state.loss, "tokens_per_s": state.tokens_per_s,
               "step_time_s": state.step_time_s, "grad_norm": state.grad_norm, "lr": state.lr,
               "num_tokens": state.num_tokens, "wall_s": state.wall_s}
        if self.emulated:
            rec["emulated"] = True
        if state.evaluated:
            rec["val_loss"] = state.val_loss
        if state.bubble is not None:
            rec["measured_bubble"] = state.bubble
        rec.update(state.extra)
        self.writer.write(rec)

    def on_end(self, state: TrainState) -> None:
        path = state.checkpoint_path
        self.writer.write({
            "kind": "end", "status": "ok" if state.status == 0 else "non-finite loss",
            "steps": state.total_steps, "final_loss": state.loss, "first_val_loss": state.first_val_loss,
            "final_val_loss": state.val_loss, "wall_s": state.wall_s,
            "mean_tokens_per_s_after_first_step": state.mean_tokens_per_s, "emulated": self.emulated,
            "checkpoint": str(path) if path else None, "trace_file": self.trace_file})
        self.writer.close()


class ProgressHook(_NoOp):
    """Advances the progress bar by one step, showing (labelled) loss, tokens/s, the step time
    (:func:`step_time_text`), the PREDICTED one (:func:`predicted_text`) and the newest val_loss with its
    step (:func:`val_loss_text`), e.g. ``train: 60/200 steps (30%), ETA 02:31, loss 6.012, 1.4k tokens/s,
    step 1.12 s (median 1.10 s), PREDICTED 0.491 s (PREDICTED/measured 0.45), val_loss 6.2210 (step 50)``.
    After the run's first step (which includes compilation) it restarts the bar's clock
    (``Console.restart_clock``) so that the ETA comes from steady-state steps only."""

    def __init__(self, console: Console, emulated: bool = False):
        self.console, self.bar = console, console.bar
        self.emu = " EMULATED" if emulated else ""

    def on_step(self, state: TrainState) -> None:
        if not state.finite:
            return
        post = [f"loss {state.loss:.3f}", f"{fmt_rate(state.tokens_per_s)} tokens/s{self.emu}", step_time_text(state),
                predicted_text(state)]
        if state.val_loss is not None:
            post.append(val_loss_text(state))
        self.bar.set_postfix_str(", ".join(x for x in post if x), refresh=False)
        if state.step == state.start_step + 1:
            self.console.restart_clock(advance=1)
        else:
            self.bar.update(1)


class ConsoleHook(_NoOp):
    """Text lines: the step-0 validation loss, a line at every evaluation and every ``log_every``
    steps (0: only at evaluations), and the summary at the end. A step line, e.g. ``step 50/200: loss
    6.0123, val_loss 6.2210 (step 50), 1.4k tokens/s (EMULATED), step 1.12 s (median 1.10 s), PREDICTED
    0.491 s (PREDICTED/measured 0.45), grad_norm 0.912, lr 2.91e-03``: val_loss only on evaluation
    steps, PREDICTED only when the run has a prediction."""

    def __init__(self, console: Console, log_every: int | None, emulated: bool,
                 outputs: Sequence[tuple[str, str | None]] = ()):
        self.console, self.log_every = console, log_every
        self.emu = " (EMULATED)" if emulated else ""
        self.outputs = list(outputs)

    def on_start(self, state: TrainState) -> None:
        if state.evaluated:
            self.console.say(f"step 0: val_loss {state.val_loss:.4f}")

    def on_step(self, state: TrainState) -> None:
        if not state.finite:
            return
        if state.evaluated or (self.log_every and state.step % self.log_every == 0):
            pred = predicted_text(state)
            self.console.say(f"step {state.step}/{state.total_steps}: loss {state.loss:.4f}"
                             + (f", {val_loss_text(state)}" if state.evaluated else "")
                             + f", {fmt_rate(state.tokens_per_s)} tokens/s{self.emu}, {step_time_text(state)}"
                             + (f", {pred}" if pred else "")
                             + f", grad_norm {state.grad_norm:.3f}, lr {state.lr:.2e}")

    def on_end(self, state: TrainState) -> None:
        summary = f"done in {state.wall_s:.1f} s: loss {state.loss:.4f}"
        if state.val_loss is not None:
            first = state.first_val_loss
            summary += f", val_loss {state.val_loss:.4f}" + (f" (from {first:.4f})" if first else "")
        if state.mean_tokens_per_s:
            summary += f", {fmt_rate(state.mean_tokens_per_s)} tokens/s after the first step{self.emu}"
        self.console.say(summary)
        if state.checkpoint_path:
            self.console.say(f"checkpoint: {state.checkpoint_path}")
        line = outputs_line(self.outputs)
        if line:
            self.console.say(line)


def outputs_line(outputs: Sequence[tuple[str, str | None]]) -> str | None:
    """``"outputs: metrics runs/tiny/metrics.jsonl; plan ...; trace ...; ..."``: every ``(label, path)``
    whose path exists at the end of the run (written by it or kept from before: checkpoints), in the
    given order, each path as given (the training entry point passes them as the user gave them, or
    derived from one as given: relative stays relative); None when there is none."""
    have = [f"{label} {path}" for label, path in outputs if path and os.path.exists(path)]
    return f"outputs: {'; '.join(have)}" if have else None
