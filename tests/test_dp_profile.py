"""Plan-less training profiles the DP degrees the planner may choose, and the predictor and the planner use
the MEASURED DP figure (session 10: README's main command chose DP 2 over the two fake CPU devices of island
``fast``, predicted as if perfectly parallel; the fake devices share the host's cores).

References are independent of the code under test: the planner's own choices enumerated (coverage), a hand
computation of a stage's seconds from the profile's lines, and exhaustive search (every plan predicted).
"""
from __future__ import annotations

import copy
from types import SimpleNamespace as NS

import pytest

from hethub_jax.parallel.plan import Plan
from hethub_jax.planner import SearchOptions, cluster_from_dict, exhaustive_search, load_model, search
from hethub_jax.planner import analytic
from hethub_jax.planner.costs import PROFILE_FORMAT, DeviceCosts
from hethub_jax.planner.predictor import predict, stage_compute_s
from hethub_jax.planner.search import _setup

SEQ = 16
#: the synthetic profile's lines (seconds; x = a layer's forward FLOPs per DP rank for ``layer``)
BASE, LAYER_C0, LAYER_C1 = 2e-4, 1e-4, 2e-9


def _model():
    return load_model({"preset": "tiny", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256,
                       "tie_word_embeddings": False})


def _profile(dp2_scale=None):
    """One device (TP 1) with the lines above; with ``dp2_scale`` also a measured (2, 1) mesh whose seconds
    per DP rank at ``T / 2`` tokens are ``dp2_scale`` x one device's at ``T`` (1.0: DP 2 no faster at all,
    as two fake devices sharing the cores of one host may be; above 1: slower)."""
    zero = {"c0": 0.0, "c1": 0.0}
    parts = lambda s, c1: {"layer": {"c0": LAYER_C0 * s, "c1": c1 * s}, "embed": zero, "head": zero,
                           "base": {"c0": BASE * s, "c1": 0.0}}
    phases = lambda s, c1: {ph: parts(s * (2.0 if ph.startswith("B") else 1.0), c1)
                            for ph in ("F", "F_nosave", "B", "B_recompute")}
    prof = {"format": PROFILE_FORMAT, "device_type": "cpu", "memory_bytes": 10**12, "emulated_slowdown": 1.0,
            "fits": {"compute": {"1": phases(1.0, LAYER_C1)}, "update": zero, "allreduce": zero}}
    if dp2_scale is not None:
        # a layer's FLOPs are linear in tokens: x per rank at T / 2 is half of x at T, so the slope doubles
        prof["fits"]["compute_dp"] = {"2x1": phases(dp2_scale, 2 * LAYER_C1)}
        prof["fits"]["update_dp"] = {"2": zero}
    return prof


def _one_group():
    return cluster_from_dict({"groups": [{"name": "fast", "device": "cpu", "nodes": 1, "devices_per_node": 2}]})


def _plan(dp: int, mbs: int = 2, gbs: int = 4) -> Plan:
    return Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu", "devices_per_process": 2}],
                           "stages": [{"island": "fast", "first_layer": 0, "last_layer": 3, "dp": dp}],
                           "global_batch_size": gbs, "microbatch_size": mbs, "schedule": "1f1b"})


