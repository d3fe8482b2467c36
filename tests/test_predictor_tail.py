"""The predictor's tail after the pipeline (gradient sums, global norm, optimizer update) against the
sequence the runtime runs (``PipelineRuntime._forward_backward`` + ``_apply_updates``): each island
sums the shared gradients its stages hold (``shared_sum`` fit), its stages compute their parts of the
global norm over the gradients they count (``norm_owner``: a shared parameter's first holder; the
``norm`` fit), the islands exchange the shared sums over the bridge (a ring all-reduce) and a small
all-reduce (one bridge latency), then each island's stages update (the ``update`` fit plus the
measured extra per parameter right after a pipeline, ``update_cold``). Synthetic profiles with round
numbers; every expected figure is written out from those numbers and the model's dimensions. Pure
Python (no JAX)."""
import pytest

from hethub_jax.parallel.plan import Plan
from hethub_jax.planner.costs import PROFILE_FORMAT, DeviceCosts, LinkModel
from hethub_jax.planner.predictor import _norm_fractions, predict


class Tied:
    """A tied-embedding model config (plain attributes)."""
    vocab_size, hidden_size, intermediate_size, num_hidden_layers = 1000, 64, 128, 8
    num_attention_heads, num_key_value_heads, head_dim = 4, 2, 16
    tie_word_embeddings, dtype, param_dtype = True, "float32", "float32"


D, V, F, H, K, DH = 64, 1000, 128, 4, 2, 16
LAYER = D * H * DH + 2 * D * K * DH + H * DH * D + 3 * D * F + 2 * D  # q, k, v, o, gate/up/down, 2 norms
EMBED = V * D


def tail_profile(update_c0=1e-3, update_c1=2e-9, norm_c0=1e-4, norm_c1=5e-10, cold=1e-9,
                 c_bytes=3e-10, c_tensor=2e-4):
    zero = {"c0": 0.0, "c1": 0.0}
    parts = {"layer": zero, "embed": zero, "head": zero, "base": {"c0": 1e-3, "c1": 0.0}}
    return {"format": PROFILE_FORMAT, "device_type": "dev", "memory_bytes": 10**12,
            "fits": {"compute": {"1": {ph: parts for ph in ("F", "F_nosave", "B", "B_recompute")}},
                     "update": {"c0": update_c0, "c1": update_c1}, "allreduce": zero,
                     "norm": {"c0": norm_c0, "c1": norm_c1}, "update_cold": {"per_param_s": cold},
                     "shared_sum": {"c_bytes": c_bytes, "c_tensor": c_tensor}}}


def pp2_two_islands():
    return Plan.from_dict({"islands": [{"name": "a", "platform": "cpu"}, {"name": "b", "platform": "cpu"}],
                           "stages": [{"island": "a", "first_layer": 0, "last_layer": 3},
                                      {"island": "b", "first_layer": 4, "last_layer": 7}],
                           "global_batch_size": 4, "microbatch_size": 1, "schedule": "1f1b"})


def test_pp2_tail_is_the_sum_of_the_runtime_parts_by_hand():
    """Stage 0 (island a): 4 layers + embedding; stage 1 (island b): 4 layers + final norm + its copy of
    the tied embedding. The embedding's gradient (float32, V x D) is the one shared tensor: each
    island sums its one copy (shared_sum of 4 V D bytes, 1 tensor), the two islands all-reduce it over
    the bridge (2 alpha + 4 V D / bandwidth) and exchange the loss and squared norms (alpha). Stage 0
    counts everything it holds in the norm, stage 1 everything but the embedding (stage 0 counts it).
    Updates: c0 + (c1 + cold) x parameters, per island."""
    costs = DeviceCosts.from_profile(tail_profile())
    bridge = LinkModel(1e-4, 1e9)
    p = predict(Tied, pp2_two_islands(), {"a": costs, "b": costs}, seq_len=8, bridge=bridge)
    n0, n1 = 4 * LAYER + EMBED, 4 * LAYER + D + EMBED
    sums = 3e-10 * 4 * EMBED + 2e-4 * 1
    norm = {"a": 1e-4 + 5e-10 * n0, "b": 1e-4 + 5e-10 * (n1 - EMBED)}
    cross = 2 * 1e-4 + 4 * EMBED / 1e9
    assert p.allreduce_s == pytest.approx(max(sums + norm["a"], sums + norm["b"]) + cross + 1e-4, rel=1e-9)
    assert p.update_s == pytest.approx(max(1e-3 + (2e-9 + 1e-9) * n for n in (n0, n1)), rel=1e-9)
    assert p.step_time_s == pytest.approx(p.pipeline_s + p.allreduce_s + p.update_s, rel=1e-12)


