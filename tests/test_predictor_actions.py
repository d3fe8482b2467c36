"""The runtime's pipeline actions that compute nothing, and its emulated waits, in the predictor (issue 13):
``fits.actions`` (SEND / RECV / fused-B records and the seconds between records, measured on the
runtime by ``profile.measure_action_costs``) and ``fits.emulated_wait`` (what a sleep asked for x
seconds takes, ``profile.measure_emulated_wait``). Hand-checkable synthetic profiles, no timing."""
import pytest

from hethub_jax.planner.costs import DeviceCosts
from hethub_jax.planner.predictor import predict
from tests.test_predictor import Cfg, chain_plan, fixed_profile


def _costs(actions=None, wait=None, per_action=None, t_f=0.01, t_b=0.02, t_fb=None):
    prof = fixed_profile(t_f, t_b, t_fb)
    if actions is not None:
        prof["fits"]["actions"] = actions
    if wait is not None:
        prof["fits"]["emulated_wait"] = wait
    if per_action is not None:
        prof["fits"]["runtime"] = {"per_action_s": per_action}
    return DeviceCosts.from_profile(prof)


def test_emulated_action_by_hand():
    """A 10 ms action on an island 3x slower: 10 ms, then a wait asked for 20 ms that takes
    0.1 ms + 20 ms; without a wait fit exactly 3 x 10 ms; a profile made under an emulated 2x
    slowdown holds 2 x the real time."""
    c = _costs(wait={"c0": 1e-4, "c1": 1.0})
    assert c.emulated_action_s(0.01, 3.0) == pytest.approx(0.01 + 1e-4 + 0.02)
    assert c.emulated_action_s(0.01, 1.0) == pytest.approx(0.01)  # no emulation: no wait
    assert _costs().emulated_action_s(0.01, 3.0) == pytest.approx(0.03)
    from dataclasses import replace
    assert replace(c, emulated_slowdown=2.0).emulated_action_s(0.02, 3.0) == pytest.approx(0.01 + 1e-4 + 0.02)


def test_profile_fields_are_read_and_old_profiles_keep_the_per_action_overhead():
    c = _costs(actions={"send_s": 1e-5, "recv_s": 2e-4, "fused_b_s": 3e-4, "gap_s": 5e-5}, per_action=1e-3)
    assert (c.message_action_s("send"), c.message_action_s("recv"), c.message_action_s("fused_b")) == (1e-5, 2e-4, 3e-4)
    assert c.between_actions_s() == 5e-5  # the measured gap replaces the lumped per-action overhead
    old = _costs(per_action=1e-3)
    assert old.between_actions_s() == 1e-3 and old.message_action_s("send") == 0.0
    assert old.emulated_wait_fit is None
    with pytest.raises(ValueError, match="kind"):
        old.message_action_s("F")
    assert DeviceCosts.from_catalog("H100-SXM").between_actions_s() == 0.0


def test_messages_fused_b_and_gaps_on_a_serial_critical_path():
    """Two stages on two islands, one microbatch: every action is on the critical path (F0, SEND,
    RECV, fused F+B, B, SEND_GRAD, RECV_GRAD, B0), so the measured records add 2 SENDs + 2 RECVs +
    the fused B + 8 gaps to the pipeline."""
    s, r, fb, g = 1e-4, 2e-4, 3e-4, 5e-5
    plan = chain_plan(2, 1, "gpipe")
    assert sum(len(a) for a in plan.actions(0)) == 8
    costs = lambda c: {"i0": c, "i1": c}  # noqa: E731
    plain = predict(Cfg, plan, costs(_costs()), seq_len=8)
    meas = predict(Cfg, plan, costs(_costs(actions={"send_s": s, "recv_s": r, "fused_b_s": fb, "gap_s": g})),
                   seq_len=8)
    assert meas.pipeline_s - plain.pipeline_s == pytest.approx(2 * s + 2 * r + fb + 8 * g)


def test_a_slow_island_waits_after_its_fused_b_too_and_each_wait_wakes_late():
    """The last stage's island EMULATED 3x slower, the wait measured to take 0.1 ms more than asked:
    its fused F+B takes t_fb + (2 t_fb + 0.1 ms); its B record (Python only, fb) is stretched the
    same way, fb + (2 fb + 0.1 ms). Against the plain model (3 t_fb, B free) that is 3 fb + 2 x 0.1 ms
    more; the fast island's actions wait for nothing."""
    fb, w = 3e-4, 1e-4
    plan = chain_plan(2, 1, "gpipe", slow={"i1": 3.0})
    plain = predict(Cfg, plan, {"i0": _costs(), "i1": _costs()}, seq_len=8)
    c = _costs(actions={"fused_b_s": fb}, wait={"c0": w, "c1": 1.0})
    meas = predict(Cfg, plan, {"i0": c, "i1": c}, seq_len=8)
    assert meas.pipeline_s - plain.pipeline_s == pytest.approx(3 * fb + 2 * w)
    fast = chain_plan(2, 1, "gpipe")
    assert (predict(Cfg, fast, {"i0": c, "i1": c}, seq_len=8).pipeline_s
            - predict(Cfg, fast, {"i0": _costs(), "i1": _costs()}, seq_len=8).pipeline_s) == pytest.approx(fb)


def test_fits_of_the_action_records_and_the_wait():
    from hethub_jax import profile
    steps = [{"kind": "action_costs", "send_s": a, "recv_s": 2 * a, "fused_b_s": 3 * a, "gap_s": 4 * a, "actions": 8}
             for a in (3e-4, 1e-4, 2e-4)]
    old = profile.STATISTIC["name"]
    try:
        profile.STATISTIC["name"] = "min"
        f = profile.fit_action_costs(steps)
        assert (f["send_s"], f["recv_s"], f["fused_b_s"], f["gap_s"]) == pytest.approx((1e-4, 2e-4, 3e-4, 4e-4))
        profile.STATISTIC["name"] = "median"
        assert profile.fit_action_costs(steps)["gap_s"] == pytest.approx(8e-4)
    finally:
        profile.STATISTIC["name"] = old
    assert profile.fit_action_costs([]) is None
    # lateness 0.1, 0.3, 0.2, 5 ms at four sizes: the median (0.25 ms), not a line through the outlier
    waits = [{"kind": "emulated_wait", "requested_s": x, "seconds": x + late}
             for x, late in ((2e-4, 1e-4), (1e-3, 3e-4), (5e-3, 2e-4), (2e-2, 5e-3))]
    fit = profile.fit_emulated_wait(waits)
    assert fit["c0"] == pytest.approx(2.5e-4) and fit["c1"] == 1.0
    assert profile.fit_emulated_wait([{"requested_s": 1e-3, "seconds": 0.9e-3}])["c0"] == 0.0
    assert profile.fit_emulated_wait([]) is None