def test_dp_degrees_profiled_cover_every_dp_the_planner_may_choose_in_a_node():
    """Reference: the planner's own choices (``choices``: (stages, tp, dp)) over every microbatch size it
    searches, for the tiny 2-island cluster and one of 4 devices per node, with a profile that measured
    every DP mesh (so smaller DP degrees are choices too)."""
    from hethub_jax.models.config import get_preset
    from hethub_jax.planner.cluster import load_cluster
    from hethub_jax.train_predict import dp_degrees_to_profile, dp_microbatch_sizes_to_profile, planner_microbatch_sizes
    from test_train_insight import ROOT
    four = cluster_from_dict({"groups": [{"name": "a", "device": "cpu", "nodes": 1, "devices_per_node": 4},
                                         {"name": "b", "device": "cpu", "nodes": 1, "devices_per_node": 1}]})
    for cluster, gbs in ((load_cluster(str(ROOT / "configs/clusters/tiny_2island_cpu.yaml")), 16), (four, 12)):
        groups = cluster.resolved().groups
        sizes = planner_microbatch_sizes(gbs)
        got = dp_degrees_to_profile(groups, sizes)
        p = _setup(get_preset("tiny"), cluster, gbs, SEQ, None, SearchOptions(), None)
        chosen = {dp for g in groups for m in sizes for _, tp, dp in p.choices(g.name, m)
                  if dp > 1 and dp * tp <= g.devices_per_node}
        assert chosen and chosen <= set(got), (chosen, got)
        assert all(d <= max(g.devices_per_node for g in groups) for d in got)
        per_rank = dp_microbatch_sizes_to_profile(sizes, got)  # spans every per-rank size, none beyond
        need = {m // d for m in sizes for d in got if m % d == 0}
        assert per_rank[0] <= min(need) and per_rank[-1] == max(need)
    assert dp_degrees_to_profile([NS(devices_per_node=1)], [1, 2, 4]) == []
    assert dp_degrees_to_profile([NS(devices_per_node=4)], [3]) == [3]
    assert dp_microbatch_sizes_to_profile([1, 2], []) == []


def test_planless_training_asks_the_profiler_for_the_dp_meshes(tmp_path, monkeypatch):
    """``--cluster`` without a saved profile: the child profiler is asked for the (2, 1) mesh of island
    ``fast`` at every per-rank size the planner may choose (global batch 16: 1..8), and a saved profile
    without DP meshes is reused with the DP extrapolation said when the plan uses DP 2."""
    import json
    import os

    from hethub_jax import train_predict as tp
    from hethub_jax.models.config import get_preset
    from test_train_insight import ROOT, write_fake_profile
    asked = []

    def fake_profile(model, seq_len, out, timeout_s=600.0, microbatch_sizes=(1, 2), tp_degrees=(1,),
                     dp_degrees=(), dp_microbatch_sizes=(), chunked_microbatch_sizes=()):
        asked.append((tuple(dp_degrees), tuple(dp_microbatch_sizes)))
        return write_fake_profile(_profile(dp2_scale=1.0), seq_len, out, microbatch_sizes, tp_degrees,
                                  dp_degrees, dp_microbatch_sizes)
    monkeypatch.setattr(tp, "profile_device", fake_profile)
    cluster = str(ROOT / "configs/clusters/tiny_2island_cpu.yaml")
    msg = tp._plan_rank0(get_preset("tiny"), "tiny", cluster, 16, 32, None, str(tmp_path / "p"), lambda m: None)
    assert asked == [((2,), (1, 2, 8))]
    assert not any("EXTRAPOLATED" in x for x in msg["lines"]), msg["lines"]
    assert tp.profiled_dp_degrees(json.loads((tmp_path / "p" / "cpu.json").read_text())) == [1, 2]
    # a saved profile of DP 1 only, and a plan at DP 2 on fast: the note names the scaled mesh
    plan = Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu", "devices_per_process": 2}],
                           "stages": [{"island": "fast", "first_layer": 0, "last_layer": 5, "dp": 2}],
                           "global_batch_size": 4, "microbatch_size": 2})
    only1 = {"seq_len": 32, "samples": [{"kind": "stage", "tokens": 32 * m, "tp": 1} for m in (1, 2)]}
    note = tp.extrapolation_note(plan, {"fast": only1})
    assert note and "fast (DP x TP 2x1; profiled DP 1 at TP 1: scaled as if perfectly parallel)" in note
    assert tp.extrapolation_note(plan, {"fast": dict(only1, samples=only1["samples"] + [
        {"kind": "stage", "tokens": 32, "tp": 1, "dp": 2}])}) is None


def test_predictor_uses_the_measured_dp_figure_by_hand():
    """A stage at DP 2 costs the measured (2, 1) mesh's line at the tokens per rank (hand computation), not
    one device's line at half the tokens (perfect scaling); each mesh says where its figures come from."""
    cfg = _model()
    tokens = 2 // 2 * SEQ  # microbatch 2 over DP 2: one sample per rank
    flops = analytic.layer_flops(cfg, tokens, SEQ)
    for scale in (1.0, 1.7):
        c = DeviceCosts.from_profile(_profile(scale))
        hand = scale * (BASE + 4 * (LAYER_C0 + 2 * LAYER_C1 * flops))  # F: base + 4 layers (embed/head zero)
        assert stage_compute_s(cfg, c, 0, 3, True, True, tokens, SEQ, 1, "F", dp=2) == pytest.approx(hand, rel=1e-12)
        assert c.mesh_source(2, 1) == "profile, mesh 2x1 measured" and c.measured_dp_degrees(1) == (1, 2)
    perfect = DeviceCosts.from_profile(_profile(None))
    assert stage_compute_s(cfg, perfect, 0, 3, True, True, tokens, SEQ, 1, "F", dp=2) == pytest.approx(
        BASE + 4 * (LAYER_C0 + LAYER_C1 * flops), rel=1e-12)
    assert "NOT profiled" in perfect.mesh_source(2, 1) and perfect.measured_dp_degrees(1) == (1,)
    assert DeviceCosts.from_catalog("cpu").measured_dp_degrees(1) == ()
    # the PREDICTED step follows: DP 2 measured no faster than one device -> the DP 2 plan is not faster
    p1 = predict(cfg, _plan(1), {"fast": DeviceCosts.from_profile(_profile(1.0))}, seq_len=SEQ).step_time_s
    p2 = predict(cfg, _plan(2), {"fast": DeviceCosts.from_profile(_profile(1.0))}, seq_len=SEQ).step_time_s
    p2_perfect = predict(cfg, _plan(2), {"fast": perfect}, seq_len=SEQ).step_time_s
    assert p2 >= p1 * (1 - 1e-12) and p2_perfect < p1