def test_update_adds_the_measured_extra_per_parameter_after_a_pipeline():
    with_cold = DeviceCosts.from_profile(tail_profile(cold=4e-9))
    warm = DeviceCosts.from_profile(tail_profile(cold=0.0))
    assert with_cold.update_cold_per_param_s == 4e-9
    assert with_cold.update_time_s(1e6) == pytest.approx(1e-3 + 2e-9 * 1e6 + 4e-9 * 1e6)
    assert warm.update_time_s(1e6) == pytest.approx(1e-3 + 2e-9 * 1e6)


def test_norm_uses_its_measured_line_else_one_read_of_seven():
    """With a ``norm`` fit: c0 + c1 x counted parameters (0 for none); without one (older profiles, the
    catalog): the update's time / 7 (one read of the gradients against the update's 7 accesses)."""
    c = DeviceCosts.from_profile(tail_profile())
    assert c.norm_time_s(1e6) == pytest.approx(1e-4 + 5e-10 * 1e6)
    assert c.norm_time_s(0) == 0.0
    prof = tail_profile(cold=0.0)
    del prof["fits"]["norm"]
    old = DeviceCosts.from_profile(prof)
    assert old.norm_fit is None and old.norm_time_s(1e6) == pytest.approx((1e-3 + 2e-9 * 1e6) / 7)
    cat = DeviceCosts.from_catalog("h100-sxm")
    assert cat.norm_time_s(1e9, 2) == pytest.approx(cat.update_time_s(1e9, 2) / 7)


def test_norm_fractions_follow_the_runtime_norm_owner():
    """The runtime counts a shared parameter at its first holder in (replica, stage) order (ZeRO-1:
    the first holder in the owning replica)."""
    f = _norm_fractions(Tied, pp2_two_islands())
    n1 = 4 * LAYER + D + EMBED
    assert f[(0, 0)] == 1.0 and f[(0, 1)] == pytest.approx((n1 - EMBED) / n1)
    dp = Plan.from_dict({"islands": [{"name": "a", "platform": "cpu"}, {"name": "b", "platform": "cpu"}],
                         "replicas": [{"stages": [{"island": i, "first_layer": 0, "last_layer": 7}]}
                                      for i in "ab"],
                         "global_batch_size": 4, "microbatch_size": 1, "optimizer_sharding": "replicated"})
    assert _norm_fractions(Tied, dp) == {(0, 0): 1.0, (1, 0): 0.0}
    from hethub_jax.parallel.plan import zero1_owners
    from hethub_jax.planner import analytic
    z = dp.replace(optimizer_sharding="zero1")
    sizes = analytic.param_tensors(Tied)
    owners = zero1_owners(sizes, z.batch_shares())
    total = sum(sizes.values())
    fz = _norm_fractions(Tied, z)
    for r in range(2):
        assert fz[(r, 0)] == pytest.approx(sum(v for n, v in sizes.items() if owners[n] == r) / total)


def test_fit_update_cold_is_the_paired_extra_per_parameter():
    from hethub_jax.profile import fit_update_cold
    samples = [{"params": 1000, "seconds": 5e-3, "warm_seconds": 4e-3},
               {"params": 3000, "seconds": 9e-3, "warm_seconds": 6e-3}]
    got = fit_update_cold(samples)
    assert got["per_param_s"] == pytest.approx((1e-3 + 3e-3) / 4000) and got["samples"] == 2
    assert fit_update_cold([{"params": 10, "seconds": 1e-3, "warm_seconds": 2e-3}])["per_param_s"] == 0.0
    assert fit_update_cold([]) is None


