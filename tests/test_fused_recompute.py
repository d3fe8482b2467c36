"""A last stage whose forward is fused with its backward (the runtime's ``PipelineStage.forward_backward``:
a 1F1B last stage, e.g. each one-stage replica of heterogeneous DP) and the one ranking key of candidates
(``planner.search.rank_key``), session 17.

The fused call is one ``jax.vjp`` of the stage inside one jit; it ignores the recompute policy, so one
microbatch's residuals live while it runs under ``none`` and ``full`` alike. The predictor's memory model
counts exactly that (before: 0 under ``none``), the plan CLI's ``F+B per microbatch`` shows the fused call's
seconds, and the search's top k and ``runnable_result`` (the plan CLI, plan-less training) rank candidates by
the same key."""
from __future__ import annotations

import dataclasses

import pytest

from hethub_jax.parallel.plan import Plan
from hethub_jax.planner import analytic
from hethub_jax.planner.costs import DeviceCosts, LinkModel
from hethub_jax.planner.predictor import predict
from test_predictor import Cfg, chain_plan, fixed_profile

SEQ = 8


def _residuals(cfg, first: int, last: int, tokens: int, tp: int = 1) -> float:
    """One microbatch's residuals of a LAST stage holding layers first..last, from the analytic formulas
    directly (not through ``stage_memory_bytes``): per layer ``layer_activation_bytes`` under ``none``,
    plus the final norm, LM head and loss (``head_activation_bytes``)."""
    a = analytic.dtype_bytes(cfg.dtype)
    return ((last - first + 1) * analytic.layer_activation_bytes(cfg, tokens, SEQ, tp, "none", a)
            + analytic.head_activation_bytes(cfg, tokens, tp, a))


def _dp_plan(recompute: str, schedule: str, mbs: int = 2, shares=(6, 2)) -> Plan:
    """Heterogeneous DP's shape: two one-stage replicas (the whole model each), one per island."""
    reps = [{"stages": [{"island": f"i{i}", "first_layer": 0, "last_layer": Cfg.num_hidden_layers - 1}],
             "batch_share": s} for i, s in enumerate(shares)]
    return Plan.from_dict({"islands": [{"name": "i0", "platform": "cpu"}, {"name": "i1", "platform": "cpu"}],
                           "replicas": reps, "global_batch_size": sum(shares), "microbatch_size": mbs,
                           "schedule": schedule, "recompute": recompute})


T_F, T_B, T_FB = 0.01, 0.02, 0.04  # fixed seconds: F (and F_nosave), B, B_recompute (= the fused F+B; above F + B,
#                                     its floor, so that the fused figure differs from F + B under both policies)


def _predict(plan: Plan):
    costs = DeviceCosts.from_profile(fixed_profile(T_F, T_B, T_FB))
    return predict(Cfg, plan, {i.name: costs for i in plan.islands}, seq_len=SEQ, bridge=LinkModel(0.0, 1e30))


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fused_one_stage_replicas_hold_one_microbatch_of_residuals_under_both_policies(recompute):
    """1F1B one-stage replicas: every forward is fused with its backward. Each replica's PREDICTED activation
    memory is one microbatch's residuals (whole model: every layer plus the head), under either policy; the
    compute per microbatch shown is the fused call's seconds (B_recompute), not F + B."""
    pred = _predict(_dp_plan(recompute, "1f1b"))
    want = _residuals(Cfg, 0, Cfg.num_hidden_layers - 1, tokens=2 * SEQ)
    assert want > 0
    for sp in pred.stages:
        assert sp.memory.activations == pytest.approx(want, rel=1e-12)
        assert sp.compute_s_per_microbatch == pytest.approx(T_FB)


