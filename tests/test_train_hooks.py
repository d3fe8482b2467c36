"""The training loop's hooks (hethub_jax/train_hooks.py) on their own, without JAX: when they evaluate,
checkpoint and report, against the schedules docs/training.md states. The full loop is covered by
tests/test_train.py and tests/test_train_plan.py."""

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hethub_jax.train_hooks import (CheckpointHook, Console, ConsoleHook, EvalHook, MetricsHook, MetricsWriter,
                                    ProgressHook, TrainState)


def _run(hooks, losses, start_step=0):
    """Drive the hooks as train._train_loop does, with made-up step results (100 tokens, 0.5 s)."""
    state = TrainState(start_step=start_step, total_steps=start_step + len(losses), t_start=0.0, step=start_step)
    for h in hooks:
        h.on_start(state)
    for i, loss in enumerate(losses):
        state.record_step(start_step + i + 1, SimpleNamespace(loss=loss, grad_norm=1.0, num_tokens=100,
                                                               step_time_s=0.5, records=[]), lr=1e-3)
        for h in hooks:
            h.on_step(state)
        if not state.finite:
            state.status = 1
            break
    for h in hooks:
        h.on_end(state)
    return state


def test_eval_schedule_and_token_weighted_mean():
    calls = []

    def eval_loss(batch):
        calls.append(batch)
        return batch * 10.0, 10.0              # summed loss, token count

    ev = EvalHook(eval_loss, [1, 3], every=3, at_start=True)
    seen = []

    class Probe:
        on_start = on_step = lambda self, s: seen.append((s.step, s.evaluated, s.val_loss))
        on_end = lambda self, s: None

    state = _run([ev, Probe()], [5.0] * 7)
    assert [(s, e) for s, e, _ in seen if e] == [(0, True), (3, True), (6, True), (7, True)]
    assert all(v == 2.0 for _, e, v in seen if e)      # (10 + 30) / 20
    assert state.first_val_loss == 2.0 and len(calls) == 2 * 4


def test_checkpoints_every_k_and_at_the_end_only_if_finite():
    saved = []
    hook = CheckpointHook(lambda step: saved.append(step) or f"dir/step_{step}", every=2)
    state = _run([hook], [1.0] * 6)
    assert saved == [2, 4, 6] and state.checkpoint_path == "dir/step_6"   # step 6 once, at the end
    saved.clear()
    state = _run([hook], [1.0, 1.0, math.nan, 1.0])
    assert saved == [2] and state.status == 1 and state.checkpoint_path is None


def test_metrics_records_and_first_step_excluded_from_mean(tmp_path):
    path = tmp_path / "m.jsonl"
    ev = EvalHook(lambda b: (4.0, 2.0), [0], every=2, at_start=True)
    _run([ev, MetricsHook(MetricsWriter(str(path), append=False), emulated=True, trace_file=None)],
         [3.0, 2.0, 1.0], start_step=0)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in recs] == ["eval", "step", "step", "step", "end"]
    step = recs[1]
    assert list(step) == ["kind", "step", "loss", "tokens_per_s", "step_time_s", "grad_norm", "lr", "num_tokens",
                          "wall_s", "emulated"]
    assert step["tokens_per_s"] == 100 / 0.5 and "val_loss" not in step and recs[2]["val_loss"] == 2.0
    end = recs[-1]
    assert end["status"] == "ok" and end["final_loss"] == 1.0 and end["first_val_loss"] == 2.0
    assert end["mean_tokens_per_s_after_first_step"] == (2 * 100) / (2 * 0.5)


def test_console_lines(capsys):
    console = Console(log=True, progress=False, total=4, initial=0)
    _run([ConsoleHook(console, log_every=2, emulated=False)], [4.0, 3.0, 2.0, math.nan])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step 2/4: loss 3.0000, 200 tokens/s, step 0.5 s (median 0.5 s), grad_norm 1.000, lr 1.00e-03"
    assert out[1].startswith("done in ") and "loss nan" in out[1] and len(out) == 2   # step 4 not finite


