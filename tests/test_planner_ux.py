"""Planner follow-ups of issue 14 found by a new-user run (session 10): the plan records the sequence
length it was made for and training checks it; a memory headroom option; memory in GiB in errors as in
tables; ``--seq-len`` above the model's positions, a missing cluster file and a misspelled cluster key
give clear errors.

References are independent of the code under test: the device catalog's capacities (bytes) for the
headroom and the GiB figures, the YAML file itself for a training config's sequence length, the
exhaustive enumeration (``exhaustive_search``) for the search's exactness under a headroom.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hethub_jax.parallel.plan import Plan
from hethub_jax.plan import main
from hethub_jax.planner import SearchOptions, cluster_from_dict, load_cluster, load_model, search
from hethub_jax.planner.catalog import get_device
from search_checks import assert_search_equals_exhaustive

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "configs" / "clusters"
TINY2 = CLUSTERS / "tiny_2island_cpu.yaml"
MIXED = CLUSTERS / "mixed_h100_mi300x.yaml"


def small_model(layers=4):
    return load_model({"preset": "tiny", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512})


# ---- 1. the plan records its sequence length -------------------------------------------------------

def test_every_planned_plan_records_the_seq_len_it_was_searched_for(tmp_path, capsys):
    res = search(small_model(), TINY2, 8, 24, options=SearchOptions(top_k=3))
    assert [c.plan.seq_len for c in res.candidates] == [24] * len(res.candidates)
    out = tmp_path / "plan.json"
    assert main(["--model", "tiny", "--cluster", str(TINY2), "--global-batch", "8", "--seq-len", "32",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["seq_len"] == 32
    assert "sequence length 32 tokens per sample (--seq-len); recorded in the plan" in capsys.readouterr().out
    Plan.from_json(out).validate(load_model("tiny"))


def test_plans_without_seq_len_still_load_and_do_not_write_it():
    for path in sorted((ROOT / "configs" / "plans").glob("*.json")):
        plan = Plan.from_json(path)
        assert plan.seq_len is None and "seq_len" not in plan.to_dict()
    d = json.loads((ROOT / "configs" / "plans" / "tiny_2island.json").read_text())
    with pytest.raises(ValueError, match="seq_len 1024 .* exceeds the model's max_position_embeddings 512"):
        Plan.from_dict(d | {"seq_len": 1024}).validate(load_model("tiny"))


def test_a_training_config_file_gives_the_planner_its_seq_len(tmp_path, capsys):
    from hethub_jax.planner.api import config_seq_len
    expected = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["data"]["seq_len"]
    assert config_seq_len(str(ROOT / "configs" / "tiny.yaml")) == expected
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny\ndata: {seq_len: 48}\n")
    out = tmp_path / "plan.json"
    assert main(["--model", str(cfg), "--cluster", str(TINY2), "--global-batch", "8", "--out", str(out)]) == 0
    assert "sequence length 48 tokens per sample (data.seq_len of" in capsys.readouterr().out
    assert Plan.from_json(out).seq_len == 48
    assert config_seq_len("tiny") is None


def _plan_file(tmp_path: Path, seq_len: int) -> Path:
    d = json.loads((ROOT / "configs" / "plans" / "tiny_single.json").read_text())
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d | {"seq_len": seq_len}))
    return path


def test_training_refuses_a_longer_seq_len_than_the_plan_and_warns_for_a_shorter_one(tmp_path, capsys):
    from hethub_jax.config import load_config
    from hethub_jax.train import _resolve_plan, check_plan_seq_len
    plan = Plan.from_json(_plan_file(tmp_path, 64))
    assert check_plan_seq_len(plan, 64) is None
    assert check_plan_seq_len(plan.replace(seq_len=None), 999) is None  # hand-written: not recorded
    with pytest.raises(ValueError, match=r"made for sequence length 64 .* data.seq_len 128.*--seq-len 128"):
        check_plan_seq_len(plan, 128)
    assert check_plan_seq_len(plan, 32).startswith("WARNING: ")
    cfg = load_config(None, flags={"train.plan": str(_plan_file(tmp_path, 256))})
    _, notes = _resolve_plan(cfg, "cpu")
    assert any("made for sequence length 256" in n and "data.seq_len 128" in n for n in notes), notes
    rc = main_train(["--plan", str(_plan_file(tmp_path, 64))])
    err = capsys.readouterr().err
    assert rc == 2 and "made for sequence length 64" in err and "data.seq_len 128" in err, err


def main_train(args):
    import os

    from hethub_jax.train import main as train_main
    return train_main([*args, "--no-checkpoint", "--metrics-file", os.devnull, "--no-progress"])


# ---- 2. memory headroom ----------------------------------------------------------------------------

def _cap(cluster, island: str) -> int:
    return get_device(load_cluster(cluster).group(island).device).memory_bytes


def test_headroom_keeps_every_stage_below_the_capacity_fraction_and_changes_the_filled_plan():
    """The mixed H100 + MI300X cluster's best llama3-70b plan at headroom 0 fills more than 95% of a
    device (the new-user finding: 176.6 of 178.8 GiB on MI300X); with headroom 0.05 every stage of
    every candidate stays within 95% of its device's datasheet capacity."""
    cfg = load_model("llama3-70b")
    full = search(cfg, MIXED, 64, 4096, options=SearchOptions(top_k=1, memory_headroom=0.0)).best
    assert max(sp.memory.total / _cap(MIXED, sp.island) for sp in full.prediction.stages) > 0.95
    res = search(cfg, MIXED, 64, 4096, options=SearchOptions(top_k=3))  # the default headroom
    assert SearchOptions().memory_headroom == 0.05
    for c in res.candidates:
        for sp in c.prediction.stages:
            assert sp.memory.total <= 0.95 * _cap(MIXED, sp.island)
    assert res.best.step_time_s > full.step_time_s  # the filled plan was the faster one


