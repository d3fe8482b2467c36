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


# ---- 2. MI250X is modelled as the JAX device: one GCD ----------------------------------------------

def test_mi250x_catalog_entry_is_one_gcd():
    """The entry is one GCD, the device JAX on ROCm sees. References quoted here from the sources (not the
    code): AMD Instinct MI250X datasheet per OAM package 383 TFLOPS BF16, 128 GB HBM2e at 3.2768 TB/s
    (1.6 TB/s per GCD, ROCm MI250 microarchitecture page); OLCF Frontier user guide: 4 MI250X = 8 GCDs
    per node, 64 GB each; 4 Infinity Fabric links of 50 GB/s between a package's GCDs; one 200 Gb/s
    Slingshot NIC per package."""
    from hethub_jax.planner.catalog import get_device
    d = get_device("MI250X")
    gcds_per_package = 2
    assert d.peak_flops == pytest.approx(383e12 / gcds_per_package)
    assert d.memory_bytes == 128 * 10**9 // gcds_per_package == 64 * 10**9
    assert d.memory_bandwidth == pytest.approx(3.2768e12 / gcds_per_package)
    assert d.devices_per_node == 4 * gcds_per_package
    assert d.intra_node_bandwidth == pytest.approx(4 * 50e9)
    assert d.network_bandwidth == pytest.approx(200e9 / 8 / gcds_per_package)
    for words in ("GCD", "frontier_user_guide", "mi250x", "Slingshot"):
        assert words.lower() in d.source.lower(), words


def test_example_clusters_count_mi250x_gcds():
    """The example clusters' MI250X groups have 8 devices (GCDs) per node, and a plan for the HETHUB-like
    cluster keeps every MI250X stage within one GCD's 64 GB (the old model allowed 128 GB per device)."""
    import yaml
    from hethub_jax.planner import SearchOptions, load_cluster, load_model, search
    for name in ("hethub_768.yaml", "four_types_16k.yaml"):
        spec = yaml.safe_load((CLUSTERS / name).read_text())
        groups = [g for g in load_cluster(CLUSTERS / name).resolved().groups if g.device == "MI250X"]
        assert groups and all(g.devices_per_node == 8 for g in groups)
        assert "GCD" in spec["description"]
    res = search(load_model("llama-140b"), CLUSTERS / "hethub_768.yaml", 1536, 4096,
                 options=SearchOptions(top_k=1, max_stages_per_group=8))
    for sp in res.best.prediction.stages:
        st = res.best.plan.stage(sp.replica, sp.stage)
        if st.island.startswith("mi250x"):
            assert sp.memory.total <= 64e9


# ---- 4. docs/planner.md's catalog-cost examples are the commands' output ----------------------------

def _doc_examples():
    """(argv, expected output lines) of each ``python -m hethub_jax.plan`` example in docs/planner.md
    that is followed by its output block."""
    text = (ROOT / "docs" / "planner.md").read_text()
    out = []
    for m in re.finditer(r"```bash\n(python -m hethub_jax\.plan [^`]*?)\n```\n+(?:[^`]*?\n)?```\n(.*?)```", text, re.S):
        cmd = m.group(1).replace("\\\n", " ")
        if "--global-batch" not in cmd or "MODEL" in cmd:
            continue
        out.append((shlex.split(cmd)[3:], m.group(2).splitlines()))
    return out


def _norm(lines):
    return [re.sub(r"search \d+\.\d+ s", "search X s", x) for x in lines]


def test_planner_doc_examples_match_the_commands(tmp_path, monkeypatch, capsys):
    """Catalog costs are deterministic: each documented example prints exactly the documented output
    (apart from the search's wall time); the infeasible 768 request prints the documented error."""
    examples = _doc_examples()
    assert len(examples) >= 3, examples
    monkeypatch.chdir(tmp_path)
    for argv, want in examples:
        argv = [str(ROOT / a) if a.startswith("configs/") else a for a in argv]
        assert plan_main(argv) == 0
        got = capsys.readouterr().out.splitlines()
        assert _norm(got) == _norm(want), (argv, "\n".join(got))
    text = (ROOT / "docs" / "planner.md").read_text()
    err = next(x for x in text.splitlines() if x.startswith("error: infeasible: the model's 90 layers"))
    argv = ["--model", "llama-140b", "--cluster", str(CLUSTERS / "hethub_768.yaml"), "--global-batch", "1536",
            "--top", "1"]
    assert plan_main(argv) == 2
    assert capsys.readouterr().err.strip() == err
