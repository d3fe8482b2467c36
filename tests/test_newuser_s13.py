"""New-user leftovers of session 13 (s13-misc): unused devices are named, the plan CLI heads the chosen
plan as such, input errors print once under mpiexec, the outputs line keeps the user's path forms.

References are independent of the code under test: device counts and stage layouts read from the plan
JSON files themselves, the forced XLA host device count the test sets, the paths the test passes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hethub_jax.parallel.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
TWO_ISLAND = ROOT / "configs" / "plans" / "tiny_2island.json"


def _train(args, env_extra=None, timeout=240, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "hethub_jax.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


# ---- 1. devices the plan leaves idle are named, with the way to use them ---------------------------

def test_unused_devices_note_names_the_idle_indices_of_one_process():
    from hethub_jax.train import default_plan, unused_devices_note
    plan = default_plan(8, 4, 6)
    note = unused_devices_note(plan, {"cpu": 4}, built_in=True)
    assert note.startswith("WARNING: unused devices") and "has 4 cpu device(s), the plan uses 1" in note, note
    assert "unused: 1-3" in note and "built-in plan" in note and "dp" in note and "--cluster" in note, note
    assert unused_devices_note(plan, {"cpu": 1}, built_in=True) is None
    raw = json.loads(TWO_ISLAND.read_text())
    two = Plan.from_dict(raw)
    # one process runs both islands on the same devices (indices from 0): the widest island's dp*tp
    widest = max(s["dp"] * s["tp"] for s in raw["stages"])
    assert unused_devices_note(two, {"cpu": widest}) is None
    assert f"unused: {widest}" in unused_devices_note(two, {"cpu": widest + 1})


def test_unused_devices_note_per_mpi_rank():
    from hethub_jax.train import unused_devices_note
    raw = json.loads(TWO_ISLAND.read_text())
    plan = Plan.from_dict(raw)
    need = [i["devices_per_process"] for i in raw["islands"]]  # ranks in island order, one process each
    assert unused_devices_note(plan, dict(enumerate(need))) is None
    note = unused_devices_note(plan, {0: need[0], 1: need[1] + 2})
    name = raw["islands"][1]["name"]
    assert f"rank 1 (island {name}) has {need[1] + 2} cpu device(s), the plan uses {need[1]}" in note, note
    assert "rank 0" not in note


def test_train_warns_about_unused_forced_host_devices(tmp_path):
    p = _train(["--steps", "1", "--no-checkpoint", "--no-progress", "--metrics-file", str(tmp_path / "m.jsonl"),
                "--set", "train.eval_at_start=false", "--set", "model.num_hidden_layers=1"],
               {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"})
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if "unused devices" in x)
    assert "3 cpu device(s), the plan uses 1" in line and "unused: 1-2" in line, line


# ---- 2. the plan CLI heads the chosen plan as such, the others as alternatives ---------------------

def test_plan_cli_heads_the_written_plan_chosen_and_the_others_alternatives(tmp_path, capsys):
    import re

    from hethub_jax.plan import main as plan_main
    out = tmp_path / "plan.json"
    assert plan_main(["--model", "llama3-8b", "--cluster", str(ROOT / "configs/clusters/mixed_h100_mi300x.yaml"),
                      "--global-batch", "64", "--seq-len", "2048", "--top", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    heads = [x for x in text.splitlines() if " - PREDICTED: step " in x]
    assert len(heads) == 2 and heads[0].startswith("Chosen plan (pipeline)"), heads
    assert heads[1].startswith("Alternative 1 (pipeline; step +") and "Candidate" not in text, heads
    steps = [float(re.search(r"PREDICTED: step ([\d.]+) s", h).group(1)) for h in heads]
    pct = float(re.search(r"step \+([\d.]+)% vs the chosen plan", heads[1]).group(1))
    assert abs(pct - 100 * (steps[1] / steps[0] - 1)) < 0.1 + 1e-9  # the printed step times round to 4 digits
    # the chosen table is the plan --out wrote: its first stage's layer range and DP x TP
    plan = json.loads(out.read_text())
    st = plan["stages"][0] if "stages" in plan else plan["replicas"][0]["stages"][0]
    chosen = text.split("Chosen plan (")[1].split("Alternative 1 (")[0]
    row = next(x for x in chosen.splitlines() if re.match(r"\s+0\s+0\s", x))
    assert f"{st['dp']} x {st['tp']}" in row and f"{st['first_layer']}-{st['last_layer']}" in row, (row, st)
    assert f"chosen plan written to {out}" in text
    assert plan_main(["--model", "llama3-8b", "--cluster", str(ROOT / "configs/clusters/mixed_h100_mi300x.yaml"),
                      "--global-batch", "64", "--seq-len", "2048", "--top", "2", "--json", "--no-upper-bound"]) == 0
    cands = json.loads(capsys.readouterr().out)["candidates"]
    assert [c["chosen"] for c in cands] == [True, False] and cands[0]["plan"] == plan


# ---- 4. the outputs line keeps the path forms the user gave -----------------------------------------

def test_planned_dir_keeps_the_metrics_file_form():
    from hethub_jax.train import planned_dir
    assert planned_dir("runs/x/m.jsonl") == "runs/x"
    assert planned_dir("/abs/run/m.jsonl") == "/abs/run"
    assert planned_dir("m.jsonl") == os.curdir and planned_dir(None) == os.path.join("runs", "planned")


@pytest.mark.slow
def test_planless_outputs_line_paths_are_as_given(tmp_path):
    """Plan-less training with relative --metrics-file / --trace-file (from the saved profile, no
    profiling): the ``outputs:`` line names every path relative, as given, including plan.json."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train_insight import fixed_profile
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "cpu.json").write_text(json.dumps(fixed_profile()))
    p = _train(["--cluster", str(ROOT / "configs/clusters/tiny_2island_cpu.yaml"), "--profiles", "prof",
                "--steps", "1", "--global-batch-size", "4", "--seq-len", "16", "--no-checkpoint", "--no-progress",
                "--set", "train.eval_at_start=false", "--metrics-file", "run/m.jsonl", "--trace-file", "run/t.json"],
               cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("outputs: "))
    assert "metrics run/m.jsonl" in line and "plan run/plan.json" in line and "trace run/t.json" in line, line
    assert str(tmp_path) not in line and (tmp_path / "run" / "plan.json").exists(), line


