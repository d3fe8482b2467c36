"""Training entry point: config validation, CLI precedence, and a real short training run."""
from __future__ import annotations

import json
import os
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
    import dataclasses

    from hethub_jax.config import TrainSettings
    from hethub_jax.data import DataConfig
    from hethub_jax.optim import OptimConfig

    path = os.path.join(REPO, "configs", "tiny.yaml")
    raw = yaml.safe_load(open(path))
    for section, cls in (("data", DataConfig), ("optim", OptimConfig), ("train", TrainSettings)):
        assert set(raw[section]) == {f.name for f in dataclasses.fields(cls)}, section
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


@pytest.mark.parametrize("args, pattern", [
    (["--steps", "0"], r"train\.steps must be an integer >= 1"),
    (["--set", "train.bogus=1"], r"unknown key 'bogus' in section 'train'"),
    (["--config", "does/not/exist.yaml"], r"--config: file not found"),
    (["--plan", "does/not/exist.json"], r"train\.plan: file not found"),
    (["--plan", os.path.join(REPO, "configs/plans/tiny_single.json"), "--global-batch-size", "7"],
     r"global_batch_size must be divisible by microbatch_size: 7 % 2"),
    (["--set", "data.corpus_path=/nonexistent/corpus"], r"data: .*/nonexistent/corpus"),
])
def test_cli_config_errors_are_one_line_exit_2(args, pattern):
    r = _run_cli(*args, "--no-checkpoint", "--metrics-file", os.devnull)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("python -m hethub_jax.train: error: ")
    import re
    assert re.search(pattern, lines[0]), lines[0]