def test_search_is_exact_under_a_binding_headroom():
    """Headroom that binds (the limit below the headroom-0 best plan's largest stage): the search
    equals exhaustive enumeration under the same option, and its best plan respects the limit."""
    cfg, cluster = small_model(), cluster_from_dict({"groups": [
        {"name": "a", "device": "cpu", "nodes": 1, "devices_per_node": 2},
        {"name": "b", "device": "cpu", "nodes": 1, "slowdown": 2.0}]})
    base = search(cfg, cluster, 8, 16, options=SearchOptions(top_k=1, memory_headroom=0.0, hetero_dp=False)).best
    cap = get_device("cpu").memory_bytes
    worst = max(sp.memory.total for sp in base.prediction.stages)
    h = 1 - 0.9 * worst / cap
    opt = SearchOptions(top_k=2, memory_headroom=h, hetero_dp=False)
    assert_search_equals_exhaustive(cfg, cluster, 8, 16, opt)
    best = search(cfg, cluster, 8, 16, options=opt).best
    assert max(sp.memory.total for sp in best.prediction.stages) <= (1 - h) * cap
    assert best.step_time_s >= base.step_time_s and best.plan != base.plan


def test_cli_memory_headroom_flag_is_shown_and_checked(capsys):
    args = ["--model", "tiny", "--cluster", str(TINY2), "--global-batch", "8", "--seq-len", "32"]
    assert main([*args, "--memory-headroom", "0.2"]) == 0
    assert "memory headroom 20% (--memory-headroom 0.2)" in capsys.readouterr().out
    assert main([*args, "--json", "--no-upper-bound"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_headroom"] == 0.05
    assert main([*args, "--memory-headroom", "1"]) == 2
    assert "--memory-headroom" in capsys.readouterr().err


# ---- 3. one memory unit: GiB -----------------------------------------------------------------------

def test_infeasible_memory_error_gives_gib_like_the_tables(capsys):
    assert main(["--model", "llama3-405b", "--cluster", str(TINY2), "--global-batch", "8",
                 "--memory-headroom", "0"]) == 2
    err = capsys.readouterr().err
    gib = get_device("cpu").memory_bytes / 2**30
    assert f"{gib:.2f} GiB per device" in err and " GB " not in err, err


# ---- 4.-6. clear input errors ----------------------------------------------------------------------

def test_seq_len_above_max_position_embeddings_is_a_clear_error_not_a_memory_failure(capsys):
    max_pos = load_model("tiny").max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the model's max_position_embeddings {max_pos}"):
        search(load_model("tiny"), TINY2, 8, 2 * max_pos)
    assert main(["--model", "tiny", "--cluster", str(TINY2), "--global-batch", "8", "--seq-len",
                 str(2 * max_pos)]) == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings" in err and "memory" not in err, err


def test_missing_cluster_file_names_the_file_and_the_flag(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert main(["--model", "tiny", "--cluster", str(missing), "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert f"--cluster: file not found: {missing}" in err and "Errno" not in err, err
    with pytest.raises(FileNotFoundError, match="cluster spec file not found: .*nope.yaml"):
        load_cluster(missing)


@pytest.mark.parametrize("spec, key, hint", [
    ({"groups": [{"name": "a", "device": "cpu", "node": 1}]}, "groups.0 (a).node", "nodes"),
    ({"groups": [{"name": "a", "devise": "cpu", "nodes": 1}]}, "groups.0 (a).devise", "device"),
    ({"group": [{"name": "a", "device": "cpu", "nodes": 1}]}, "group", "groups"),
])
def test_misspelled_cluster_key_is_reported_alone_with_a_suggestion(spec, key, hint, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError) as e:
        load_cluster(path)
    lines = str(e.value).splitlines()
    assert lines[1:] == [f"  {key}: unknown key (did you mean {hint!r}?)"], str(e.value)


def test_a_misspelled_config_or_plan_key_gets_the_closest_known_key():
    from hethub_jax.data.config import DataConfig
    from hethub_jax.typed import unknown_keys
    with pytest.raises(ValueError, match=r"unknown data config key\(s\) \['seqlen'\]; known keys: .*; did you "
                                         r"mean 'seq_len' for 'seqlen'\?$"):
        unknown_keys(DataConfig, {"seqlen": 3}, "data config")
    d = json.loads((ROOT / "configs" / "plans" / "tiny_2island.json").read_text())
    with pytest.raises(ValueError, match=r"unknown key 'seq_lne' in plan; allowed keys: .*; did you mean 'seq_len'\?$"):
        Plan.from_dict(d | {"seq_lne": 32})
    with pytest.raises(ValueError, match=r"unknown key 'zzz' in plan; allowed keys: \[[^]]*\]$"):
        Plan.from_dict(d | {"zzz": 32})
