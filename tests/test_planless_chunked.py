"""Plan-less training's brief profile measures the bucketed all-reduce's chunked last microbatch (issue 17,
session 16): ``train_predict`` asks the profiler for it at the planner's smallest and largest microbatch
sizes, the profiler writes ``fits.chunked_last``, and the predictor's banner then reads the MEASURED ratio
instead of saying 'not measured (1.0)'."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from hethub_jax import train_predict as tp  # noqa: E402


def test_chunked_sizes_are_the_planners_smallest_and_largest_up_to_16():
    # README's main command: global batch 16, the planner's sizes are the divisors of 16
    assert tp.chunked_microbatch_sizes_to_profile(tp.planner_microbatch_sizes(16)) == [1, 16]
    assert tp.chunked_microbatch_sizes_to_profile([1, 2, 4, 8, 16, 32, 64]) == [1, 16]
    assert tp.chunked_microbatch_sizes_to_profile([4]) == [4]
    assert tp.chunked_microbatch_sizes_to_profile([32, 64]) == [32]  # none up to 16: the smallest
    with pytest.raises(ValueError):
        tp.chunked_microbatch_sizes_to_profile([])


def test_profiler_chunked_mbs_option():
    from hethub_jax.profile import CHUNKED_MAX_MBS, chunked_microbatch_sizes
    assert CHUNKED_MAX_MBS == tp.CHUNKED_MAX_MBS  # train_predict repeats it (it imports no JAX)
    assert chunked_microbatch_sizes("none", [1, 2], True) == []
    assert chunked_microbatch_sizes("auto", [1, 8, 32], True) == [1, 8]
    assert chunked_microbatch_sizes("auto", [1, 8, 32], False) == []  # auto needs the whole-model shape
    assert chunked_microbatch_sizes("16,1", [1, 2], False) == [1, 16]  # explicit: measured without it
    for bad in ("0", "x", ","):
        with pytest.raises(SystemExit):
            chunked_microbatch_sizes(bad, [1], False)


def test_planless_training_asks_for_the_chunked_measurement(tmp_path, monkeypatch):
    """``_plan_rank0`` (global batch 16) asks the child profiler for the chunked last microbatch at 1 and 16."""
    from hethub_jax.models.config import get_preset
    from test_train_insight import ROOT, fixed_profile, write_fake_profile
    asked = []

    def fake_profile(model, seq_len, out, timeout_s=600.0, microbatch_sizes=(1, 2), tp_degrees=(1,),
                     dp_degrees=(), dp_microbatch_sizes=(), chunked_microbatch_sizes=()):
        asked.append(tuple(chunked_microbatch_sizes))
        return write_fake_profile(fixed_profile(), seq_len, out, microbatch_sizes, tp_degrees, dp_degrees,
                                  dp_microbatch_sizes)
    monkeypatch.setattr(tp, "profile_device", fake_profile)
    logged = []
    cluster = str(ROOT / "configs/clusters/tiny_2island_cpu.yaml")
    tp._plan_rank0(get_preset("tiny"), "tiny", cluster, 16, 32, None, str(tmp_path / "p"), logged.append)
    assert asked == [(1, 16)]
    assert any("--chunked-mbs 1,16" in m for m in logged)


@pytest.mark.slow
def test_planless_profile_of_the_tiny_model_writes_chunked_last(tmp_path):
    """A real brief profile (``profile_device``, the child ``python -m hethub_jax.profile`` of plan-less
    training) of the tiny model at microbatch 1 and 2 with the chunked measurement at both: the profile holds
    ``fits.chunked_last`` at their token counts, with MEASURED positive ratios, and the heterogeneous-DP
    banner line reads them ('MEASURED x... of the fused call', not 'not measured')."""
    from hethub_jax.models.config import get_preset
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.planner import predict_buckets as pbk
    from hethub_jax.planner.costs import DeviceCosts
    out = str(tmp_path / "cpu.json")
    ok, msg = tp.profile_device("tiny", 16, out, microbatch_sizes=(1, 2), chunked_microbatch_sizes=(1, 2))
    assert ok, msg
    prof = json.load(open(out))
    fit = prof["fits"]["chunked_last"]
    assert [t for t, _ in fit["points"]] == [16, 32] and all(r > 0 for _, r in fit["points"])
    samples = [s for s in prof["samples"] if s["kind"] == "chunked_last"]
    assert sorted(s["microbatch_size"] for s in samples) == [1, 2]
    costs = DeviceCosts.from_profile(prof)
    assert pbk.chunked_last_ratio(costs, 16) == (pytest.approx(fit["points"][0][1]), "profile")
    cfg = get_preset("tiny")
    L = cfg.num_hidden_layers
    plan = Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu"},
                                       {"name": "slow", "platform": "cpu", "slowdown": 3.0}],
                           "replicas": [{"stages": [{"island": "fast", "first_layer": 0, "last_layer": L - 1}],
                                         "batch_share": 12},
                                        {"stages": [{"island": "slow", "first_layer": 0, "last_layer": L - 1}],
                                         "batch_share": 4}],
                           "global_batch_size": 16, "microbatch_size": 2, "schedule": "1f1b",
                           "optimizer_sharding": "replicated"})
    run = tp.predict_run(cfg, plan, 16, costs={"fast": costs, "slow": costs}, grad_bucket_mb=25.0)
    line = tp.grad_allreduce_line(run.prediction)
    assert line is not None and "MEASURED x" in line and "not measured" not in line, line
