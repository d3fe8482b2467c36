"""benchmarks/hetero_e2e.py's prediction inputs (issue 17, session 13): the two ranks' stage-shape figures
pooled, the islands' link given to the planner, and the co-run slowdown of the two cores applied by the
predictor to the part of each compute action that overlaps the other island's compute. Hand-checked
figures; no timing, no JAX."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hethub_jax.parallel.plan import Plan  # noqa: E402
from hethub_jax.planner.costs import DeviceCosts  # noqa: E402
from hethub_jax.planner.predictor import predict  # noqa: E402
from tests.test_predictor import Cfg, fixed_profile  # noqa: E402


def _shape(mb, phase, seconds, first=0, last=7):
    return {"kind": "stage_shape", "first_layer": first, "last_layer": last, "layers": last - first + 1,
            "is_first": first == 0, "is_last": last == 7, "dp": 1, "tp": 1, "phase": phase,
            "microbatch_size": mb, "tokens": mb * 64, "seconds": seconds}


def test_pool_stage_shapes_takes_the_mean_of_the_ranks_per_shape_phase_and_size():
    from benchmarks.hetero_e2e import pool_stage_shapes
    a = {"samples": [_shape(8, "B_recompute", 0.40), _shape(8, "F", 0.10), _shape(16, "F", 0.30),
                     {"kind": "update", "params": 10, "seconds": 1.0}]}
    b = {"samples": [_shape(8, "B_recompute", 0.50), _shape(8, "F", 0.14)]}
    pa, pb = pool_stage_shapes([a, b])
    got = {(x["microbatch_size"], x["phase"]): x["seconds"] for x in pa["samples"] if x["kind"] == "stage_shape"}
    assert got[(8, "B_recompute")] == pytest.approx(0.45) and got[(8, "F")] == pytest.approx(0.12)
    assert got[(16, "F")] == pytest.approx(0.30)  # measured on one rank only: kept
    assert [x["seconds"] for x in pb["samples"]] == pytest.approx([0.45, 0.12])
    assert pa["samples"][-1] == {"kind": "update", "params": 10, "seconds": 1.0}  # other kinds untouched
    assert a["samples"][0]["seconds"] == 0.40 and "pooled_over_profiles" not in a["samples"][0]  # inputs intact


def test_cluster_link_is_the_given_bridge_else_the_assumption():
    from benchmarks.hetero_e2e import ASSUMED_BRIDGE, cluster
    from hethub_jax.planner import cluster_from_dict
    from hethub_jax.planner.search import bridge_for
    measured = bridge_for(cluster_from_dict(cluster(3.0, bridge=(2e-6, 8e9))), [("fast", "slow")])
    assert (measured.alpha_s, measured.bandwidth) == (2e-6, 8e9)
    assumed = bridge_for(cluster_from_dict(cluster(3.0)), [("fast", "slow")])
    assert (assumed.alpha_s, assumed.bandwidth) == ASSUMED_BRIDGE


def _hetero_dp(schedule="1f1b"):
    """hetero_e2e's planned shape: one whole-model replica per island, shares 3:1 microbatches of 1, the
    slow island EMULATED 3x, the update replicated (no ZeRO-1 exchange)."""
    return Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu"},
                                       {"name": "slow", "platform": "cpu", "slowdown": 3.0}],
                           "replicas": [{"stages": [{"island": "fast", "first_layer": 0, "last_layer": 7}],
                                         "batch_share": 3},
                                        {"stages": [{"island": "slow", "first_layer": 0, "last_layer": 7}],
                                         "batch_share": 1}],
                           "global_batch_size": 4, "microbatch_size": 1, "schedule": schedule,
                           "optimizer_sharding": "replicated"})


def _alone_and_on_one_host(prof: dict):
    """``(alone, both)``: the hetero-DP plan PREDICTED with ``prof`` for both islands, on hosts of their own
    and on one shared host."""
    plain = DeviceCosts.from_profile(prof)
    shared = DeviceCosts.from_profile(prof).on_shared_host("machine")
    return (predict(Cfg, _hetero_dp(), {"fast": plain, "slow": plain}, seq_len=8),
            predict(Cfg, _hetero_dp(), {"fast": shared, "slow": shared}, seq_len=8))


@pytest.mark.parametrize("factor", [1.03, 1.07, 1.2])
def test_corun_factor_slows_the_overlapped_compute_of_hetero_dp_by_hand(factor):
    """Each island one fused F+B of t seconds per microbatch (1F1B on a one-stage replica); the fast island
    runs 3 back to back, the slow one 1 (its compute t, then its EMULATED wait 2t). On a shared host with
    co-run slowdown f: the slow island's compute overlaps the fast island's first action for all of its
    length, so it takes t f and its wait 2 t f (3 t f in all); the fast island's first action is overlapped
    by the slow compute for all of its length, t f, its other two run alone, 2 t. The pipeline is the
    later of the two, 3 t f (> t f + 2 t for f > 1). Alone (no host): 3 t."""
    t = 0.05
    prof = fixed_profile(0.02, 0.03, t_fb=t)
    prof["fits"]["corun"] = {"factor": factor}
    alone, both = _alone_and_on_one_host(prof)
    assert alone.pipeline_s == pytest.approx(3 * t, rel=1e-6)
    assert both.pipeline_s == pytest.approx(3 * t * factor, rel=1e-3)


# ---- session 14: the islands' updates together, the EMULATED wait after them ------------------------------

def test_emulated_makespan_by_hand():
    """Jobs (own compute alone, emulated slowdown), started together, each f x slower while another computes;
    an emulated job's wait (e - 1) x its own compute's duration computes nothing (hand-checked figures)."""
    from hethub_jax.planner.predictor import _emulated_makespan, _shared_makespan
    # the docstring's case: (0.045, 1) and (0.015, 3) at 1.76: the second computes 0.015 x 1.76 = 0.0264 s
    # beside the first, then waits 2 x 0.0264; the first ends at 0.0264 + 0.030 = 0.0564 < 0.0792
    assert _emulated_makespan([(0.045, 1.0), (0.015, 3.0)], 1.76) == pytest.approx(3 * 0.015 * 1.76)
    # the emulated job's own compute longer: both at 1/2 until the first ends (1 x 2 = 2 s), the second has
    # 2 - 1 = 1 s left alone: its compute ended at 3 s, its wait 2 x 3 s: 9 s
    assert _emulated_makespan([(1.0, 1.0), (2.0, 3.0)], 2.0) == pytest.approx(9.0)
    # no emulated job: the plain shared makespan (1 x 2 + (3 - 1) = 4 s)
    assert _emulated_makespan([(1.0, 1.0), (3.0, 1.0)], 2.0) == pytest.approx(_shared_makespan([1.0, 3.0], 2.0))
    assert _emulated_makespan([(0.5, 3.0)], 2.0) == pytest.approx(1.5)  # alone: no co-run, its own wait
    assert _emulated_makespan([], 2.0) == 0.0


@pytest.mark.parametrize("g", [1.0, 1.76, 2.0])
def test_shared_host_update_of_hetero_dp_is_emulated_factor_times_corun_update_by_hand(g):
    """hetero_e2e's shape, the update replicated: each island updates all parameters in u seconds of own
    compute; the slow island's EMULATED 3x. On one host with the update pair factor g (compute co-run 1):
    both compute together at 1/g, so each own update ends at u g, the fast island's there and the slow
    island's after its EMULATED wait 2 u g: update 3 u g. Alone (no host): 3 u. Before session 14 the one
    makespan of (sums + norm + update) at g slowed the slow island's EMULATED wait too."""
    u = 0.01
    prof = fixed_profile(0.02, 0.03, t_fb=0.05, update=u)
    prof["fits"]["corun"] = {"factor": 1.0}
    prof["fits"]["corun_update"] = {"factor": g}
    alone, both = _alone_and_on_one_host(prof)
    assert alone.update_s == pytest.approx(3 * u, rel=1e-9)
    assert both.update_s == pytest.approx(3 * u * g, rel=1e-9)
    assert both.allreduce_s == pytest.approx(alone.allreduce_s, rel=1e-9)  # equal sums at compute co-run 1


