"""One validity rule per constraint: the TP rule and the batch rules that the plan, the training
config, train.py, the runtime and PipelineStage share (hethub_jax/parallel/rules.py)."""
from types import SimpleNamespace

import jax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hethub_jax.config import ConfigError, from_dict
from hethub_jax.models.config import LlamaConfig
from hethub_jax.optim import OptimConfig, make_optimizer
from hethub_jax.parallel.plan import Plan
from hethub_jax.parallel.rules import check_batch, check_shares, check_tp
from hethub_jax.parallel.stage import PipelineStage

NUM_DEVICES = 4  # tests/conftest.py: --xla_force_host_platform_device_count=4


@pytest.mark.parametrize("heads, kv, ffn, tp, match", [
    (4, 2, 8, 3, r"divide the number of attention heads: s has tp=3, model has 4 heads"),
    (12, 3, 12, 4, r"divide the number of KV heads or be a multiple of it .*s has tp=4, model has 3 KV heads"),
    (4, 2, 10, 4, r"divide intermediate_size .*s has tp=4, model has intermediate_size 10"),
    (4, 2, 8, 0, r"TP degree must be >= 1: s has tp=0"),
])
def test_tp_rule_names_the_constraint(heads, kv, ffn, tp, match):
    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ffn)
    with pytest.raises(ValueError, match=match):
        check_tp(cfg, tp, "s")


def test_tp_rule_accepts():
    check_tp(SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, intermediate_size=12), 4)  # KV replicated
    check_tp(SimpleNamespace(num_attention_heads=8, num_key_value_heads=None), 8)  # no intermediate_size given
    check_tp(LlamaConfig(vocab_size=7, hidden_size=8, intermediate_size=4, num_hidden_layers=1,
                         num_attention_heads=2), 2)  # vocabulary 7: embedding and head replicated


def test_plan_rejects_tp_that_does_not_divide_the_mlp():
    """Before the shared rule the plan accepted tp=2 over intermediate_size 5, which the stage rejected."""
    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=5, num_hidden_layers=1, num_attention_heads=2)
    plan = Plan.from_dict({"islands": [{"name": "a", "platform": "cpu", "devices_per_process": 2}],
                           "stages": [{"island": "a", "tp": 2, "first_layer": 0, "last_layer": 0}],
                           "global_batch_size": 2, "microbatch_size": 1})
    with pytest.raises(ValueError, match=r"divide intermediate_size.*replicas\[0\].stages\[0\] has tp=2"):
        plan.validate(cfg)
    with pytest.raises(ValueError, match="intermediate_size"):
        PipelineStage(cfg, 0, 0, jax.devices()[:2], 1, 2, seed=0, recompute=False,
                      optimizer=make_optimizer(OptimConfig()))


def test_batch_rules_shared_by_plan_and_config():
    with pytest.raises(ValueError, match=r"^train\.global_batch_size must be divisible by train\.microbatch_size: 6 % 4 = 2$"):
        check_batch(6, 4, prefix="train.")
    with pytest.raises(ConfigError, match=r"^train\.global_batch_size must be divisible by train\.microbatch_size: 6 % 4 = 2$"):
        from_dict({"train": {"global_batch_size": 6, "microbatch_size": 4}})
    with pytest.raises(ValueError, match=r"microbatch_size must be divisible by each stage's dp: microbatch_size 3, x has dp=2"):
        check_batch(6, 3, {"x": 2})
    check_batch(8, 4, {"x": 2, "y": 4})
    with pytest.raises(ValueError, match=r"replicas\[1\] has batch_share 3, microbatch_size 2"):
        check_shares([4, 3], 7, 2)
    with pytest.raises(ValueError, match=r"sums to 6, global_batch_size is 8"):
        check_shares([4, 2], 8, 2)
    check_shares([6, 2], 8, 2)


# ---- property: a plan validates if and only if every stage builds -------------------------------

