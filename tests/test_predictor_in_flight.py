"""The cost of microbatches in flight in the predictor (issue 13, session 13): ``fits.in_flight`` (a stage
call as the runtime makes it with n microbatches' residuals held, over the same call alone, measured by
``profile.measure_in_flight`` on the profiler's one-island GPipe and 1F1B runtime), read by
``DeviceCosts.in_flight_factor`` and applied by the predictor to every unfused F and B from the
schedule's own action lists. Hand-checkable synthetic profiles; one small measured run, no timing."""
import json

import pytest

from hethub_jax.planner.costs import DeviceCosts
from hethub_jax.planner.predictor import predict
from tests.test_predictor import Cfg, chain_plan, fixed_profile


def _costs(in_flight=None, t_f=0.01, t_b=0.02, t_fb=None, cold=None):
    prof = fixed_profile(t_f, t_b, t_fb)
    if in_flight is not None:
        prof["fits"]["in_flight"] = {"factors": in_flight, "method": "synthetic"}
    if cold is not None:
        prof["fits"]["cold"] = cold
    return DeviceCosts.from_profile(json.loads(json.dumps(prof)))  # as written to and read from a file


def _sample(pos, phase, count, ratio):
    return {"kind": "in_flight", "position": pos, "phase": phase, "count": count, "ratio_cpu": ratio,
            "ratio_wall": 9.0, "cpu_s": 1.0, "alone_cpu_s": 1.0, "wall_s": 1.0, "alone_wall_s": 1.0, "calls": 3}