class _Clock:
    """A stand-in for tqdm's clock (``tqdm.std.time``): seconds advanced by hand."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _progress_lines(monkeypatch, capsys, step_seconds, start_step=0):
    """Drive a lines-mode Console through ProgressHook with the given step times on a fake clock;
    returns the stderr line printed after each step (None if none)."""
    import tqdm.std
    clock = _Clock()
    monkeypatch.setattr(tqdm.std, "time", clock)
    total = start_step + len(step_seconds)
    console = Console(log=True, progress=True, total=total, initial=start_step, mode="lines", line_interval_s=0.0)
    hook = ProgressHook(console)
    state = TrainState(start_step=start_step, total_steps=total, t_start=0.0, step=start_step)
    after = []
    for i, dt in enumerate(step_seconds):
        clock.t += dt
        state.record_step(start_step + i + 1, SimpleNamespace(loss=2.0, grad_norm=1.0, num_tokens=100,
                                                               step_time_s=dt, records=[]), lr=1e-3)
        capsys.readouterr()
        hook.on_step(state)
        lines = capsys.readouterr().err.splitlines()
        after.append(lines[-1] if lines else None)
    console.close()
    return after


@pytest.mark.parametrize("start_step", [0, 7])
def test_progress_eta_leaves_out_the_first_step(monkeypatch, capsys, start_step):
    """The first step of a run includes compilation (here 100 s, then 1 s per step): no ETA right after
    it, then the ETA of the steady steps only (not hours), also when resuming at a later step."""
    after = _progress_lines(monkeypatch, capsys, [100.0] + [1.0] * 99, start_step)
    assert f"{start_step + 1}/{start_step + 100} steps" in after[0] and "ETA ?," in after[0]
    assert f"{start_step + 2}/{start_step + 100} steps" in after[1] and "ETA 01:38," in after[1], after[1]
    assert "ETA 00:49," in after[50] and "step/s" not in after[50] and "s/step" not in after[50]


def test_progress_and_step_lines_label_every_figure(monkeypatch, capsys):
    """One step time per line, labelled (the last step's and the median after the first), the first step
    labelled as compiling, the PREDICTED one as such with its ratio to the median, and val_loss with
    the step it was computed at (not a stale figure passed off as the current one)."""
    import tqdm.std
    monkeypatch.setattr(tqdm.std, "time", _Clock())
    console = Console(log=True, progress=True, total=4, initial=0, mode="lines", line_interval_s=0.0)
    ev = EvalHook(lambda b: (6.0, 2.0), [0], every=2, at_start=True)
    hooks = [ev, ProgressHook(console), ConsoleHook(console, log_every=1, emulated=True)]
    state = TrainState(start_step=0, total_steps=4, t_start=0.0)
    for h in hooks:
        h.on_start(state)
    lines = []
    for step, dt in zip((1, 2, 3, 4), (10.0, 1.0, 2.0, 4.0)):
        state.record_step(step, SimpleNamespace(loss=2.0, grad_norm=1.0, num_tokens=100, step_time_s=dt,
                                                records=[]), lr=1e-3)
        state.extra["predicted_step_time_s"] = 0.5  # as PredictionHook places it
        capsys.readouterr()
        for h in hooks:
            h.on_step(state)
        out, err = capsys.readouterr()
        lines.append((err.splitlines()[-1], out.splitlines()[-1]))
    console.close()
    (bar1, text1), (_, text2), (bar3, text3), (bar4, text4) = lines
    assert "step 10 s (includes compilation), PREDICTED 0.5 s," in bar1 and "PREDICTED/measured" not in bar1
    assert "val_loss 3.0000 (step 0)" in bar1 and "val_loss" not in text1  # no evaluation at step 1
    assert "step 2 s (median 1.5 s), PREDICTED 0.5 s (PREDICTED/measured 0.33)" in bar3
    assert "val_loss 3.0000 (step 2)" in bar3 and "val_loss" not in text3
    assert text2.startswith("step 2/4: loss 2.0000, val_loss 3.0000 (step 2), 100 tokens/s (EMULATED), step 1 s "
                            "(median 1 s), PREDICTED 0.5 s (PREDICTED/measured 0.50), grad_norm")
    assert "step 4 s (median 2 s)" in text4 and "val_loss 3.0000 (step 4)" in bar4
    for bar, _ in lines:
        assert "s/step" not in bar and "step/s" not in bar  # tqdm's unlabelled rate is not shown


def test_progress_lines_mode_writes_whole_lines_without_carriage_returns(monkeypatch, capsys):
    """Not a terminal (a log file, mpiexec's pipes): plain progress lines, never a carriage return, and
    text lines printed between them, each whole."""
    import tqdm.std
    monkeypatch.setattr(tqdm.std, "time", _Clock())
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    console = Console(log=True, progress=True, total=3, initial=0)           # auto: not a tty -> lines
    assert console.lines
    state = TrainState(start_step=0, total_steps=3, t_start=0.0)
    for step in (1, 2, 3):
        state.record_step(step, SimpleNamespace(loss=2.0, grad_norm=1.0, num_tokens=100, step_time_s=1.0,
                                                records=[]), lr=1e-3)
        ProgressHook(console).on_step(state)
        console.say(f"line {step}")
    console.close()
    out, err = capsys.readouterr()
    assert "\r" not in err and "\r" not in out
    assert out.splitlines() == ["line 1", "line 2", "line 3"]
    assert all(x.startswith("train: ") and " steps (" in x for x in err.splitlines()), err
    assert err.splitlines()[-1].startswith("train: 3/3 steps (100%)")


def test_imports_without_jax():
    code = "import sys, hethub_jax.train_hooks; assert 'jax' not in sys.modules, 'jax imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