def test_fused_memory_is_the_same_under_both_policies_and_unfused_memory_is_not():
    """The contrast that makes the test above bite: under GPipe (F0 F1 F2 B0 B1 B2, nothing fused) a replica
    of 3 microbatches holds 3 microbatches' residuals under ``none`` and 3 stage inputs + one microbatch's
    residuals under ``full`` (different figures), and its compute per microbatch is F + B of the policy."""
    fused = {r: _predict(_dp_plan(r, "1f1b")) for r in ("none", "full")}
    assert [s.memory for s in fused["none"].stages] == [s.memory for s in fused["full"].stages]
    gp = {r: _predict(_dp_plan(r, "gpipe", mbs=2, shares=(6, 6))) for r in ("none", "full")}
    one = _residuals(Cfg, 0, Cfg.num_hidden_layers - 1, tokens=2 * SEQ)
    inputs = 4.0 * 2 * SEQ  # the first stage's input: int32 token ids
    for sp in gp["none"].stages:
        assert sp.memory.activations == pytest.approx(3 * one, rel=1e-12)
        assert sp.compute_s_per_microbatch == pytest.approx(T_F + T_B)
    for sp in gp["full"].stages:  # F_nosave + B_recompute
        assert sp.memory.activations == pytest.approx(3 * inputs + one, rel=1e-12)
        assert sp.compute_s_per_microbatch == pytest.approx(T_F + T_FB)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_last_stage_of_a_1f1b_pipeline_counts_its_fused_call(recompute):
    """A 2-stage 1F1B pipeline: the last stage (layers 4..7 + head) is fused, one microbatch's residuals under
    both policies; the first stage holds its in-flight microbatches as before (2 under 1F1B)."""
    plan = Plan.from_dict(dict(chain_plan(2, 4, "1f1b").to_dict(), recompute=recompute))
    pred = _predict(plan)
    last, first = pred.stages[1], pred.stages[0]
    assert last.memory.activations == pytest.approx(_residuals(Cfg, 4, 7, tokens=SEQ), rel=1e-12)
    assert last.compute_s_per_microbatch == pytest.approx(T_FB)
    a = analytic.dtype_bytes(Cfg.dtype)
    layer = analytic.layer_activation_bytes(Cfg, SEQ, SEQ, 1, "none", a)
    want_first = 2 * 4 * layer if recompute == "none" else 2 * 4.0 * SEQ + 4 * layer
    assert first.memory.activations == pytest.approx(want_first, rel=1e-12)
    assert first.compute_s_per_microbatch == pytest.approx(T_F + (T_B if recompute == "none" else T_FB))


# ---- against XLA: the compiled fused call ------------------------------------------------------------

@pytest.mark.parametrize("first", [5, 3])
def test_compiled_fused_call_ignores_the_recompute_policy_and_holds_the_predicted_residuals(first):
    """``PipelineStage.forward_backward`` of the tiny preset's last stage (layers ``first``..5 + head), compiled
    with recompute off and on: the same program (same memory analysis: the policy does not reach it). Its
    residuals are those ``forward_saving`` returns (the same ``jax.vjp``), which the predictor's fused
    activations match within 10% (the bar of tests/test_xla_cost.py). The fused call's temporaries (XLA CPU:
    the residuals inside the jit, the backward's intermediates) are at least those PREDICTED activations and
    at most activations + logits, the predictor's whole activation figure of the stage: the model counts
    the call conservatively (inside one jit XLA need not copy the weights into the residuals)."""
    import jax
    import jax.numpy as jnp

    from hethub_jax.models.config import get_preset
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage, StageInputs
    from hethub_jax.planner import xla_cost
    from hethub_jax.planner.predictor import stage_memory_bytes
    cfg = get_preset("tiny")
    L, mbs, seq = cfg.num_hidden_layers, 2, 64
    mems = {}
    for rec in (False, True):
        st = PipelineStage(cfg, first, L - 1, jax.devices()[:1], 1, 1, seed=0, recompute=rec,
                           optimizer=make_optimizer(OptimConfig()))
        tok = jnp.zeros((mbs, seq), jnp.int32)
        inputs = StageInputs(jnp.zeros((mbs, seq, cfg.hidden_size), jnp.float32), tok, tok,
                             jnp.ones((mbs, seq), jnp.float32))
        mems[rec] = xla_cost.memory_of(st.forward_backward.lower(st.params, inputs, None, jnp.bool_(True)).compile())
        saved = xla_cost.memory_of(st.forward_saving.lower(st.params, inputs).compile())
    if mems[False] is None or saved is None:
        pytest.skip("this JAX backend gives no memory_analysis()")
    assert mems[False] == mems[True]
    for policy in ("none", "full"):
        pred = stage_memory_bytes(cfg, first, L - 1, False, True, microbatch_size=mbs, seq_len=seq, dp=1, tp=1,
                                  in_flight=0, recompute=policy)
        assert pred.activations == pytest.approx(saved["output"], rel=0.10)
        assert pred.activations <= mems[False]["temp"] <= pred.activations + pred.logits


# ---- one ranking key ---------------------------------------------------------------------------------

def _tie_candidates():
    """Real candidates of a small two-group search (catalog costs, top 30), then an exact tie constructed on them:
    every prediction's step time set to the best one's (``dataclasses.replace``; memory and the rest as
    PREDICTED). Returns (model config, cluster, search options, the search result, the tied candidates)."""
    from hethub_jax.planner import SearchOptions, cluster_from_dict, search
    from test_search_bounds import small_model
    cfg = small_model(layers=4, hidden=64)
    cluster = cluster_from_dict({"name": "tie", "groups": [
        {"name": "a", "device": "cpu", "nodes": 1, "devices_per_node": 4},
        {"name": "b", "device": "cpu", "nodes": 1, "devices_per_node": 4, "slowdown": 2.0}]})
    # microbatch 1: DP 1, TP <= 2 (2 heads), so the candidates use 3 to 8 of the 8 devices
    opt = SearchOptions(top_k=30, microbatch_sizes=(1,))
    res = search(cfg, cluster, 8, 32, options=opt)
    step = res.best.step_time_s
    tied = [dataclasses.replace(c, prediction=dataclasses.replace(c.prediction, step_time_s=step))
            for c in res.candidates]
    return cfg, cluster, opt, res, tied


