"""Training entry point: config validation, CLI precedence, and a real short training run."""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

from hethub_jax.config import ConfigError, from_dict, load_config
from hethub_jax.train import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, text: str, name: str = "c.yaml") -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


# ---- config validation ------------------------------------------------------------------------

@pytest.mark.parametrize("section", ["model", "data", "optim", "train"])
def test_unknown_key_in_each_section_is_named(section):
    raw = {section: {"preset": "tiny", "bogus_key": 1} if section == "model" else {"bogus_key": 1}}
    with pytest.raises(ConfigError, match=rf"unknown key 'bogus_key' in section '{section}'"):
        from_dict(raw)


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match="unknown section 'trian'"):
        from_dict({"trian": {"steps": 3}})


@pytest.mark.parametrize("raw, pattern", [
    ({"train": {"steps": 0}}, r"train\.steps must be an integer >= 1"),
    ({"train": {"steps": 2.5}}, r"train\.steps must be an integer >= 1"),
    ({"train": {"global_batch_size": 10, "microbatch_size": 4}},
     r"train\.global_batch_size must be divisible by train\.microbatch_size: 10 % 4 = 2"),
    ({"train": {"eval_every": 0}}, r"train\.eval_every must be an integer >= 1"),
    ({"train": {"log_every": -1}}, r"train\.log_every must be an integer >= 0"),
    ({"train": {"resume": True, "checkpoint_dir": None}}, r"train\.resume needs train\.checkpoint_dir"),
    ({"train": {"eval_at_start": "yes"}}, r"train\.eval_at_start must be true or false"),
    ({"optim": {"learning_rate": -1.0}}, r"optim\.learning_rate must be > 0"),
    ({"optim": {"learning_rate": "fast"}}, r"optim\.learning_rate must be a finite number"),
    ({"optim": {"min_lr_ratio": 2.0}}, r"optim\.min_lr_ratio must be in \[0, 1\]"),
    ({"data": {"seq_len": 0}}, r"data: .*seq_len"),
    ({"data": {"validation_fraction": 1.5}}, r"data: validation_fraction must be a number in \(0, 1\)"),
    ({"data": {"seq_len": 1024}}, r"data\.seq_len \(1024\) must be <= model\.max_position_embeddings \(512\)"),
    ({"model": "tiny-ish"}, r"model: unknown preset 'tiny-ish'"),
    ({"model": {"preset": "nope"}}, r"model\.preset: unknown preset 'nope'"),
    ({"model": {"preset": "tiny", "num_key_value_heads": 3}},
     r"num_key_value_heads \(3\) must divide num_attention_heads \(4\)"),
    ({"model": {"preset": "tiny", "hidden_size": 66}}, r"num_attention_heads \(4\) must divide hidden_size \(66\)"),
    ({"model": 7}, r"model must be a preset name or a mapping"),
    ({"train": [1, 2]}, r"section 'train' must be a mapping"),
])
def test_bad_values_name_field_and_constraint(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict(raw)


def test_defaults_and_model_forms():
    cfg = from_dict({})
    assert cfg.model.num_hidden_layers == 6 and cfg.model.hidden_size == 64      # tiny preset
    assert cfg.optim.decay_steps == cfg.train.steps                             # decay over the run
    c2 = from_dict({"model": {"preset": "tiny", "num_hidden_layers": 2, "hidden_size": 32}})
    assert (c2.model.num_hidden_layers, c2.model.hidden_size, c2.model.head_dim) == (2, 32, 8)
    c3 = from_dict({"model": {"vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
                              "num_hidden_layers": 1, "num_attention_heads": 2}})
    assert c3.model.vocab_size == 100 and c3.model.num_key_value_heads == 2


def test_tiny_yaml_documents_every_field():
    """configs/tiny.yaml lists every field of every section and equals the built-in defaults."""
    from hethub_jax.config import TrainSettings
    from hethub_jax.data import DataConfig
    from hethub_jax.optim import OptimConfig

    path = os.path.join(REPO, "configs", "tiny.yaml")
    raw = yaml.safe_load(open(path))
    for section, cls in (("data", DataConfig), ("optim", OptimConfig), ("train", TrainSettings)):
        assert set(raw[section]) == set(cls.model_fields), section
    assert load_config(path) == load_config(None)


def test_cli_precedence(tmp_path):
    path = _write(tmp_path, """
        model: tiny
        optim: {learning_rate: 1.0e-3}
        train: {steps: 50, eval_every: 5, metrics_file: from_file.jsonl}
    """)
    cfg = load_config(path)
    assert (cfg.train.steps, cfg.train.eval_every, cfg.optim.learning_rate) == (50, 5, 1e-3)
    assert cfg.optim.decay_steps == 50
    # --set beats the file; a dedicated flag beats --set; a flag left at None changes nothing.
    cfg = load_config(path, ["train.steps=70", "optim.learning_rate=2e-3", "model.num_hidden_layers=2"],
                      {"train.steps": 80, "train.eval_every": None, "train.metrics_file": "flag.jsonl"})
    assert cfg.train.steps == 80 and cfg.optim.decay_steps == 80
    assert cfg.optim.learning_rate == 2e-3 and cfg.model.num_hidden_layers == 2
    assert cfg.train.eval_every == 5 and cfg.train.metrics_file == "flag.jsonl"
    with pytest.raises(ConfigError, match="unknown section 'nope'"):
        load_config(path, ["nope.x=1"])
    with pytest.raises(ConfigError, match="unknown key 'stepz' in section 'train'"):
        load_config(path, ["train.stepz=1"])


def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "hethub_jax.train", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


@contextlib.contextmanager
def _no_jax_lowering():
    """Yields the list of JAX compilations (``/jax/core/compile/...`` monitoring events: tracing,
    lowering to MLIR, backend compile; cached or not) that happen inside the block. A fresh jit
    compiled first must be seen (positive control: if JAX renamed its events, this fails instead of
    passing silently)."""
    import jax
    import jax.monitoring

    seen: list[str] = []

    def listener(event: str, duration: float, **kw) -> None:
        if event.startswith("/jax/core/compile/"):
            seen.append(f"{event} {kw.get('fun_name', '')}".strip())

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(lambda v: v * 3 + 1)(np.float32(1))
        assert any("jaxpr_to_mlir" in e for e in seen), f"no compile event seen for a fresh jit: {seen}"
        seen.clear()
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("args, pattern", [
    (["--steps", "0"], r"train\.steps must be an integer >= 1"),
    (["--set", "train.bogus=1"], r"unknown key 'bogus' in section 'train'"),
    (["--config", "does/not/exist.yaml"], r"--config: file not found"),
    (["--plan", "does/not/exist.json"], r"train\.plan: file not found"),
    (["--plan", os.path.join(REPO, "configs/plans/tiny_single.json"), "--global-batch-size", "7"],
     r"global_batch_size must be divisible by microbatch_size: 7 % 2"),
    (["--set", "data.corpus_path=/nonexistent/corpus"], r"data: .*/nonexistent/corpus"),
    (["--set", "data.tokenizer_path=/nonexistent/tok.model"],
     r"data: tokenizer_path: /nonexistent/tok\.model does not exist"),
    (["--set", "model.vocab_size=1000"], r"model\.vocab_size \(1000\) must be >= the tokenizer's vocabulary"),
])
def test_config_errors_return_2_with_one_line(args, pattern, capsys):
    with _no_jax_lowering() as lowered:  # reported before any compilation
        rc = main([*args, "--no-checkpoint", "--metrics-file", os.devnull, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert lowered == [], lowered
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m hethub_jax.train: error: "), err
    assert re.search(pattern, lines[0]), lines[0]


def test_cli_config_error_is_one_line_exit_2_without_traceback():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "hethub_jax.train", "--set", "train.global_batch_size=10",
                        "--set", "train.microbatch_size=4", "--metrics-file", os.devnull],
                       capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip() == ("python -m hethub_jax.train: error: train.global_batch_size must be "
                                "divisible by train.microbatch_size: 10 % 4 = 2")


# ---- gradient clipping ---------------------------------------------------------------------------

def test_clip_by_norm_equals_optax_clip_by_global_norm():
    import jax
    import jax.numpy as jnp
    import optax

    from hethub_jax.optim import clip_by_norm

    rng = np.random.default_rng(0)
    tree = {"w": jnp.asarray(rng.normal(size=(7, 5)), jnp.float32),
            "b": [jnp.asarray(rng.normal(size=(5,)), jnp.float32), jnp.asarray(3.0, jnp.float32)],
            "h": jnp.asarray(rng.normal(size=(4, 3)), jnp.bfloat16)}
    norm = optax.tree.norm(tree)
    assert 6.0 < float(norm) < 9.0
    # At exactly the limit optax rescales (by norm / norm, not always bit-exact 1): so must we.
    for max_norm in (1.0, 0.5 * float(norm), float(norm), 2.0 * float(norm), 100.0):
        ref, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        got = clip_by_norm(tree, norm, max_norm)
        assert jax.tree.structure(got) == jax.tree.structure(tree)
        for g, r, t in zip(jax.tree.leaves(got), jax.tree.leaves(ref), jax.tree.leaves(tree)):
            assert g.dtype == t.dtype
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
            if max_norm > float(norm):  # below the limit: untouched
                np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(t, np.float32))
        if max_norm < float(norm):  # above the limit: scaled down to the limit
            assert float(optax.tree.norm(got)) == pytest.approx(max_norm, rel=1e-2)
    assert clip_by_norm(tree, norm, None) is tree


# ---- progress bar ---------------------------------------------------------------------------------

PROGRESS_RUN = """
model: {preset: tiny, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
        num_attention_heads: 2, num_key_value_heads: 1}
data: {seq_len: 16}
train: {steps: 3, global_batch_size: 2, microbatch_size: 2, eval_every: 100, eval_at_start: false,
        eval_batches: 1, log_every: 0}
"""


def test_progress_bar_shows_step_loss_and_throughput(tmp_path, capsys):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    rc = main(["--config", _write(tmp_path, PROGRESS_RUN), "--metrics-file", str(metrics), "--checkpoint-dir",
               str(ckpt)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = [r for r in recs if r["kind"] == "step"][-1]
    assert last["kind"] == "step" and last["step"] == 3
    # Not a tty: plain progress lines (no carriage returns); the last one carries the last step's figures,
    # each labelled: "train: 3/3 steps (100%), ETA 00:00, loss 10.364, 2.4k tokens/s, step 0.5 s (median
    # 0.45 s), PREDICTED 0.1 s (PREDICTED/measured 0.22), val_loss 10.3330 (step 3)"
    assert "\r" not in err
    bars = re.findall(r"^train: 3/3 steps \(100%\), ETA [0-9:]+, loss (\d+\.\d{3}), ([0-9.]+k?) tokens/s, "
                      r"step ([0-9.e+-]+) s \(median ([0-9.e+-]+) s\), PREDICTED [0-9.e+-]+ s \(PREDICTED/measured "
                      r"([0-9.]+)\), val_loss (\d+\.\d{4}) \(step 3\)$", err, re.M)
    assert bars, err
    loss, rate, step_s, median_s, ratio, val_loss = bars[-1]
    assert loss == f"{last['loss']:.3f}" and val_loss == f"{last['val_loss']:.4f}"
    tps = last["tokens_per_s"]
    assert rate == (f"{tps / 1000:.1f}k" if tps >= 1000 else f"{tps:.0f}")
    steps = [r["step_time_s"] for r in recs if r["kind"] == "step"]
    assert step_s == f"{steps[-1]:.3g}" and median_s == f"{(steps[1] + steps[2]) / 2:.3g}"
    summary = [r for r in recs if r["kind"] == "prediction"][0]
    assert ratio == f"{summary['predicted_over_measured']:.2f}"
    assert "step 3/3: loss" in out  # the text line goes to stdout through the bar
    # a clean exit leaves no lock file behind (docs/training.md: one run per output directory)
    assert not (tmp_path / "m.jsonl.lock").exists() and not (ckpt / ".lock").exists()
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".lock")]


# ---- a real short training run ------------------------------------------------------------------
# The cost is dominated by the 32,000-id head and its softmax (per token, whatever the model width),
# so the run is as few tokens as reliably beat the unigram bar: 200 steps of 16 x 64 tokens (~205k
# tokens) on a narrow (d=32), shallow (2 layers) model with a high learning rate. About a minute on
# 2 idle CPU cores; the final validation loss is 6.35, ~0.09 nats below the bar (6.43).
SHORT_RUN = """
model: {preset: tiny, hidden_size: 32, intermediate_size: 96, num_hidden_layers: 2,
        num_attention_heads: 2, num_key_value_heads: 1}
data: {seq_len: 64}
optim: {learning_rate: 1.5e-2, warmup_steps: 10}
train: {steps: STEPS, global_batch_size: 16, microbatch_size: 16, eval_every: 50, eval_batches: 4,
        log_every: 0}
"""
STEPS = 200


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("short_run")
    cfg_path = d / "short.yaml"
    cfg_path.write_text(SHORT_RUN.replace("STEPS", str(STEPS)))
    metrics, ckpt_dir = d / "m.jsonl", d / "ckpt"
    rc = main(["--config", str(cfg_path), "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt_dir),
               "--trace-file", str(d / "trace.json"), "--no-progress"])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"rc": rc, "dir": d, "cfg_path": cfg_path, "metrics": metrics, "ckpt_dir": ckpt_dir,
            "records": records}