def test_fit_update_runtime_is_the_runtime_calls_over_the_fit_by_hand():
    """Two runtime update calls, 2 M and 6 M parameters, warm 0.010 s and 0.030 s; the fit c0 0.001 +
    4e-9 x params says 0.009 and 0.025 s: scale (0.010 + 0.030) / (0.009 + 0.025) = 40 / 34."""
    from hethub_jax.profile import fit_update_runtime
    fit = {"c0": 0.001, "c1": 4e-9}
    xs = [{"kind": "update_in_step", "params": 2e6, "seconds": 0.012, "warm_seconds": 0.010},
          {"kind": "update_in_step", "params": 6e6, "seconds": 0.031, "warm_seconds": 0.030}]
    assert fit_update_runtime(xs, fit)["scale"] == pytest.approx(40 / 34)
    assert fit_update_runtime([], fit) is None and fit_update_runtime(xs, None) is None


def test_update_time_takes_the_runtime_scale_from_the_profile_or_its_samples():
    """The one-device update fit times the scale (the stored fit, or computed from the samples and the fit,
    the samples times the profile's emulated slowdown as the fit is); the cold term is not scaled."""
    prof = fixed_profile(0.02, 0.03, update=0.0)
    prof["fits"]["update"] = {"c0": 0.0, "c1": 1e-9}
    prof["fits"]["update_cold"] = {"per_param_s": 1e-10}
    assert DeviceCosts.from_profile(prof).update_time_s(1e6) == pytest.approx(1e-3 + 1e-4)
    prof["samples"] = [{"kind": "update_in_step", "params": 1e6, "seconds": 0.002, "warm_seconds": 0.0015}]
    assert DeviceCosts.from_profile(prof).update_runtime_scale == pytest.approx(1.5)
    assert DeviceCosts.from_profile(prof).update_time_s(2e6) == pytest.approx(1.5 * 2e-3 + 2e-4)
    prof["emulated_slowdown"] = 2.0  # an emulated profile's fit is scaled by 2, its samples are not
    assert DeviceCosts.from_profile(prof).update_runtime_scale == pytest.approx(3.0)
    prof["fits"]["update_runtime"] = {"scale": 1.25}  # the profiler's own fit wins
    assert DeviceCosts.from_profile(prof).update_runtime_scale == 1.25
