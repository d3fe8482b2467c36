"""Plan-independent checkpoints (issue 16 part 1): resume under the same plan is bitwise equal to an
uninterrupted run; resume under another split, another number of islands, other DP/TP and on a single
device equals it within float32 tolerance; a corrupt newest checkpoint falls back to the previous
one; SIGKILL during a save leaves the last complete checkpoint loadable; metrics never hold two
records of one step.

The reference is the uninterrupted run of the same config (4 steps, a checkpoint every 2 steps);
every other run resumes from its step-2 checkpoint. Tiny model: 3 layers, width 32, 16-token samples,
all islands in this process (docs/training.md).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hethub_jax import checkpoint as ckpt
from hethub_jax.train import main

LAYERS = 3
CONFIG = f"""
model: {{preset: tiny, hidden_size: 32, intermediate_size: 64, num_hidden_layers: {LAYERS},
        num_attention_heads: 2, num_key_value_heads: 1}}
data: {{seq_len: 16}}
optim: {{warmup_steps: 1, learning_rate: 1.0e-2}}
train: {{steps: 4, global_batch_size: 8, microbatch_size: 2, checkpoint_every: 2, eval_every: 100,
        eval_at_start: false, eval_batches: 1, log_every: 0}}
"""


def _plan(path: Path, islands: list[tuple[str, int]], replicas: list[list[tuple[str, int, int, int, int]]]) -> Path:
    """islands: (name, devices); replicas: stages (island, first, last, dp, tp)."""
    path.write_text(json.dumps({
        "islands": [{"name": n, "platform": "cpu", "num_processes": 1, "devices_per_process": d}
                    for n, d in islands],
        "replicas": [{"stages": [{"island": i, "first_layer": f, "last_layer": la, "dp": dp, "tp": tp}
                                 for i, f, la, dp, tp in stages]} for stages in replicas],
        "global_batch_size": 8, "microbatch_size": 2, "schedule": "1f1b", "recompute": "none"}))
    return path


def _losses(metrics: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in recs if r["kind"] == "step"]
    assert len(steps) == len(set(steps)), f"two records of one step: {steps}"
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "step"}


def _train(d: Path, *extra: str) -> tuple[int, str]:
    import contextlib
    import io
    cfg = d / "c.yaml"
    cfg.write_text(CONFIG)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["--config", str(cfg), "--metrics-file", str(d / "m.jsonl"), "--checkpoint-dir",
                   str(d / "ckpt"), "--no-progress", *extra])
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run under a 2-island plan (layer 0 on `a`, layers 1-2 on `b` with TP 2)."""
    d = tmp_path_factory.mktemp("straight")
    plan = _plan(d / "plan.json", [("a", 1), ("b", 2)], [[("a", 0, 0, 1, 1), ("b", 1, 2, 1, 2)]])
    rc, err = _train(d, "--plan", str(plan))
    assert rc == 0, err
    assert ckpt.complete_steps(d / "ckpt", LAYERS) == [4, 2]
    return {"dir": d, "plan": plan, "losses": _losses(d / "m.jsonl")}


def _resume_from_step2(straight, tmp_path: Path, plan_args: list[str]) -> dict[int, float]:
    d = tmp_path
    shutil.copytree(straight["dir"] / "ckpt" / "step_2", d / "ckpt" / "step_2")
    metrics = d / "m.jsonl"  # the interrupted run's metrics up to step 3 (step 3 must be superseded)
    lines = (straight["dir"] / "m.jsonl").read_text().splitlines()
    metrics.write_text("".join(line + "\n" for line in lines
                               if json.loads(line).get("step", 0) <= 3 and json.loads(line)["kind"] != "end"))
    rc, err = _train(d, "--resume", *plan_args)
    assert rc == 0, err
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r for r in recs if r["kind"] == "superseded"][0]["record"]["step"] == 3
    assert [r for r in recs if r["kind"] == "run"][-1]["resumed_from"]["step"] == 2
    return _losses(metrics)


def test_resume_same_plan_is_bitwise_equal(straight, tmp_path):
    got = _resume_from_step2(straight, tmp_path, ["--plan", str(straight["plan"])])
    assert sorted(got) == [1, 2, 3, 4]
    for s in (3, 4):
        assert got[s] == straight["losses"][s], (s, got[s], straight["losses"][s])


@pytest.mark.parametrize("layout", ["single_device", "three_islands_dp2", "other_split_tp", "hetero_dp_zero1"])
def test_resume_under_another_plan_matches(straight, tmp_path, layout):
    if layout == "single_device":
        args = []                                              # built-in plan: one stage, one device
    elif layout == "hetero_dp_zero1":  # two data-parallel replicas, the update sharded (optimizer_sharding auto)
        args = ["--plan", str(_plan(tmp_path / "p.json", [("x", 1), ("y", 1)],
                                    [[("x", 0, 2, 1, 1)], [("y", 0, 2, 1, 1)]]))]
    elif layout == "three_islands_dp2":
        args = ["--plan", str(_plan(tmp_path / "p.json", [("x", 2), ("y", 1), ("z", 1)],
                                    [[("x", 0, 0, 2, 1), ("y", 1, 1, 1, 1), ("z", 2, 2, 1, 1)]]))]
    else:
        args = ["--plan", str(_plan(tmp_path / "p.json", [("a", 2), ("b", 1)],
                                    [[("a", 0, 1, 1, 2), ("b", 2, 2, 1, 1)]]))]
    got = _resume_from_step2(straight, tmp_path, args)
    for s in (3, 4):
        np.testing.assert_allclose(got[s], straight["losses"][s], rtol=2e-5)