@pytest.mark.parametrize("scale,want_dp", [(None, 2), (0.6, 2), (1.3, 1)])
def test_planner_chooses_dp_from_the_measured_figure(scale, want_dp):
    """The planner's best plan against exhaustive search (every plan predicted), and its DP degree: 2 when
    DP 2 is assumed perfectly parallel (no mesh measured) or measured faster, 1 when it is measured slower
    than one device (the search then offers DP 1 too, as the profile measured it)."""
    cfg = _model()
    costs = {"fast": DeviceCosts.from_profile(_profile(scale) if scale is not None else _profile(None))}
    opt = SearchOptions(top_k=1, microbatch_sizes=(2,), tp_degrees=(1,), max_stages_per_group=1, hetero_dp=False)
    got = search(cfg, _one_group(), 4, SEQ, costs=copy.deepcopy(costs), options=opt)
    ref = exhaustive_search(cfg, _one_group(), 4, SEQ, costs=copy.deepcopy(costs), options=opt)
    assert got.best.step_time_s == pytest.approx(ref.best.step_time_s, rel=1e-12)
    stage = got.best.plan.replicas[0].stages[0]
    assert stage.dp == want_dp
    # the chosen plan is the faster of the two as predict has it (the reference, plan by plan)
    times = {d: predict(cfg, _plan(d), costs, seq_len=SEQ).step_time_s for d in (1, 2)}
    assert times[want_dp] == pytest.approx(min(times.values()), rel=1e-9)


def test_a_profile_taken_under_load_is_said_in_the_notes(tmp_path):
    """The profiler records the CPU share other processes used (``others_cpu_share``); plan-less training
    says so in the profile's line when above 5% (the child's own note goes to its discarded stdout)."""
    import json

    from hethub_jax import train_predict as tp
    from hethub_jax.planner.cluster import load_cluster
    from test_train_insight import ROOT
    cluster = load_cluster(str(ROOT / "configs/clusters/tiny_2island_cpu.yaml"))
    for share, said in ((0.8, True), (0.01, False), (None, False)):
        (tmp_path / "cpu.json").write_text(json.dumps(dict(_profile(), others_cpu_share=share)))
        _, notes = tp._profiles(cluster, "tiny", SEQ, str(tmp_path), lambda m: None)
        assert ("other processes used 80%" in notes[0]) == said, notes


@pytest.mark.parametrize("scale", [0.6, 1.3])
def test_search_with_measured_dp_meshes_equals_exhaustive_on_two_groups(scale):
    """Two 2-device groups (one EMULATED 2x slower), pipelines of up to 2 stages per group and the
    heterogeneous-DP family, every microbatch size: with DP meshes measured the search offers the smaller
    DP degrees too, and its best plan must still equal exhaustive search's."""
    cfg = _model()
    cluster = cluster_from_dict({"groups": [{"name": n, "device": "cpu", "nodes": 1, "devices_per_node": 2,
                                             "slowdown": sd} for n, sd in (("fast", 1.0), ("slow", 2.0))]})
    costs = {g: DeviceCosts.from_profile(_profile(scale)) for g in ("fast", "slow")}
    opt = SearchOptions(top_k=1, tp_degrees=(1,), max_stages_per_group=2)
    got = search(cfg, cluster, 8, SEQ, costs=copy.deepcopy(costs), options=opt)
    ref = exhaustive_search(cfg, cluster, 8, SEQ, costs=copy.deepcopy(costs), options=opt)
    assert got.best.step_time_s == pytest.approx(ref.best.step_time_s, rel=1e-12)
    dps = {st.dp for rep in got.best.plan.replicas for st in rep.stages}
    assert dps == {1} if scale > 1 else 2 in dps  # measured slower: DP 1 everywhere; faster: DP 2 used