def test_rank_key_orders_an_exact_tie_by_recompute_devices_memory_then_json():
    """``rank_key``'s parts, each recomputed here from the candidate's plan and prediction (recompute, the
    sum of dp x tp over the stages, the largest stage memory, the JSON), on a tie whose candidates differ
    in every tie-break part."""
    from hethub_jax.planner.search import devices_used, rank_key
    *_, tied = _tie_candidates()
    keys = sorted(rank_key(c) for c in tied)
    # the tie-break columns vary among the tied candidates (else the test proves nothing)
    assert len({k[1] for k in keys}) == 2 and len({k[2] for k in keys}) >= 2 and len({k[3] for k in keys}) >= 2
    for c in tied:
        k = rank_key(c)
        assert k[0] == tied[0].step_time_s and k[1] == (c.plan.recompute != "none")
        assert k[2] == sum(s.dp * s.tp for r in c.plan.replicas for s in r.stages) == devices_used(c.plan)
        assert k[3] == max(s.memory.total for s in c.prediction.stages) and k[4] == c.plan.to_json(indent=None)
    # recompute none first, then the fewest devices, then the least peak memory
    assert keys[0][1] is False and keys[-1][1] is True
    nones = [k for k in keys if not k[1]]
    assert nones[0][2] == min(k[2] for k in nones)


def test_search_top_k_and_runnable_result_choose_the_same_plan_on_a_constructed_tie():
    """The search's own ranking (``_Planner.offer``, candidates offered in reverse) and ``runnable_result``
    (what the plan CLI and plan-less training choose from) give the same order on the constructed tie."""
    from hethub_jax.planner.runnable import runnable_result
    from hethub_jax.planner.search import SearchResult, _setup, rank_key
    cfg, cluster, opt, res, tied = _tie_candidates()
    p = _setup(cfg, cluster, 8, 32, None, opt, None)
    for c in reversed(tied):
        p.offer(c)
    top = [c.plan for _, _, c, _ in p.top]
    tie = SearchResult(tuple(tied), res.skeletons, res.expanded, res.evaluated, res.wall_s)
    run = runnable_result(tie, cfg, cluster, 32, options=opt)
    assert all(c.searched is None for c in run.candidates)  # single-node groups: no split, predictions kept
    assert [c.plan for c in run.candidates] == top == [c.plan for c in sorted(tied, key=rank_key)]
    assert run.best.plan.recompute == "none"


def test_plan_cli_and_planless_training_choose_recompute_none_on_the_real_fused_tie():
    """A real exact tie, not constructed: the end-to-end benchmark's cluster at global batch 32 (catalog
    costs; tests/test_e2e_plan_choice.py): the best plan is heterogeneous DP of one-stage replicas under
    1F1B, whose recompute ``none`` and ``full`` run the same fused calls, so both are PREDICTED the same step
    and (now) the same memory. The search's top k and ``runnable_result`` (the plan CLI's and plan-less
    training's ranking) both choose ``none``; before, ``runnable_result`` sorted by (step, JSON) and chose
    ``full`` (``"full" < "none"``)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.hetero_e2e import MODEL, cluster
    from hethub_jax.models.config import LlamaConfig
    from hethub_jax.planner import SearchOptions, cluster_from_dict, search
    from hethub_jax.planner.runnable import runnable_result
    from hethub_jax.planner.search import group_costs
    cfg, cl = LlamaConfig(**MODEL), cluster_from_dict(cluster(3.0))
    opt = SearchOptions(top_k=4)
    res = search(cfg, cl, 32, 64, costs=group_costs(cl), options=opt)
    run = runnable_result(res, cfg, cl, 64, costs=group_costs(cl), options=opt)
    best = res.best
    twin = [c for c in res.candidates if c.plan == Plan.from_dict(dict(best.plan.to_dict(), recompute="full"))]
    assert best.plan.num_replicas == 2 and best.plan.schedule == "1f1b" and best.plan.recompute == "none"
    assert len(twin) == 1 and twin[0].step_time_s == best.step_time_s  # the exact tie is in the top k
    assert [s.memory for s in twin[0].prediction.stages] == [s.memory for s in best.prediction.stages]
    assert [c.plan for c in run.candidates] == [c.plan for c in res.candidates]
    assert run.best.plan == best.plan
    # the old key of runnable_result would have chosen the other one
    old = min(run.candidates, key=lambda c: (c.step_time_s, c.plan.to_json(indent=None)))
    assert old.plan.recompute == "full"
