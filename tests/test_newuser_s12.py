"""New-user findings of session 12 (s12-nufix, report /work/bench/s12/new_user.md).

References are independent of the code under test: the plan CLI's own argparse and its own search (a
suggested command must plan exactly the run's problem), the preset table, datasheet figures quoted in the
test itself, files on disk before and after a second run.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from hethub_jax.parallel.plan import Plan
from hethub_jax.plan import _parser as plan_parser
from hethub_jax.plan import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "configs" / "clusters"
TINY2 = CLUSTERS / "tiny_2island_cpu.yaml"


# ---- 1. plan commands that plan-less training suggests plan the run's problem -----------------------

def _commands(text: str):
    """The ``python -m hethub_jax.plan ...`` commands quoted in backticks in ``text``, as argv lists
    (without ``python -m hethub_jax.plan``)."""
    out = []
    for m in re.findall(r"`(python -m hethub_jax\.plan [^`]*)`", text):
        argv = shlex.split(m)
        assert argv[:3] == ["python", "-m", "hethub_jax.plan"]
        out.append(argv[3:])
    return out


def _cli_plan(argv, tmp_path, name="cli.json"):
    out = tmp_path / name
    argv = [a for a in argv]
    if "--out" in argv:
        i = argv.index("--out")
        del argv[i:i + 2]
    assert plan_main([*argv, "--top", "1", "--out", str(out)]) == 0
    return Plan.from_json(str(out))


@pytest.mark.parametrize("mbs,override", [(None, False), (2, True)])
def test_planless_upper_bound_command_plans_the_runs_problem(tmp_path, capsys, mbs, override):
    """The upper-bound note's command, parsed by the plan CLI's argparse, names the run's model, seq len
    (not the CLI's default 512 for tiny), global batch, profiles folder and microbatch size; run, it
    chooses the plan training chose. A model changed from its preset goes as a model file."""
    from hethub_jax.planner import load_model
    from hethub_jax.train_predict import _plan_rank0
    from test_train_insight import fixed_profile
    prof = tmp_path / "run" / "profiles"
    prof.mkdir(parents=True)
    (prof / "cpu.json").write_text(json.dumps(fixed_profile()))
    cfg = load_model("tiny")
    if override:
        cfg = cfg.model_copy(update={"num_hidden_layers": 4})
    msg = _plan_rank0(cfg, "tiny", str(TINY2), 8, 16, mbs, str(prof), lambda m: None)
    (argv,) = _commands("\n".join(msg["lines"]))
    args = plan_parser().parse_args(argv)
    assert load_model(args.model) == cfg
    assert (args.model == "tiny") == (not override)
    assert (args.seq_len, args.global_batch, args.cluster) == (16, 8, str(TINY2))
    assert args.profiles == str(prof)
    assert args.microbatch_sizes == ([mbs] if mbs else None)
    assert not args.no_upper_bound  # it is the command that computes the upper bound
    assert _cli_plan(argv, tmp_path) == Plan.from_dict(msg["plan"])


def test_planless_rank_count_error_command_plans_the_runs_problem(tmp_path):
    """The rank-count refusal's command (llama3-70b at 4096 tokens, microbatch 1, catalog costs: the
    CLI's default seq len would be another) writes the very plan the run chose."""
    from hethub_jax.planner import load_model
    from hethub_jax.train_predict import _plan_rank0
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"name": "two-groups", "groups": [
        {"name": "b", "device": "H100-SXM", "nodes": 4}, {"name": "a", "device": "MI300X", "nodes": 2}]}))
    cfg = load_model("llama3-70b")
    with pytest.raises(ValueError) as e:
        _plan_rank0(cfg, "llama3-70b", str(cluster), 16, 4096, 1, str(tmp_path / "prof"), lambda m: None,
                    world_size=6)
    (argv,) = _commands(str(e.value))
    args = plan_parser().parse_args(argv)
    assert (args.model, args.seq_len, args.global_batch, args.microbatch_sizes, args.out) == \
        ("llama3-70b", 4096, 16, [1], "plan.json")
    assert args.profiles is None  # no profile folder was made: the CLI would refuse a missing one
    want = _plan_rank0(cfg, "llama3-70b", str(cluster), 16, 4096, 1, str(tmp_path / "prof"), lambda m: None)
    assert _cli_plan(argv, tmp_path) == Plan.from_dict(want["plan"])
