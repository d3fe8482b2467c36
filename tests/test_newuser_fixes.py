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