def test_zero1_gather_host_side_is_one_copy_per_tensor_per_island():
    """ZeRO-1 over two islands of one-stage replicas: every tensor is held on both islands, so each
    island copies each tensor across the host once (out when its replica owns it, in when not): 8 x 9
    layer tensors + the embedding + the final norm, each ``c0 + c1 x bytes``, float32."""
    from hethub_jax.planner.predictor import _stage_ctx, _zero1_gather_host_s
    prof = tail_profile()
    prof["fits"]["host_copy"] = {"c0": 3e-5, "c1": 2e-11}
    costs = DeviceCosts.from_profile(prof)
    plan = Plan.from_dict({"islands": [{"name": "a", "platform": "cpu"}, {"name": "b", "platform": "cpu"}],
                           "replicas": [{"stages": [{"island": i, "first_layer": 0, "last_layer": 7}]}
                                        for i in "ab"],
                           "global_batch_size": 4, "microbatch_size": 1, "optimizer_sharding": "zero1"})
    ctxs = {(r, 0): _stage_ctx(Tied, plan, r, 0, {"a": costs, "b": costs}, 8) for r in range(2)}
    got = _zero1_gather_host_s(Tied, plan, ctxs)
    tensors, nbytes = 8 * 9 + 2, 4 * (8 * LAYER + EMBED + D)
    assert got["a"] == pytest.approx(tensors * 3e-5 + 2e-11 * nbytes) and got["b"] == pytest.approx(got["a"])


def test_shared_sum_on_a_mesh_takes_the_measured_mesh_ratio():
    """The tied embedding's host-side sum of holders on a (1, 2) mesh is the one-device line times the
    profile's measured ratio for that mesh (``fits.shared_sum_mesh``): both islands' sums grow by
    (ratio - 1) x the line, so the tail's reduce by exactly that; one-device stages are unaffected."""
    def costs(mesh_factor=None):
        prof = tail_profile()
        prof["fits"]["compute"]["2"] = prof["fits"]["compute"]["1"]
        if mesh_factor is not None:
            prof["fits"]["shared_sum_mesh"] = {"1x2": {"factor": mesh_factor}}
        return DeviceCosts.from_profile(prof)
    d = pp2_two_islands().to_dict()
    for i in d["islands"]:
        i["devices_per_process"] = 2
    for s in d["replicas"][0]["stages"]:
        s["tp"] = 2
    tp2, bridge = Plan.from_dict(d), LinkModel(1e-4, 1e9)
    base, scaled = costs(), costs(3.0)
    assert scaled.shared_sum_mesh == {(1, 2): 3.0} and base.shared_sum_mesh == {}
    sums = 3e-10 * 4 * EMBED + 2e-4 * 1
    assert scaled.shared_sum_s(4 * EMBED, 1, 1, 2) == pytest.approx(3.0 * sums, rel=1e-12)
    p0 = predict(Tied, tp2, {"a": base, "b": base}, seq_len=8, bridge=bridge)
    p1 = predict(Tied, tp2, {"a": scaled, "b": scaled}, seq_len=8, bridge=bridge)
    assert p1.allreduce_s - p0.allreduce_s == pytest.approx(2.0 * sums, rel=1e-9)
    one0 = predict(Tied, pp2_two_islands(), {"a": base, "b": base}, seq_len=8, bridge=bridge)
    one1 = predict(Tied, pp2_two_islands(), {"a": scaled, "b": scaled}, seq_len=8, bridge=bridge)
    assert one1.allreduce_s == one0.allreduce_s


def test_fit_shared_sum_mesh_is_the_summed_ratio_per_mesh():
    from hethub_jax.profile import fit_shared_sum_mesh
    fit = fit_shared_sum_mesh([{"dp": 1, "tp": 2, "seconds": 3.0, "one_device_seconds": 1.0},
                               {"dp": 1, "tp": 2, "seconds": 1.0, "one_device_seconds": 1.0},
                               {"dp": 2, "tp": 1, "seconds": 1.5, "one_device_seconds": 1.0}])
    assert fit["1x2"]["factor"] == pytest.approx(2.0) and fit["2x1"]["factor"] == pytest.approx(1.5)
    assert fit_shared_sum_mesh([]) == {}