# ---- 3. an error found by several ranks after MPI started is printed once ----------------------------

def test_set_up_failed_prints_each_distinct_error_once_by_its_lowest_rank(capsys, monkeypatch):
    from hethub_jax import cluster
    from hethub_jax.train import EXIT_CONFIG_ERROR, _set_up_failed
    failed = {0: "bad plan", 2: "bad plan", 3: "no devices"}
    printed = {}
    for rank in range(4):
        monkeypatch.setenv("PMI_RANK", str(rank))
        monkeypatch.setenv("PMI_SIZE", "4")
        assert _set_up_failed(cluster.SetUpFailed(failed, rank, 4), None) == EXIT_CONFIG_ERROR
        printed[rank] = capsys.readouterr().err
    assert printed[1] == "" and printed[2] == ""  # healthy, and the same error as a lower rank: quiet
    assert printed[0].count("error:") == 1 and "rank 0: bad plan (the same on rank(s) 2)" in printed[0]
    assert printed[3].count("error:") == 1 and "rank 3: no devices" in printed[3] and "same on" not in printed[3]


def test_unused_devices_of_a_planner_chosen_plan_are_a_note_not_advice_to_use_the_planner():
    """Plan-less training (s14 new-user run): the planner chose a plan leaving a device idle; the line
    says so instead of a WARNING advising --cluster, which the user already gave."""
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.train import unused_devices_note

    plan = Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu", "devices_per_process": 1},
                                       {"name": "slow", "platform": "cpu", "devices_per_process": 1}],
                           "replicas": [{"stages": [{"island": "fast", "first_layer": 0, "last_layer": 1}]},
                                        {"stages": [{"island": "slow", "first_layer": 0, "last_layer": 1}]}],
                           "global_batch_size": 4, "microbatch_size": 2})
    note = unused_devices_note(plan, {0: 2, 1: 1}, planned="c.yaml")
    # session 17: a short summary (the per-rank indices are in the metrics' run record: test_newuser_s17)
    assert note.startswith("devices left idle: 1 of 2 on island fast: unused by the planner's"), note
    assert "PREDICTED" in note and len(note) < 120
    assert "WARNING" not in note and "--cluster CLUSTER.yaml" not in note
    assert unused_devices_note(plan, {0: 1, 1: 1}, planned="c.yaml") is None
    assert unused_devices_note(plan, {0: 2, 1: 1}).startswith("WARNING: unused devices")
