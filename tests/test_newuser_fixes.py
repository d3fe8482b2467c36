"""New-user findings of session 10 (s10-fix): the plan CLI says where each group's costs come from,
recomputation never PREDICTED faster than none, honest Gantt titles, one error print under mpiexec,
help defaults, the plan-less upper-bound note, the resumed plan file and the output-path summary.

References are independent of the code under test: the cluster YAML and the profile JSON themselves
(device names, dates), a plan's recompute flag flipped with everything else equal.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hethub_jax.plan import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "configs" / "clusters"
TINY2 = CLUSTERS / "tiny_2island_cpu.yaml"
MIXED = CLUSTERS / "mixed_h100_mi300x.yaml"


# ---- 1. the plan CLI says where each group's costs come from ---------------------------------------

def test_plan_cli_prints_catalog_cost_source_per_group(capsys):
    assert plan_main(["--model", "tiny", "--cluster", str(MIXED), "--global-batch", "8", "--seq-len", "32",
                      "--no-upper-bound"]) == 0
    out = capsys.readouterr().out
    spec = yaml.safe_load(MIXED.read_text())
    for g in spec["groups"]:
        line = next(x for x in out.splitlines() if x.startswith(f"group {g['name']} "))
        assert f"catalog {g['device']!r} datasheet peak x 0.4 efficiency (assumption, not measured; " \
               f"profile with python -m hethub_jax.profile)" in line, line


def test_plan_cli_prints_profile_path_and_date(tmp_path, capsys):
    from test_train_insight import fixed_profile
    prof = dict(fixed_profile(), date="2026-12-02T16:00:00+00:00")
    (tmp_path / "cpu.json").write_text(json.dumps(prof))
    assert plan_main(["--model", "tiny", "--cluster", str(TINY2), "--global-batch", "8", "--seq-len", "16",
                      "--no-upper-bound", "--profiles", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for g in yaml.safe_load(TINY2.read_text())["groups"]:
        line = next(x for x in out.splitlines() if x.startswith(f"group {g['name']} "))
        assert f"costs: profile {tmp_path / 'cpu.json'} (measured {prof['date']})" in line, line


# ---- 2. recompute full is never PREDICTED faster than none -----------------------------------------

def _random_profile(rng, name="dev"):
    """A profile whose four phases have independent random fitted lines (as noisy fits can: F_nosave
    above F, B_recompute below B, ...)."""
    from hethub_jax.planner.costs import PROFILE_FORMAT
    line = lambda: {"c0": rng.uniform(0, 2e-3), "c1": rng.uniform(0, 5e-10)}
    tok = lambda: {"c0": rng.uniform(0, 2e-3), "c1": rng.uniform(0, 1e-6)}
    parts = lambda: {"layer": line(), "embed": tok(), "head": line(), "base": {"c0": rng.uniform(0, 2e-3), "c1": 0.0}}
    zero = {"c0": 0.0, "c1": 0.0}
    return {"format": PROFILE_FORMAT, "device_type": name, "memory_bytes": 10**12,
            "fits": {"compute": {"1": {ph: parts() for ph in ("F", "F_nosave", "B", "B_recompute")}},
                     "update": {"c0": 1e-4, "c1": 0.0}, "allreduce": zero}}


@pytest.mark.parametrize("seed", range(40))
def test_recompute_full_is_never_predicted_faster_than_none(seed):
    import random

    from hethub_jax.parallel.plan import Plan
    from hethub_jax.planner.costs import DeviceCosts, LinkModel
    from hethub_jax.planner.predictor import predict
    from test_predictor import Cfg
    rng = random.Random(seed)
    p = rng.randint(1, 4)
    m = rng.choice([1, 2, 3, 4, 8])
    names = [f"i{s}" for s in range(p)]
    cuts = sorted(rng.sample(range(1, Cfg.num_hidden_layers), p - 1))
    bounds = [0, *cuts, Cfg.num_hidden_layers]
    stages = [{"island": names[s], "first_layer": bounds[s], "last_layer": bounds[s + 1] - 1} for s in range(p)]
    base = {"islands": [{"name": n, "platform": "cpu", "slowdown": rng.choice([1.0, 1.0, 2.5])} for n in names],
            "stages": stages, "global_batch_size": m * 2, "microbatch_size": 2,
            "schedule": rng.choice(["1f1b", "gpipe"])}
    costs = {n: DeviceCosts.from_profile(_random_profile(rng)) for n in names}
    bridge = LinkModel(rng.uniform(0, 1e-3), 1e9)
    t = {rec: predict(Cfg, Plan.from_dict({**base, "recompute": rec}), costs, seq_len=16, bridge=bridge).step_time_s
         for rec in ("none", "full")}
    assert t["full"] >= t["none"] * (1 - 1e-12), t


# ---- 3. honest Gantt titles; the fused forward+backward drawn as such ------------------------------

def test_gantt_titles_say_pipeline_span_of_step_and_fused_bars_have_their_own_category(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from hethub_jax.parallel.trace import ActionRecord
    from hethub_jax.timeline import COLOURS, FUSED, write_timeline_png
    # stage 1 is the last stage: F0 then B0 of the same microbatch (fused), no send between them
    recs = [ActionRecord(0, "F0", 0.0, 0.3, "a"), ActionRecord(0, "SEND_ACT0->1", 0.3, 0.31, "a"),
            ActionRecord(1, "RECV_ACT0<-0", 0.0, 0.31, "b"), ActionRecord(1, "F0", 0.31, 0.61, "b"),
            ActionRecord(1, "B0", 0.61, 0.611, "b"), ActionRecord(1, "SEND_GRAD0->0", 0.611, 0.62, "b"),
            ActionRecord(0, "RECV_GRAD0<-1", 0.31, 0.62, "a"), ActionRecord(0, "B0", 0.62, 0.9, "a")]
    pred = [ActionRecord(r.stage, r.action, r.start_s, r.end_s, f"predicted: {r.island}") for r in recs]
    titles = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, t, **kw: titles.append(t))
    out = write_timeline_png(str(tmp_path / "t.png"), recs, pred, title="step 20",
                             step_s={"measured": 1.41, "predicted": None})
    fused = [b for b in out["measured"] if b.category == FUSED]
    assert [(b.row, b.action) for b in fused] == [("r0 b s1", "F0")]          # the last stage's F0 only
    assert {b.action for b in out["measured"] if b.category == "forward"} == {"F0"} and \
        [b.row for b in out["measured"] if b.category == "forward"] == ["r0 a s0"]
    assert FUSED in COLOURS and len(set(COLOURS.values())) == len(COLOURS)
    span_ms = 0.9 * 1e3  # the last action ends at 0.9 s
    assert titles[0] == f"MEASURED: step 20, pipeline {span_ms:.4g} ms of step 1.41 s", titles
    assert titles[1].startswith(f"PREDICTED: step 20, pipeline {span_ms:.4g} ms (pipeline actions only;"), titles


# ---- 4. an identical error under mpiexec is printed once, not once per rank ------------------------

def _mpiexec(n_args, timeout=120):
    import os
    import shutil
    import subprocess
    import sys
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not installed")
    cmd = ["mpiexec"]
    for i, (n, argv) in enumerate(n_args):
        cmd += ([":"] if i else []) + ["-n", str(n), sys.executable, "-m", "hethub_jax.train", *argv]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_identical_config_error_is_printed_once_under_mpiexec():
    p = _mpiexec([(3, ["--plan", "configs/plans/tiny_2island.json"])])
    lines = [x for x in p.stderr.splitlines() if "error:" in x]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "rank 0: the plan needs 2 MPI ranks" in lines[0] and "the job has 3" in lines[0]


def test_argparse_error_is_printed_once_under_mpiexec_and_a_different_one_still_shows():
    p = _mpiexec([(2, ["--stepz", "1"])])
    assert p.returncode == 2 and p.stderr.count("unrecognized arguments: --stepz 1") == 1, p.stderr
    assert p.stderr.count("usage:") == 1, p.stderr
    p = _mpiexec([(1, []), (1, ["--plan", "configs/plans/tiny_2island.json", "--stepz", "1"])])
    assert p.returncode == 2 and p.stderr.count("unrecognized arguments: --stepz 1") == 1, p.stderr


# ---- 5. a plan of several islands in one process says so -------------------------------------------

def test_single_process_note_names_the_islands_and_the_mpiexec_command():
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.train import single_process_note
    raw = json.loads((ROOT / "configs/plans/tiny_2island.json").read_text())
    plan = Plan.from_dict(raw)
    note = single_process_note(plan)
    names = [i["name"] for i in raw["islands"]]
    n = sum(i.get("num_processes", 1) for i in raw["islands"])
    assert note and all(x in note for x in names) and "this one process" in note, note
    assert f"mpiexec -n {n} python -m hethub_jax.train" in note and "one process per island" in note
    one = Plan.from_dict({**raw, "islands": raw["islands"][:1],
                          "stages": [{**raw["stages"][0], "island": names[0], "first_layer": 0,
                                      "last_layer": raw["stages"][-1]["last_layer"]}]})
    assert single_process_note(one) is None


# ---- 6. train --help shows each real default once --------------------------------------------------

def test_train_help_shows_real_defaults_once_and_checkpoint_every_sets_the_field():
    import re

    from hethub_jax.config import TrainSettings
    from hethub_jax.train import _flags, build_parser
    text = re.sub(r"\s+", " ", build_parser().format_help())
    assert "(default: None)" not in text
    steps = TrainSettings.model_fields["steps"].default
    assert f"--steps STEPS train.steps: optimizer steps (default: {steps})" in text, text
    assert text.count("(default: beside --trace-file)") == 1 and "--trace-file) (default" not in text
    for m in re.finditer(r"--[a-z-]+ [^-]*?\(default: [^)]*\)[^-]*?\(default:", text):
        pytest.fail(f"two defaults: {m.group(0)}")
    args = build_parser().parse_args(["--checkpoint-every", "5"])
    assert _flags(args)["train.checkpoint_every"] == 5
    assert _flags(build_parser().parse_args([]))["train.checkpoint_every"] is None


# ---- 7. plan-less training says why there is no upper bound ----------------------------------------

def test_planless_plan_lines_say_why_the_upper_bound_is_missing():
    import hethub_jax.train_predict as tp
    from hethub_jax.planner import load_cluster, load_model
    from test_train_insight import fixed_profile
    cluster = load_cluster(str(TINY2))
    profiles = {g.name: fixed_profile() for g in cluster.resolved().groups}
    res = tp._search(load_model("tiny"), cluster, 8, 16, None, profiles)
    assert res.upper_bound_tokens_per_s is None
    note = tp.upper_bound_skipped_note(tp.plan_command("tiny", str(TINY2), 8, 16, None, str(ROOT)))
    head = tp._plan_lines(res, cluster, tp.cluster_costs(cluster, profiles), note)[0]
    assert "upper bound not computed" not in head and "skipped in plan-less training" in head, head
    assert f"`python -m hethub_jax.plan --model tiny --cluster {TINY2} --global-batch 8 --seq-len 16 " \
           f"--profiles {ROOT}` computes it" in head, head


def test_plan_cli_says_the_upper_bound_was_skipped_by_the_flag(capsys):
    assert plan_main(["--model", "tiny", "--cluster", str(TINY2), "--global-batch", "8", "--seq-len", "16",
                      "--no-upper-bound"]) == 0
    out = capsys.readouterr().out
    assert "upper bound skipped (--no-upper-bound)" in out and "upper bound not computed" not in out


# ---- 8. planner table wording --------------------------------------------------------------------

def test_plan_table_says_gradient_all_reduce_and_readable_headings(capsys):
    assert plan_main(["--model", "tiny", "--cluster", str(TINY2), "--global-batch", "8", "--seq-len", "16",
                      "--top", "1", "--no-upper-bound"]) == 0
    out = capsys.readouterr().out
    assert "gradient all-reduce" in out and "gradient sums" not in out
    head = next(x for x in out.splitlines() if "group (device)" in x)
    assert head.split()[:2] == ["replica", "stage"] and "F+B per microbatch (s)" in head
    assert "rep " not in head and "F+B/mb" not in head


# ---- 9. a resumed checkpoint's plan is named truthfully --------------------------------------------

def test_resume_line_says_when_the_checkpoint_was_written_under_another_plan(tmp_path):
    from hethub_jax.train import resume_line
    plan_file = str(tmp_path / "plan.json")
    old = json.loads((ROOT / "configs/plans/tiny_2island.json").read_text())
    from hethub_jax.parallel.plan import Plan
    old = Plan.from_dict(old).to_dict()
    new = json.loads(json.dumps(old))
    new["replicas"][0]["stages"][0]["last_layer"] -= 1
    new["replicas"][0]["stages"][1]["first_layer"] -= 1
    meta = {"plan": old, "plan_file": plan_file}
    same = resume_line(4, str(tmp_path / "ck"), meta, old, plan_file)
    assert f"written under plan {plan_file} (the plan this run trains)" in same and "ANOTHER" not in same
    diff = resume_line(4, str(tmp_path / "ck"), meta, new, plan_file)
    assert f"written under plan {plan_file}" not in diff and "ANOTHER plan" in diff, diff
    assert str(tmp_path / "ck" / "step_4" / "meta.json") in diff and f"{plan_file} now holds this run's new plan" in diff


# ---- 10. the end-of-run summary names every output written -----------------------------------------

def test_outputs_line_names_every_existing_output_in_order(tmp_path):
    from hethub_jax.train_hooks import outputs_line
    (tmp_path / "m.jsonl").write_text("{}")
    (tmp_path / "tb").mkdir()
    (tmp_path / "t.json").write_text("{}")
    outs = [("metrics", str(tmp_path / "m.jsonl")), ("plan", None), ("trace", str(tmp_path / "t.json")),
            ("timeline PNG", str(tmp_path / "t.png")), ("TensorBoard", str(tmp_path / "tb"))]
    assert outputs_line(outs) == (f"outputs: metrics {tmp_path / 'm.jsonl'}; trace {tmp_path / 't.json'}; "
                                  f"TensorBoard {tmp_path / 'tb'}")
    assert outputs_line([("plan", None), ("trace", str(tmp_path / "nope"))]) is None


# ---- 1b. a group's own catalog efficiency ------------------------------------------------------------

def test_group_efficiency_overrides_the_catalog_efficiency_and_is_validated(tmp_path, capsys):
    from hethub_jax.planner import cluster_from_dict
    from hethub_jax.planner.search import group_costs
    spec = yaml.safe_load(MIXED.read_text())
    spec["groups"][0]["efficiency"] = 0.55
    costs = group_costs(cluster_from_dict(spec))
    assert costs[spec["groups"][0]["name"]].efficiency == 0.55 and costs[spec["groups"][1]["name"]].efficiency == 0.4
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert plan_main(["--model", "tiny", "--cluster", str(path), "--global-batch", "8", "--seq-len", "32",
                      "--no-upper-bound", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert f"group {spec['groups'][0]['name']} ({spec['groups'][0]['device']}): costs: catalog " \
           f"{spec['groups'][0]['device']!r} datasheet peak x 0.55 efficiency" in out
    for bad in (0, 1.5, float("nan")):
        spec["groups"][0]["efficiency"] = bad
        with pytest.raises(ValueError, match="efficiency"):
            cluster_from_dict(spec)
    spec["groups"][0].update(efficiency=0.5, profile="x.json", device=None)
    with pytest.raises(ValueError, match="efficiency"):
        cluster_from_dict(spec)
