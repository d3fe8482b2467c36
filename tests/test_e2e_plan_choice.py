"""The planner's choice for the end-to-end benchmark's cluster (issue 17, branch s9-e2e): recompute
ties, profile coverage of the microbatch sizes the planner may choose."""

import numpy as np
import pytest

from hethub_jax.parallel.plan import Plan
from hethub_jax.parallel.runtime import PipelineRuntime
from test_runtime_equivalence import OPTIM, batches, model_config

CALLS = ("forward", "forward_saving", "backward_saved", "backward_recompute", "forward_backward")


def _dp_plan(recompute: str, schedule: str = "1f1b") -> Plan:
    """Two one-stage replicas on two in-process islands (heterogeneous DP's shape), 3 microbatches each."""
    reps = [{"stages": [{"island": f"i{i}", "first_layer": 0, "last_layer": 10}], "batch_share": 3}
            for i in range(2)]
    return Plan.from_dict({"islands": [{"name": "i0", "platform": "cpu"}, {"name": "i1", "platform": "cpu"}],
                           "replicas": reps, "global_batch_size": 6, "microbatch_size": 1, "schedule": schedule,
                           "recompute": recompute})


def _run_counting(plan: Plan, data) -> tuple:
    """(calls of each stage function over all stages, the flat parameters after the steps)."""
    rt = PipelineRuntime(plan, model_config(False), OPTIM, seed=7)
    counts = dict.fromkeys(CALLS, 0)
    for st in rt.stages.values():
        for name in CALLS:
            fn = getattr(st, name, None)
            if fn is None:
                continue

            def counted(*a, _fn=fn, _name=name, **k):
                counts[_name] += 1
                return _fn(*a, **k)
            setattr(st, name, counted)
    for b in data:
        rt.train_step(b)
    params = {f"{k}/{n}": np.asarray(v) for k, st in rt.stages.items() for n, v in st.flat().items()}
    return counts, params


def test_recompute_full_runs_the_same_calls_as_none_when_every_forward_is_fused():
    """One-stage replicas under 1F1B: every F is directly followed by its own B, so the runtime runs one
    fused forward+backward per microbatch whatever the recompute policy (runtime ``_forward``): the
    same calls, the same parameters bit for bit. (Independent of the predictor: the runtime itself.)"""
    data = batches(6, n=2)
    c_none, p_none = _run_counting(_dp_plan("none"), data)
    c_full, p_full = _run_counting(_dp_plan("full"), data)
    assert c_none == c_full
    assert c_none["forward_backward"] == 2 * 6 and sum(c_none.values()) == c_none["forward_backward"]
    assert p_none.keys() == p_full.keys()
    for k in p_none:
        np.testing.assert_array_equal(p_none[k], p_full[k])
    # under GPipe (F0 F1 F2 B0 B1 B2: no forward directly followed by its own backward) the policy
    # matters: every backward recomputes its forward, so the check above would catch a runtime that
    # ignored the policy
    plan = _dp_plan("full", "gpipe")
    assert [str(a) for a in plan.actions(0)[0]] == ["F0", "F1", "F2", "B0", "B1", "B2"]
    c_gpipe_full, _ = _run_counting(plan, data[:1])
    assert c_gpipe_full["backward_recompute"] == 2 * 3 and c_gpipe_full["forward_backward"] == 0


def test_planner_breaks_a_recompute_tie_towards_none():
    """The e2e benchmark's cluster at global batch 32 (catalog costs): the recompute policies of the
    best hetero-DP plan predict the same step (a tie), and the planner then chooses ``none`` (the JSON
    order alone chose ``full``, which reads as costing a third more compute)."""
    import sys
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.hetero_e2e import MODEL, cluster
    from hethub_jax.models.config import LlamaConfig
    from hethub_jax.planner import SearchOptions, cluster_from_dict, search
    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search import bridge_for, group_costs
    cfg, cl = LlamaConfig(**MODEL), cluster_from_dict(cluster(3.0))
    res = search(cfg, cl, 32, 64, costs=group_costs(cl), options=SearchOptions(top_k=4))
    best = res.best.plan
    assert best.recompute == "none"
    other = Plan.from_dict(dict(best.to_dict(), recompute="full"))
    costs = group_costs(cl)
    br = bridge_for(cl, [("fast", "slow")])
    if best.num_replicas > 1:  # the tie this test is about: every forward fused with its backward
        assert predict(cfg, other, costs, seq_len=64, bridge=br).step_time_s == pytest.approx(
            predict(cfg, best, costs, seq_len=64, bridge=br).step_time_s, rel=1e-12)