@pytest.mark.slow
def test_short_run_beats_unigram_entropy_and_writes_metrics(short_run):
    from hethub_jax.config import load_config
    from hethub_jax.data import build_datasets, unigram_entropy

    assert short_run["rc"] == 0
    recs = short_run["records"]
    assert recs[0]["kind"] == "run" and recs[-1]["kind"] == "end"
    assert recs[0]["config"]["train"]["steps"] == STEPS and recs[0]["emulation"]["active"] is False
    assert "jax" in recs[0]["versions"] and recs[0]["plan"]["replicas"][0]["stages"][0]["last_layer"] == 1
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        for key in ("loss", "tokens_per_s", "step_time_s", "grad_norm", "lr", "num_tokens", "wall_s"):
            assert isinstance(r[key], (int, float)) and np.isfinite(r[key]), (key, r)
        assert 0.9 * 16 * 64 < r["num_tokens"] <= 16 * 64 and r["step_time_s"] > 0  # document ends masked
        assert r["tokens_per_s"] == pytest.approx(r["num_tokens"] / r["step_time_s"])
        assert ("val_loss" in r) == (r["step"] % 50 == 0 or r["step"] == STEPS)
    # Warm-up then cosine decay: lr rises for 10 steps, then falls to min_lr_ratio * peak.
    lrs = [r["lr"] for r in steps]
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(1.5e-2, rel=1e-3) and lrs[-1] < lrs[20]
    assert lrs[-1] == pytest.approx(1.5e-2 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 189 / 190))), rel=1e-4)

    evals = [recs[1]["val_loss"]] + [r["val_loss"] for r in steps if "val_loss" in r]
    assert recs[1]["kind"] == "eval" and recs[1]["step"] == 0
    assert evals[0] > 10.0                       # ~log(32000) at initialisation
    assert all(b < a for a, b in zip(evals, evals[1:])), evals   # validation loss falls at every eval

    cfg = load_config(short_run["cfg_path"])
    train, val, tok = build_datasets(cfg.data)
    bar = unigram_entropy(train.target_ids(), tok.vocab_size)
    assert evals[-1] < bar, f"final val_loss {evals[-1]:.4f} not below the unigram entropy {bar:.4f}"
    assert recs[-1]["final_val_loss"] == evals[-1] and recs[-1]["status"] == "ok"

    trace = json.loads((short_run["dir"] / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"F0", "B0"} <= names                 # one microbatch of 16


@pytest.mark.slow
def test_checkpoint_written_and_restorable(short_run):
    from hethub_jax import checkpoint
    from hethub_jax.config import load_config
    from hethub_jax.data import build_datasets
    from hethub_jax.parallel.runtime import PipelineRuntime
    from hethub_jax.train import _resolve_plan

    import jax

    root = short_run["ckpt_dir"]
    assert (root / f"step_{STEPS}" / "layers.1").is_dir() and (root / f"step_{STEPS}" / "meta.json").is_file()
    assert checkpoint.latest_step(root, num_layers=2) == STEPS
    assert checkpoint.read_meta(root, STEPS)["step"] == STEPS

    cfg = load_config(short_run["cfg_path"])
    plan, _ = _resolve_plan(cfg, "cpu")
    fresh = [PipelineRuntime(plan, cfg.model, cfg.optim, seed=cfg.train.seed) for _ in range(2)]
    before = fresh[0].params()
    for rt in fresh:
        assert checkpoint.restore_latest(rt, root, cfg.to_dict(), plan.global_batch_size)[0] == STEPS
    p0, p1 = fresh[0].params(), fresh[1].params()
    assert set(p0) == set(before)
    assert any(not np.array_equal(before[k], p0[k]) for k in p0)        # training changed the weights
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k])
    s0, s1 = (jax.tree.leaves(rt.checkpoint_state()) for rt in fresh)
    for a, b in zip(s0, s1):                                             # optimizer state too
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The restored weights are the trained ones: the validation loss matches the last recorded one.
    _, val, _ = build_datasets(cfg.data)
    tot = cnt = 0.0
    for b in val.batches(plan.global_batch_size, max_batches=cfg.train.eval_batches):
        s, n = fresh[0].eval_loss(b)
        tot, cnt = tot + s, cnt + n
    assert tot / cnt == pytest.approx(short_run["records"][-1]["final_val_loss"], rel=1e-6)


@pytest.mark.slow
def test_resume_continues_from_checkpoint(short_run):
    m2 = short_run["dir"] / "m_resume.jsonl"
    import shutil
    shutil.copy(short_run["metrics"], m2)
    rc = main(["--config", str(short_run["cfg_path"]), "--metrics-file", str(m2), "--checkpoint-dir",
               str(short_run["ckpt_dir"]), "--resume", "--steps", str(STEPS + 2), "--no-progress"])
    assert rc == 0
    recs = [json.loads(line) for line in m2.read_text().splitlines()]
    runs = [r for r in recs if r["kind"] == "run"]
    assert len(runs) == 2 and runs[1]["start_step"] == STEPS
    new_steps = [r["step"] for r in recs[len(short_run["records"]):] if r["kind"] == "step"]
    assert new_steps == [STEPS + 1, STEPS + 2]
    assert (short_run["ckpt_dir"] / f"step_{STEPS + 2}" / "embed").is_dir()