def test_resume_without_checkpoint_is_an_error_unless_asked(tmp_path):
    rc, err = _train(tmp_path, "--resume")
    assert rc == 2 and "no complete checkpoint" in err and "--resume-or-start" in err
    assert not (tmp_path / "m.jsonl").exists()


def test_corrupt_newest_checkpoint_falls_back_and_all_corrupt_is_named(straight, tmp_path):
    from hethub_jax.config import load_config
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.runtime import PipelineRuntime

    root = tmp_path / "ckpt"
    shutil.copytree(straight["dir"] / "ckpt", root)
    cfg = load_config(straight["dir"] / "c.yaml")
    plan = Plan.from_json(straight["plan"])
    rt = PipelineRuntime(plan, cfg.model, cfg.optim, seed=1)
    # 64 bytes overwritten in the middle of the largest data file of step 4's embedding
    data = max((p for p in (root / "step_4" / "embed").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        f.write(os.urandom(64))
    warnings = []
    step, _ = ckpt.restore_latest(rt, root, cfg.to_dict(), 8, warn=warnings.append)
    assert step == 2 and len(warnings) == 1 and "step 4" in warnings[0] and "embed" in warnings[0]
    assert all(np.isfinite(v).all() for v in rt.params().values())
    shutil.rmtree(root / "step_2" / "layers.1")
    (root / "step_2" / "layers.1").mkdir()
    with pytest.raises(ckpt.CheckpointCorrupt, match=r"layers\.1"):
        ckpt.restore_latest(rt, root, cfg.to_dict(), 8, warn=warnings.append)


def test_unreadable_newest_meta_falls_back_instead_of_stopping_at_set_up(straight, tmp_path):
    """Set-up checks the newest step whose meta.json reads; resuming then warns and falls back past the
    unreadable one, as it does for a corrupt unit (it stopped the run at set-up before session 14)."""
    shutil.copytree(straight["dir"] / "ckpt", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "step_4" / "meta.json").write_text("{not json")
    rc, err = _train(tmp_path, "--resume", "--plan", str(straight["plan"]))
    assert rc == 0, err
    assert "checkpoint step 4 is corrupt" in err and "step_4/meta.json: unreadable" in err, err
    assert _losses(tmp_path / "m.jsonl")[4] == straight["losses"][4]


def test_every_checkpoint_corrupt_without_asking_to_resume_says_how_to_start_over(straight, tmp_path):
    """train.resume null (the default) resumed because checkpoints were there: when all of them are corrupt
    the error says how to start from step 0 instead, as set-up's errors about them do."""
    shutil.copytree(straight["dir"] / "ckpt", tmp_path / "ckpt")
    for step in (2, 4):
        (tmp_path / "ckpt" / f"step_{step}" / "meta.json").write_text("{not json")
    rc, err = _train(tmp_path, "--plan", str(straight["plan"]))
    lines = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2 and len(lines) == 1, err
    assert "every complete checkpoint in" in lines[0] and "step_2/meta.json: unreadable" in lines[0], err
    assert "train.resume is null" in lines[0] and "--no-resume starts from step 0" in lines[0], err


def test_checkpoint_of_another_model_names_the_field(straight, tmp_path):
    shutil.copytree(straight["dir"] / "ckpt", tmp_path / "ckpt")
    rc, err = _train(tmp_path, "--resume", "--set", "model.intermediate_size=96", "--steps", "6")
    assert rc == 2 and "model.intermediate_size is 64 there, 96 here" in err, err


@pytest.mark.slow
def test_sigkill_during_save_leaves_last_complete_checkpoint(tmp_path):
    """A training subprocess checkpointing every step is killed while a save is in flight; the newest
    complete step loads and a resumed run finishes."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.replace("steps: 4", "steps: 40").replace("checkpoint_every: 2", "checkpoint_every: 1"))
    root = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "hethub_jax.train", "--config", str(cfg), "--checkpoint-dir",
                             str(root), "--metrics-file", str(tmp_path / "m.jsonl"), "--no-progress"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            done = ckpt.complete_steps(root, LAYERS)
            in_flight = [p for p in root.glob("step_*/*") if "tmp" in p.name] if root.is_dir() else []
            if done and in_flight:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    done = ckpt.complete_steps(root, LAYERS)
    assert done, "no complete checkpoint before the kill"
    rc, err = _train(tmp_path, "--resume", "--steps", str(done[0] + 1))
    assert rc == 0, err
    assert ckpt.complete_steps(root, LAYERS)[0] == done[0] + 1