def test_measure_shared_sum_mesh_times_each_mesh_against_one_device():
    import jax

    from hethub_jax.planner import load_model
    from hethub_jax.profile import measure_shared_sum_mesh
    cfg = load_model({"preset": "tiny", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256})
    devs = jax.devices()[:4]
    out = measure_shared_sum_mesh(cfg, devs, [(1, 1), (1, 2), (2, 1), (2, 2)], repeats=1, seq_len=8)
    assert [(s["dp"], s["tp"]) for s in out] == [(1, 2), (2, 1)]  # (1, 1) is the reference; (2, 2) needs 8 devices
    assert all(s["kind"] == "shared_sum_mesh" and s["seconds"] > 0 and s["one_device_seconds"] > 0 for s in out)
    untied = load_model({"preset": "tiny", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256,
                         "tie_word_embeddings": False})
    assert measure_shared_sum_mesh(untied, devs, [(1, 2)], repeats=1) == []


def test_tail_parts_split_a_replicated_hetero_dp_tail_by_hand():
    """``tail_parts`` of heterogeneous DP (two one-stage replicas of the whole model on islands a and b,
    the update replicated): every parameter is held on both islands, so each island sums its one copy of
    every tensor (shared_sum of 4 N bytes over the model's tensors), the bridge carries a two-rank ring
    all-reduce per shared group (each of the 8 layers, the embedding, the final norm: 10 x 2 alpha) of 4 N
    bytes in all (4 N / bandwidth) and one latency; replica 0 counts every gradient
    in the norm, replica 1 none; each island updates all N parameters (c0 + (c1 + cold) N), island b
    EMULATED 3x. The parts add up to ``predict``'s two tail figures."""
    from hethub_jax.planner.predictor import tail_parts
    costs = DeviceCosts.from_profile(tail_profile())
    plan = Plan.from_dict({"islands": [{"name": "a", "platform": "cpu"},
                                       {"name": "b", "platform": "cpu", "slowdown": 3.0}],
                           "replicas": [{"stages": [{"island": i, "first_layer": 0, "last_layer": 7}]}
                                        for i in "ab"],
                           "global_batch_size": 4, "microbatch_size": 1, "optimizer_sharding": "replicated"})
    bridge = LinkModel(1e-4, 1e9)
    got = tail_parts(Tied, plan, {"a": costs, "b": costs}, seq_len=8, bridge=bridge)
    n = 8 * LAYER + EMBED + D
    tensors = 8 * 9 + 2
    sums = 3e-10 * 4 * n + 2e-4 * tensors
    update = 1e-3 + (2e-9 + 1e-9) * n
    assert got["bridge_s"] == pytest.approx(10 * 2 * 1e-4 + 4 * n / 1e9 + 1e-4, rel=1e-9)
    for isl, factor in (("a", 1.0), ("b", 3.0)):
        part = got["per_island"][isl]
        assert part["sums_s"] == pytest.approx(sums, rel=1e-9)
        assert part["zero1_gather_host_s"] == 0.0
        assert part["update_s"] == pytest.approx(factor * update, rel=1e-9)
    assert got["per_island"]["a"]["norm_s"] == pytest.approx(1e-4 + 5e-10 * n, rel=1e-9)
    assert got["per_island"]["b"]["norm_s"] == 0.0
    p = predict(Tied, plan, {"a": costs, "b": costs}, seq_len=8, bridge=bridge)
    per = got["per_island"]
    assert p.allreduce_s == pytest.approx(max(v["sums_s"] + v["norm_s"] for v in per.values()) + got["bridge_s"])
    assert p.update_s == pytest.approx(max(v["update_s"] for v in per.values()))


def test_tail_parts_of_a_fused_update_step_are_zero():
    """One replica of one stage fuses its update into the last F+B: no tail (every part 0)."""
    from hethub_jax.planner.predictor import tail_parts
    costs = DeviceCosts.from_profile(tail_profile())
    plan = Plan.from_dict({"islands": [{"name": "a", "platform": "cpu"}],
                           "stages": [{"island": "a", "first_layer": 0, "last_layer": 7}],
                           "global_batch_size": 4, "microbatch_size": 1, "schedule": "1f1b"})
    got = tail_parts(Tied, plan, {"a": costs}, seq_len=8)
    assert got["bridge_s"] == 0.0 and got["allreduce_s"] == 0.0
    assert all(v == 0.0 for v in got["per_island"]["a"].values())
