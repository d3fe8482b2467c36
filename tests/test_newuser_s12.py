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
    assert plan_main([*argv, "--out", str(out)]) == 0  # the default --top: plan-less training's k
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


# ---- 3. running the same command again never loses anything -------------------------------------

def _train_cli(d: Path, *extra: str):
    import contextlib
    import io
    from hethub_jax.train import main
    from test_checkpoint_resume import CONFIG
    cfg = d / "c.yaml"
    cfg.write_text(CONFIG)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--config", str(cfg), "--metrics-file", str(d / "m.jsonl"), "--checkpoint-dir", str(d / "ckpt"),
                   "--no-progress", "--set", "train.checkpoint_every=0", *extra])
    return rc, out.getvalue() + err.getvalue()


def _step_records(path: Path):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "step"]


def test_running_the_same_command_again_resumes_and_loses_nothing(tmp_path):
    """Default ``train.resume`` null (MaxText-style): the same command again resumes from the newest
    checkpoint (here it already reaches train.steps: it says so, exit 0, files untouched); more steps
    continue it, appending to the metrics; ``--no-resume`` starts from step 0 with the earlier metrics
    renamed and the earlier checkpoints moved aside, never deleted or truncated."""
    from hethub_jax import checkpoint as ckpt
    layers = 3
    rc, out = _train_cli(tmp_path, "--steps", "2")
    assert rc == 0, out
    first = (tmp_path / "m.jsonl").read_bytes()
    assert [r["step"] for r in _step_records(tmp_path / "m.jsonl")] == [1, 2]
    assert ckpt.complete_steps(tmp_path / "ckpt", layers) == [2]
    # the same command again
    rc, out = _train_cli(tmp_path, "--steps", "2")
    assert rc == 0, out
    # (session 17: found before the runtime is built, so without the "resume: ... continuing" line)
    assert "nothing to do" in out and "step 2 in" in out and "--steps M" in out and "--no-resume" in out, out
    assert (tmp_path / "m.jsonl").read_bytes() == first
    # more steps: continues, the metrics appended
    rc, out = _train_cli(tmp_path, "--steps", "3")
    assert rc == 0, out
    assert (tmp_path / "m.jsonl").read_bytes().startswith(first)
    assert [r["step"] for r in _step_records(tmp_path / "m.jsonl")] == [1, 2, 3]
    assert ckpt.complete_steps(tmp_path / "ckpt", layers) == [3, 2]
    kept = (tmp_path / "m.jsonl").read_bytes()
    # --no-resume: from step 0; the earlier run's files are kept, and said so
    rc, out = _train_cli(tmp_path, "--steps", "1", "--no-resume")
    assert rc == 0, out
    assert (tmp_path / "m.jsonl.1").read_bytes() == kept
    assert [r["step"] for r in _step_records(tmp_path / "m.jsonl")] == [1]
    assert ckpt.complete_steps(tmp_path / "ckpt", layers) == [1]
    assert ckpt.complete_steps(tmp_path / "ckpt" / "earlier_run_1", layers) == [3, 2]
    assert "m.jsonl.1" in out and "earlier_run_1" in out, out
    # no checkpoint to resume (another, empty checkpoint directory): a new run still keeps the earlier metrics
    rc, out = _train_cli(tmp_path, "--steps", "1", "--checkpoint-dir", str(tmp_path / "other"))
    assert rc == 0, out
    assert [r["step"] for r in _step_records(tmp_path / "m.jsonl.2")] == [1]
    assert "m.jsonl.2" in out


def test_resume_flags_are_exclusive_and_map_to_train_resume():
    from hethub_jax.train import _flags, build_parser
    p = build_parser()
    assert _flags(p.parse_args([]))["train.resume"] is None
    assert _flags(p.parse_args(["--no-resume"]))["train.resume"] is False
    assert _flags(p.parse_args(["--resume"]))["train.resume"] is True
    with pytest.raises(SystemExit):
        p.parse_args(["--resume", "--no-resume"])


# ---- 5. microbatch_size is the whole stage's, split over its DP ranks ---------------------------

def test_microbatch_size_is_split_over_the_stage_dp_ranks():
    """As docs/plan_format.md says: 8 samples at dp 8 is 1 per DP rank (valid); 4 at dp 8 cannot be split."""
    def plan(mbs):
        return {"islands": [{"name": "a", "platform": "cpu", "num_processes": 1, "devices_per_process": 8}],
                "stages": [{"island": "a", "first_layer": 0, "last_layer": 1, "dp": 8, "tp": 1}],
                "global_batch_size": 64, "microbatch_size": mbs}
    p = Plan.from_dict(plan(8)).validate()
    assert p.num_global_microbatches == 64 // 8  # Megatron: 64 / (micro-batch 1 x DP 8)
    with pytest.raises(ValueError, match="dp"):
        Plan.from_dict(plan(4)).validate()


# ---- 6. small things -------------------------------------------------------------------------------

def test_plan_help_shows_the_max_stages_default(capsys):
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    default = plan_parser().get_default("max_stages_per_group")
    assert re.search(rf"--max-stages-per-group MAX_STAGES_PER_GROUP most stages one group may hold \(default {default}\)",
                     text), text


def test_cluster_errors_name_the_group_beside_its_index():
    from hethub_jax.planner import cluster_from_dict
    spec = {"groups": [{"name": "fast", "device": "cpu", "nodes": 1},
                       {"name": "slow", "device": "cpu", "nodes": 1, "devices_per_nod": 1}],
            "links": [{"between": ["fast", "slwo"], "bandwidth": 1e9}]}
    with pytest.raises(ValueError) as e:
        cluster_from_dict(spec)
    assert "groups.1 (slow).devices_per_nod: unknown key (did you mean 'devices_per_node'?)" in str(e.value)
    spec["groups"][1].pop("devices_per_nod")
    with pytest.raises(ValueError) as e:
        cluster_from_dict(spec)
    assert "(top level): links[0].between names unknown group 'slwo'" in str(e.value), str(e.value)
    assert "Value error" not in str(e.value)


def test_readme_layout_lists_every_module():
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```\n") + 4:]
    block = block[:block.index("```")]
    rows, folder = {}, None
    for line in block.splitlines():
        m = re.match(r"(hethub_jax/|  (\w+)/)\s+(.*)", line)
        if m:
            folder = "" if m.group(1) == "hethub_jax/" else m.group(2)
            rest = m.group(3)
        elif line.startswith("             ") and folder is not None:
            rest = line
        elif re.match(r"  (\S+\.py) \(", line):
            rows.setdefault("", set()).add(line.split()[0])
            continue
        else:
            continue
        rows.setdefault(folder, set()).update(rest.split())
    pkg = ROOT / "hethub_jax"
    files = [p.relative_to(ROOT).as_posix() for p in pkg.rglob("*") if p.suffix in (".py", ".c")
             and "__pycache__" not in p.parts]
    missing = []
    for f in files:
        parts = f.split("/")[1:]
        if not parts[-1].endswith((".py", ".c")) or parts[-1] in ("__init__.py", "__main__.py"):
            continue
        folder = "" if len(parts) == 1 else parts[0]
        if parts[-1] not in rows.get(folder, set()):
            missing.append(f)
    assert not missing, missing