@st.composite
def model_and_plan(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    kv = draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0]))
    head_dim = draw(st.sampled_from([2, 4]))
    layers = draw(st.integers(1, 3))
    cfg = LlamaConfig(vocab_size=draw(st.integers(5, 16)), hidden_size=heads * head_dim,
                      intermediate_size=draw(st.integers(2, 12)), num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=16)
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), max_size=1))) if layers > 1 else []
    bounds = [0, *cuts, layers]
    stages = []
    for first, end in zip(bounds, bounds[1:]):
        tp = draw(st.sampled_from([1, 2, 3, 4]))
        dp = draw(st.sampled_from([d for d in (1, 2) if d * tp <= NUM_DEVICES]))
        stages.append({"island": "cpu", "dp": dp, "tp": tp, "first_layer": first, "last_layer": end - 1,
                       "devices": list(range(dp * tp))})
    plan = Plan.from_dict({"islands": [{"name": "cpu", "platform": "cpu", "devices_per_process": NUM_DEVICES}],
                           "stages": stages, "global_batch_size": 4, "microbatch_size": 2})
    return cfg, plan


def _builds(cfg, plan) -> bool:
    devices = jax.devices()
    try:
        for s, spec in enumerate(plan.replicas[0].stages):
            PipelineStage(cfg, spec.first_layer, spec.last_layer, [devices[i] for i in plan.stage_devices(0, s)],
                          spec.dp, spec.tp, seed=0, recompute=False, optimizer=make_optimizer(OptimConfig()))
    except ValueError:
        return False
    return True


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_plan())
def test_plan_validates_iff_every_stage_builds(case):
    cfg, plan = case
    try:
        plan.validate(cfg)
        valid = True
    except ValueError:
        valid = False
    assert valid == _builds(cfg, plan), (cfg, plan)


def test_runtime_support_refuses_several_stages_on_a_multiprocess_island_only():
    from hethub_jax.parallel.rules import check_runtime_support
    from hethub_jax.plan import candidate_dict, format_candidate

    def plan(a_procs, stages):
        return Plan.from_dict({
            "islands": [{"name": "a", "platform": "cpu", "num_processes": a_procs, "devices_per_process": 2},
                        {"name": "b", "platform": "cpu"}],
            "stages": stages, "global_batch_size": 8, "microbatch_size": 2})
    two_on_a = [{"island": "a", "first_layer": 0, "last_layer": 3}, {"island": "a", "first_layer": 4, "last_layer": 7},
                {"island": "b", "first_layer": 8, "last_layer": 10}]
    one_on_a = [{"island": "a", "first_layer": 0, "last_layer": 7}, {"island": "b", "first_layer": 8, "last_layer": 10}]
    with pytest.raises(ValueError, match=r"island .a. has 2 processes and runs stages \[\(0, 0\), \(0, 1\)\]"):
        check_runtime_support(plan(2, two_on_a))
    check_runtime_support(plan(1, two_on_a))     # one process drives both stages: runs today
    check_runtime_support(plan(2, one_on_a))     # one stage over both processes: runs today

    class _Cand:  # what the plan CLI prints and writes for a planner candidate
        def __init__(self, p):
            from hethub_jax.planner.costs import DeviceCosts
            from hethub_jax.planner.catalog import get_device
            from hethub_jax.planner.predictor import predict
            costs = {i.name: DeviceCosts.from_catalog(get_device("cpu")) for i in p.islands}
            self.plan, self.kind, self.layers = p, "pipeline", ()
            self.prediction = predict(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                  num_hidden_layers=11, num_attention_heads=2), p, costs, seq_len=16)
            self.step_time_s, self.tokens_per_s = self.prediction.step_time_s, self.prediction.tokens_per_s
            self.mfu, self.upper_bound_fraction = 0.0, 0.0

    class _G:
        device, memory_gb = "cpu", 1.0
    groups = {"a": _G(), "b": _G()}
    bad, good = _Cand(plan(2, two_on_a)), _Cand(plan(2, one_on_a))
    assert "NOT RUNNABLE YET: island 'a'" in format_candidate(0, bad, groups, None)
    assert "NOT RUNNABLE" not in format_candidate(0, good, groups, None)
    assert candidate_dict(bad)["runnable"] is False and "island 'a'" in candidate_dict(bad)["not_runnable_because"]
    assert candidate_dict(good)["runnable"] is True and candidate_dict(good)["not_runnable_because"] is None