def test_fit_round_trips_through_the_profile_and_interpolates_by_hand():
    """The fit keeps each measured ratio (process CPU) at its count, counts ascending, ratios below 0.5
    floored (noise); read back from the profile JSON, the factor is the measured one at a measured count,
    linear between counts (count 3 between 2 and 4: halfway), the end point's beyond them."""
    from hethub_jax.profile import fit_in_flight
    fit = fit_in_flight([_sample("last", "F", 4, 1.5), _sample("last", "F", 1, 1.1), _sample("last", "F", 2, 1.3),
                         _sample("first", "B", 1, 0.2), _sample("first", "B_recompute", 2, 1.25)])
    assert fit["factors"]["last"]["F"] == [[1, 1.1], [2, 1.3], [4, 1.5]]
    assert fit["factors"]["first"]["B"] == [[1, 0.5]]
    assert fit_in_flight([]) is None
    c = _costs(fit["factors"])
    assert c.in_flight_factor(False, True, "F", 1) == pytest.approx(1.1)
    assert c.in_flight_factor(False, True, "F", 2) == pytest.approx(1.3)
    assert c.in_flight_factor(False, True, "F", 3) == pytest.approx((1.3 + 1.5) / 2)
    assert c.in_flight_factor(False, True, "F", 8) == pytest.approx(1.5)  # held beyond the last count
    assert c.in_flight_factor(False, True, "B", 2) == 1.0  # phase not measured
    assert c.in_flight_factor(True, False, "B", 3) == pytest.approx(0.5)
    assert c.in_flight_factor(True, False, "B_recompute", 1) == pytest.approx(1.25)  # below the first count
    # a middle stage (no embedding, no head) without points of its own takes the first stage's
    assert c.in_flight_factor(False, False, "B", 2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        c.in_flight_factor(True, False, "X", 1)
    with pytest.raises(ValueError):
        c.in_flight_factor(True, False, "F", 0)


def test_profiles_without_the_measurement_keep_factor_one():
    """Profiles made before session 13 (no ``fits.in_flight``) and the catalog: factor 1 everywhere,
    and the same prediction as before."""
    old = _costs()
    assert old.in_flight == {} and old.in_flight_factor(False, True, "B", 4) == 1.0
    assert DeviceCosts.from_catalog("H100-SXM").in_flight_factor(True, False, "F", 2) == 1.0
    plan = chain_plan(2, 4, "gpipe")
    ones = _costs({"first": {"F": [[1, 1.0], [4, 1.0]]}})
    assert (predict(Cfg, plan, {"i0": old, "i1": old}, seq_len=8).pipeline_s
            == pytest.approx(predict(Cfg, plan, {"i0": ones, "i1": ones}, seq_len=8).pipeline_s))


def test_one_stage_gpipe_by_hand():
    """One stage (first and last) on one island, GPipe, 3 microbatches: F0 F1 F2 B0 B1 B2, in flight
    1, 2, 3 for the forwards and 3, 2, 1 for the backwards (none fused: F2 is followed by B0). Measured
    points F (1: 1.0, 3: 1.4) and B (1: 1.1, 2: 1.3): the forwards cost t_f x (1.0 + 1.2 + 1.4), the
    backwards t_b x (1.3 + 1.3 + 1.1), one after the other."""
    t_f, t_b = 0.01, 0.02
    c = _costs({"last": {"F": [[1, 1.0], [3, 1.4]], "B": [[1, 1.1], [2, 1.3]]}}, t_f, t_b)
    plan = chain_plan(1, 3, "gpipe")
    pred = predict(Cfg, plan, {"i0": c}, seq_len=8)
    assert pred.pipeline_s == pytest.approx(t_f * (1.0 + 1.2 + 1.4) + t_b * (1.3 + 1.3 + 1.1))
    durations = [r.end_s - r.start_s for r in pred.timeline]
    assert durations == pytest.approx([t_f, 1.2 * t_f, 1.4 * t_f, 1.3 * t_b, 1.3 * t_b, 1.1 * t_b])
    # recompute full runs the F_nosave / B_recompute calls: the F / B points do not apply to them
    from hethub_jax.parallel.plan import Plan
    rec = Plan.from_dict({"islands": [{"name": "i0", "platform": "cpu"}], "global_batch_size": 3,
                          "microbatch_size": 1, "schedule": "gpipe", "recompute": "full",
                          "stages": [{"island": "i0", "first_layer": 0, "last_layer": 7}]})
    assert predict(Cfg, rec, {"i0": c}, seq_len=8).pipeline_s == pytest.approx(3 * t_f + 3 * (t_f + t_b))


def test_fused_last_stage_is_not_scaled_and_the_first_stage_is_by_its_counts():
    """1F1B, 2 stages, 4 microbatches: the last stage fuses every F with its B (no factor: no microbatch
    is held across a fused call); stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3 with 1 2 2 2 2 2 2 1 in flight, so
    its busy seconds are t_f (f1 + 3 f2) + t_b (3 b2 + b1) with the measured first-stage points."""
    t_f, t_b = 0.01, 0.02
    f1, f2, b1, b2 = 1.1, 1.3, 1.05, 1.2
    plan = chain_plan(2, 4, "1f1b")
    last_only = _costs({"last": {"F": [[1, 2.0]], "B": [[1, 2.0]]}}, t_f, t_b)
    plain = _costs(None, t_f, t_b)
    assert (predict(Cfg, plan, {"i0": plain, "i1": last_only}, seq_len=8).pipeline_s
            == pytest.approx(predict(Cfg, plan, {"i0": plain, "i1": plain}, seq_len=8).pipeline_s))
    first = _costs({"first": {"F": [[1, f1], [2, f2]], "B": [[1, b1], [2, b2]]}}, t_f, t_b)
    pred = predict(Cfg, plan, {"i0": first, "i1": plain}, seq_len=8)
    assert pred.stages[0].busy_s == pytest.approx(t_f * (f1 + 3 * f2) + t_b * (3 * b2 + b1))
    assert pred.stages[1].busy_s == pytest.approx(4 * (t_f + t_b))


def test_gpipe_last_stage_unfused_calls_take_the_factor_and_no_cold_extra():
    """GPipe, 2 stages, 2 microbatches: the last stage runs F0 F1 B0 B1 unfused (in flight 1 2 2 1). With
    a measured cold extra x for the last stage's F and B, a call that takes an in-flight factor takes no
    extra besides (the factor was measured on calls that follow other calls); without the factor it
    takes the extra."""
    t_f, t_b, x = 0.01, 0.02, 0.003
    plan = chain_plan(2, 2, "gpipe")
    cold = {"last": {"F": x, "B": x}}
    plain = _costs(None, t_f, t_b)
    with_cold = _costs(None, t_f, t_b, cold=cold)
    both = _costs({"last": {"F": [[1, 1.0], [2, 1.5]], "B": [[1, 1.2], [2, 1.4]]}}, t_f, t_b, cold=cold)
    shared = lambda c: c.on_shared_host("h")  # every call after another one: all cold  # noqa: E731
    def busy(c):
        return predict(Cfg, plan, {"i0": shared(plain), "i1": shared(c)}, seq_len=8).stages[1].busy_s
    assert busy(with_cold) == pytest.approx(2 * (t_f + x) + 2 * (t_b + x))
    assert busy(both) == pytest.approx(t_f * (1.0 + 1.5) + t_b * (1.4 + 1.2))


def test_in_flight_counts_follow_the_schedules_own_lists():
    """The counts the profiler and the predictor use, against the schedule module's own figures: their
    maximum over a stage's list is ``schedule.max_in_flight`` and GPipe's reaches M on every stage
    (``in_flight_bound``); the predictor's calls leave out exactly the fused pairs of a last stage."""
    from hethub_jax.parallel.schedule import get_schedule, in_flight_bound, max_in_flight
    from hethub_jax.planner.predictor import _in_flight_calls
    from hethub_jax.planner.simulator import schedule_arrays
    from hethub_jax.profile import in_flight_counts
    for name in ("gpipe", "1f1b"):
        for S, M in ((1, 3), (2, 4), (3, 2), (4, 8)):
            lists = get_schedule(name)(S, M)
            arr = schedule_arrays(name, S, M)
            for s, acts in enumerate(lists):
                counts = in_flight_counts(acts)
                assert max(n for n in counts if n is not None) == max_in_flight(acts)
                assert max_in_flight(acts) <= in_flight_bound(name, S, s, M)
                calls = _in_flight_calls(arr, s, s == S - 1)
                assert [n for _, _, n in calls] == [counts[i] for i, _, _ in calls]
                fused = len(arr.fused_f[s]) if s == S - 1 else 0
                assert len(calls) == 2 * M - 2 * fused
            if name == "gpipe":
                assert max_in_flight(lists[0]) == M


def test_measure_in_flight_on_the_runtime():
    """``profile.measure_in_flight`` on a small 4-layer model (one round): every position, phase and
    count the one-island GPipe and 1F1B runtime has (2 stages, 4 microbatches: GPipe 1..4 on both
    stages, the last stage's 1F1B calls fused and left out), with the number of calls the two
    schedules' own lists give, and positive seconds. No timing is asserted."""
    import jax

    from hethub_jax.models.config import LlamaConfig
    from hethub_jax.parallel.schedule import get_schedule
    from hethub_jax.profile import fit_in_flight, in_flight_counts, measure_in_flight
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    out = measure_in_flight(cfg, jax.devices()[:2], 8, 1)
    expect = {}
    for name in ("gpipe", "1f1b"):
        for s, acts in enumerate(get_schedule(name)(2, 4)):
            counts = in_flight_counts(acts)
            for j, (a, n) in enumerate(zip(acts, counts)):
                fused = s == 1 and name == "1f1b"  # the last stage's 1F1B pairs are all fused
                if n is None or fused:
                    continue
                for phases in (("F", "B"), ("F_nosave", "B_recompute")):
                    key = ("first" if s == 0 else "last", phases[0] if str(a.kind) == "F" else phases[1], n)
                    expect[key] = expect.get(key, 0) + 1
    assert {(r["position"], r["phase"], r["count"]): r["calls"] for r in out} == expect
    assert all(r["cpu_s"] > 0 and r["alone_cpu_s"] > 0 and r["ratio_cpu"] > 0 for r in out)
    fit = fit_in_flight(out)
    assert sorted(fit["factors"]) == ["first", "last"]
    assert [n for n, _ in fit["factors"]["last"]["B"]] == [1, 2, 3, 4]
    assert measure_in_flight(cfg, jax.devices()[:1], 8, 1) == []  # one device: no two-stage runtime
