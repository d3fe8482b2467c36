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
