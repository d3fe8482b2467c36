"""Islands sharing a host's cores update at the same time after their pipelines (issue 13): the tail
is slowed by the profile's MEASURED factor of two updates run together (``fits.corun_update``,
``profile.measure_update_pair``), not by the factor of a stage call beside a computing neighbour.

Reference by hand: two islands whose tails (norm + update) are equal, started together and each
``f`` times slower while the other runs, both end after ``f`` x one tail."""
import pytest

from hethub_jax.parallel.plan import Plan
from hethub_jax.planner.costs import DeviceCosts
from hethub_jax.planner.predictor import predict
from tests.test_predictor import Cfg, chain_plan, fixed_profile


def _prof(corun, corun_update=None):
    prof = fixed_profile(0.01, 0.02, update=0.004)
    prof["fits"]["corun"] = {"factor": corun}
    if corun_update is not None:
        prof["fits"]["corun_update"] = {"factor": corun_update}
    return prof


@pytest.mark.parametrize("corun,corun_update", [(1.5, None), (1.5, 1.9), (1.2, 2.5)])
def test_two_equal_tails_take_the_update_pair_factor(corun, corun_update):
    plan = chain_plan(2, 4, islands=["a", "b"])  # equal stages: embedding + 4 layers, 4 layers + head
    alone = predict(Cfg, plan, {i: DeviceCosts.from_profile(_prof(corun, corun_update)) for i in "ab"}, seq_len=8)
    shared_costs = DeviceCosts.from_profile(_prof(corun, corun_update)).on_shared_host("h")
    shared = predict(Cfg, plan, {"a": shared_costs, "b": shared_costs}, seq_len=8)
    f = corun_update if corun_update is not None else corun
    assert shared_costs.corun_update_factor == (corun_update or 0.0)
    assert shared.update_s == pytest.approx(f * alone.update_s, rel=1e-9)


def test_fit_corun_update_is_the_summed_ratio():
    from hethub_jax.profile import fit_corun_update
    fit = fit_corun_update([{"kind": "corun_update", "alone_s": 2.0, "busy_s": 3.0},
                            {"kind": "corun_update", "alone_s": 2.0, "busy_s": 5.0}])
    assert fit["factor"] == pytest.approx(2.0)
    assert fit_corun_update([]) is None


def test_fit_corun_update_prefers_the_runtime_tail_pair():
    """The runtime's own tail (``corun_tail``, :func:`measure_tail_pair`) when measured, else the warm pair."""
    from hethub_jax.profile import fit_corun_update
    pair = [{"kind": "corun_update", "alone_s": 2.0, "busy_s": 3.0}]
    tail = [{"kind": "corun_tail", "alone_s": 1.0, "busy_s": 2.0}, {"kind": "corun_tail", "alone_s": 3.0, "busy_s": 6.0}]
    assert fit_corun_update(pair + tail)["factor"] == pytest.approx(8.0 / 4.0)
    assert "measure_tail_pair" in fit_corun_update(pair + tail)["method"]
    assert fit_corun_update(pair)["factor"] == pytest.approx(1.5)
    assert "measure_update_pair" in fit_corun_update(pair)["method"]


def test_measure_tail_pair_times_both_islands_updates_in_the_runtime():
    """Two islands of this process run a tied pp2 step; each island's update is timed together and
    one at a time; ``params`` are each stage's parameters (the analytic count, independent of the run)."""
    import jax

    from hethub_jax.planner import analytic, load_model
    from hethub_jax.profile import measure_tail_pair
    cfg = load_model({"preset": "tiny", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256})
    assert cfg.tie_word_embeddings
    (s,) = measure_tail_pair(cfg, jax.devices()[:2], repeats=1, seq_len=8)
    assert s["kind"] == "corun_tail" and s["alone_s"] > 0 and s["busy_s"] > 0
    assert set(s["per_island"]) == {"a", "b"} and all(set(v) == {"alone", "together"} for v in s["per_island"].values())
    assert s["alone_s"] == pytest.approx(sum(v["alone"] for v in s["per_island"].values()))
    sizes = analytic.param_tensors(cfg)
    want = {"a": sum(sizes[n] for n in analytic.stage_tensor_names(cfg, 0, 0, True, False)),
            "b": sum(sizes[n] for n in analytic.stage_tensor_names(cfg, 1, 1, False, True))}
    assert s["params"] == want
    untied = load_model({"preset": "tiny", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256,
                         "tie_word_embeddings": False})
    assert measure_tail_pair(untied, jax.devices()[:2], repeats=1) == []
    assert measure_tail_pair(cfg, jax.devices()[:1], repeats=1) == []
