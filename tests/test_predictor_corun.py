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