# ---- profile coverage of the planner's microbatch sizes ----------------------------------------------

def _profile_at(sizes, seq=64):
    """A profile dict whose stage samples were measured at ``sizes`` (only what coverage reads)."""
    return {"seq_len": seq, "samples": [{"kind": "stage", "tokens": m * seq, "phase": "F"} for m in sizes]
            + [{"kind": "update", "params": 10}]}


def test_planner_microbatch_sizes_are_the_divisors_it_searches():
    from hethub_jax.train_predict import planner_microbatch_sizes
    assert planner_microbatch_sizes(12) == [1, 2, 3, 4, 6, 12]
    assert planner_microbatch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert planner_microbatch_sizes(16, 4) == [4]
    with pytest.raises(ValueError, match="divide the global batch"):
        planner_microbatch_sizes(16, 3)


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8, 16, 32], [1, 2, 3, 4, 6, 12], [4], [8], [1]])
def test_profiled_sizes_span_every_size_the_planner_may_choose(sizes):
    from hethub_jax.train_predict import microbatch_sizes_to_profile
    got = microbatch_sizes_to_profile(sizes)
    assert got == sorted(set(got)) and {1, 2} <= set(got)
    assert all(got[0] <= m <= got[-1] for m in sizes)
    powers = microbatch_sizes_to_profile(sizes, every_power_of_two=True)
    assert set(got) <= set(powers) and all(p in powers for p in (4, 8, 16) if p < max(sizes))


def test_extrapolation_is_said_for_a_plan_beyond_the_profiled_sizes():
    """The session-7 case: a hetero-DP plan at microbatch 8 with profiles of microbatch 1, 2, 4."""
    from hethub_jax.train_predict import extrapolation_note, profiled_microbatch_sizes
    assert profiled_microbatch_sizes(_profile_at([4, 1, 2])) == [1, 2, 4]
    assert profiled_microbatch_sizes(None) == []
    reps = [{"stages": [{"island": n, "first_layer": 0, "last_layer": 7}], "batch_share": s}
            for n, s in (("fast", 24), ("slow", 8))]
    plan = lambda m: Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu"},
                                                 {"name": "slow", "platform": "cpu", "slowdown": 3.0}],
                                     "replicas": reps, "global_batch_size": 32, "microbatch_size": m})
    note = extrapolation_note(plan(8), {"fast": _profile_at([1, 2, 4]), "slow": _profile_at([1, 2, 4, 8])})
    assert note is not None and "EXTRAPOLATED" in note and "fast (microbatch 8; profiled 1, 2, 4)" in note
    assert "slow" not in note.split("EXTRAPOLATED")[1].split(":")[0]
    assert extrapolation_note(plan(4), {"fast": _profile_at([1, 2, 4]), "slow": _profile_at([1, 2, 4])}) is None
    assert extrapolation_note(plan(8), {"fast": None, "slow": None}) is None  # catalog costs: no profile


def test_planless_training_profiles_up_to_the_global_batch(tmp_path, monkeypatch):
    """``--cluster`` without a saved profile: the child profiler is asked for sizes spanning every
    microbatch the planner may choose (global batch 16: up to 16), and the plan lines say nothing of
    extrapolation; a saved profile of other sizes is reused and the extrapolation is said."""
    import json
    import os
    from hethub_jax import train_predict as tp
    from hethub_jax.models.config import get_preset
    from test_train_insight import ROOT, fixed_profile, write_fake_profile
    asked, asked_tp = [], []

    def fake_profile(model, seq_len, out, timeout_s=600.0, microbatch_sizes=(1, 2), tp_degrees=(1,),
                     dp_degrees=(), dp_microbatch_sizes=(), chunked_microbatch_sizes=()):
        asked.append(tuple(microbatch_sizes))
        asked_tp.append(tuple(tp_degrees))
        return write_fake_profile(fixed_profile(), seq_len, out, microbatch_sizes, tp_degrees, dp_degrees,
                                  dp_microbatch_sizes)
    monkeypatch.setattr(tp, "profile_device", fake_profile)
    cluster = str(ROOT / "configs/clusters/tiny_2island_cpu.yaml")
    msg = tp._plan_rank0(get_preset("tiny"), "tiny", cluster, 16, 32, None, str(tmp_path / "p"), lambda m: None)
    assert asked and asked[0][0] == 1 and asked[0][-1] == 16
    # the fast group's 2 devices per node allow TP 2 (tiny: 4 heads): profiled, not extrapolated
    assert asked_tp == [(1, 2)]
    assert not any("EXTRAPOLATED" in x for x in msg["lines"])
    prof = json.loads((tmp_path / "p" / "cpu.json").read_text())
    prof["samples"] = [{"kind": "stage", "tokens": 32}]  # a saved profile of microbatch 1 only
    os.makedirs(tmp_path / "q")
    (tmp_path / "q" / "cpu.json").write_text(json.dumps(prof))
    msg = tp._plan_rank0(get_preset("tiny"), "tiny", cluster, 16, 32, 4, str(tmp_path / "q"), lambda m: None)
    assert len(asked) == 1 and any("EXTRAPOLATED" in x and "profiled 1)" in x for x in msg["lines"])


def test_e2e_benchmark_defaults_follow_training():
    """hetero_e2e's two-island runtimes take training's default gradient all-reduce setting (``auto``: the
    warm-up measures both paths and keeps the faster; session 17: before, it forced the bucketed path at
    auto's bucket size, and before session 9 it ran unbucketed), and profile every size the planner may
    choose by default."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.hetero_e2e import parser, runtime_grad_buckets
    from hethub_jax.train import config_field_default
    args = parser().parse_args(["--json", "x.json"])
    assert args.bucket_mb == config_field_default("train.grad_bucket_mb") == "auto"
    assert runtime_grad_buckets(args.bucket_mb) == "auto"
    assert args.profile_mbs == "auto" and args.batch == 64
    forced = parser().parse_args(["--json", "x.json", "--bucket-mb", "25"])
    assert runtime_grad_buckets(forced.bucket_mb) == 25.0
    assert runtime_grad_buckets(parser().parse_args(["--json", "x", "--bucket-mb", "0"]).bucket_mb) is None
    for bad in ("-1", "fast", "nan"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--json", "x.json", "--bucket-mb", bad])


def test_tp_degrees_profiled_are_those_the_planner_may_choose():
    """Every divisor of a group's devices per node that the model's heads allow (check_tp), and 1."""
    from types import SimpleNamespace as NS
    from hethub_jax.models.config import get_preset
    from hethub_jax.parallel.rules import check_tp
    from hethub_jax.train_predict import tp_degrees_to_profile
    cfg = get_preset("tiny")
    groups = [NS(devices_per_node=8), NS(devices_per_node=3), NS(devices_per_node=None)]
    got = tp_degrees_to_profile(cfg, groups)
    expect = [1] + [t for t in range(2, 9) if any(n % t == 0 for n in (8, 3))
                    and not _raises(check_tp, cfg, t)]
    assert got == sorted(set(expect)) and 1 in got
    assert tp_degrees_to_profile(cfg, [NS(devices_per_node=1)]) == [1]


def _raises(f, *a) -> bool:
    try:
        f(*a)
    except ValueError:
        return True
    return False


def test_extrapolation_is_said_for_a_tp_degree_not_profiled():
    """A plan at TP 2 from a profile of TP 1 only: its TP-2 costs are a scaled guess, and said so."""
    from hethub_jax.train_predict import extrapolation_note, profiled_tp_degrees
    prof1 = _profile_at([1, 2, 4])
    prof12 = dict(prof1, samples=[dict(x, tp=t) for x in prof1["samples"] for t in (1, 2)])
    assert profiled_tp_degrees(prof1) == [1] and profiled_tp_degrees(prof12) == [1, 2]
    plan = Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu", "devices_per_process": 2}],
                           "replicas": [{"stages": [{"island": "fast", "first_layer": 0, "last_layer": 7,
                                                     "tp": 2}]}],
                           "global_batch_size": 4, "microbatch_size": 2})
    note = extrapolation_note(plan, {"fast": prof1})
    assert note is not None and "fast (TP 2; profiled TP 1" in note
    assert extrapolation_note(plan, {"fast": prof12}) is None
