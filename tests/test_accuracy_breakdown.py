"""planner.accuracy.action_breakdown: measured against predicted seconds per action class."""
from types import SimpleNamespace

import pytest

from hethub_jax.parallel.trace import ActionRecord
from hethub_jax.planner.accuracy import action_breakdown, action_kind, format_breakdown


def _pred(records, allreduce_s=0.01, update_s=0.02):
    return SimpleNamespace(timeline=tuple(records), allreduce_s=allreduce_s, update_s=update_s)


def test_action_kind():
    assert [action_kind(a) for a in ("F3", "B0", "SEND_ACT3->1", "RECV_GRAD2<-1")] == ["F", "B", "SEND", "RECV"]
    with pytest.raises(ValueError, match="not a pipeline action"):
        action_kind("X1")


def test_breakdown_by_hand():
    # measured, clock starting at 100.0: island a: F0 [100.0, 100.1], SEND [100.1, 100.11],
    # F1 [100.2, 100.3] (0.09 s idle before it); island b: RECV [100.15, 100.16], F0 [100.16, 100.4]
    m = [ActionRecord(0, "F0", 100.0, 100.1, "a"), ActionRecord(0, "SEND_ACT0->1", 100.1, 100.11, "a"),
         ActionRecord(0, "F1", 100.2, 100.3, "a"), ActionRecord(1, "RECV_ACT0<-0", 100.15, 100.16, "b"),
         ActionRecord(1, "F0", 100.16, 100.4, "b")]
    # predicted: b's RECV of microbatch 0 waits until a's SEND ends at 0.09 and costs 0.01 s; its RECV
    # of microbatch 1 waits until 0.3 and costs 0.05 s
    p = [ActionRecord(0, "F0", 0.0, 0.08, "a"), ActionRecord(0, "SEND_ACT0->1", 0.08, 0.09, "a"),
         ActionRecord(1, "RECV_ACT0<-0", 0.0, 0.1, "b"), ActionRecord(1, "F0", 0.1, 0.2, "b"),
         ActionRecord(0, "SEND_ACT1->1", 0.2, 0.3, "a"), ActionRecord(1, "RECV_ACT1<-0", 0.2, 0.35, "b")]
    b = action_breakdown(_pred(p), m, 100.0, {"a": (100.0, 0.5), "b": (100.01, 0.45)})
    acts = b["actions"]
    assert acts["a/0/F"]["count"] == 2 and acts["a/0/F"]["measured_s"] == pytest.approx(0.2)
    assert acts["a/0/F"]["predicted_s"] == pytest.approx(0.08)
    assert acts["a/0/SEND"] == {"count": 1, "measured_s": pytest.approx(0.01), "predicted_s": pytest.approx(0.11)}
    assert acts["b/1/RECV"]["measured_s"] == pytest.approx(0.01)
    assert acts["b/1/RECV"]["predicted_s"] == pytest.approx(0.06)  # 0.01 + 0.05, the waits excluded
    a, bb = b["islands"]["a"], b["islands"]["b"]
    assert a["measured_pipeline_end_s"] == pytest.approx(0.3)
    assert a["measured_busy_s"] == pytest.approx(0.21) and a["measured_idle_s"] == pytest.approx(0.09)
    assert a["measured_tail_s"] == pytest.approx(0.2)  # step ends at 100.5, pipeline at 100.3
    assert bb["measured_tail_s"] == pytest.approx(100.46 - 100.4)
    assert bb["predicted_pipeline_end_s"] == pytest.approx(0.35)
    assert bb["predicted_busy_s"] == pytest.approx(0.16) and bb["predicted_idle_s"] == pytest.approx(0.19)
    assert a["predicted_tail_s"] == pytest.approx(0.03)
    text = format_breakdown(b)
    assert "a/0/F" in text and "island b" in text and "200.0" in text  # a's measured F: 200 ms


def test_breakdown_of_a_real_prediction_against_itself():
    """The predicted timeline given as the measurement: every compute and send class agrees; a
    RECV's own seconds are at most its record's."""
    from hethub_jax.models.config import get_preset
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.planner.costs import DeviceCosts
    from hethub_jax.planner.predictor import predict
    cfg = get_preset("tiny")
    plan = Plan.from_dict({"islands": [{"name": "a", "platform": "cpu"}, {"name": "b", "platform": "cpu"}],
                           "stages": [{"island": "a", "first_layer": 0, "last_layer": 2},
                                      {"island": "b", "first_layer": 3, "last_layer": 5}],
                           "global_batch_size": 4, "microbatch_size": 1}).validate(cfg)
    c = DeviceCosts.from_catalog("cpu")
    pred = predict(cfg, plan, {"a": c, "b": c}, seq_len=64)
    b = action_breakdown(pred, pred.timeline, 0.0, {})
    for k, r in b["actions"].items():
        if not k.endswith("RECV"):
            assert r["measured_s"] == pytest.approx(r["predicted_s"]), k
        assert r["measured_s"] >= r["predicted_s"] - 1e-12, k  # a measured RECV keeps its wait here
    assert b["actions"]["a/0/F"]["count"] == plan.num_microbatches(0)


def test_round_orders_rotate_and_cover():
    from hethub_jax.planner.accuracy import round_orders
    names = ["a", "b", "c", "d", "e"]
    orders = round_orders(names, 3)
    assert len(orders) == 3
    for o in orders:  # every configuration once per round
        assert sorted(o) == names
    assert [o[0] for o in orders] == ["a", "b", "d"]  # starts at 0, 5 // 3, 10 // 3
    assert orders[1] == ["b", "c", "d", "e", "a"]      # a rotation, not a shuffle
    assert round_orders(names, 1) == [names]
    for bad in ((names, 0), ([], 2)):
        with pytest.raises(ValueError, match="rounds >= 1"):
            round_orders(*bad)


def test_spread_summary_by_hand():
    from hethub_jax.planner.accuracy import spread_summary
    s = spread_summary(0.11, [0.12, 0.10, 0.15])
    assert s["rounds_s"] == [0.12, 0.10, 0.15]
    assert (s["min_s"], s["median_s"], s["max_s"]) == (0.10, 0.12, 0.15)
    assert s["spread"] == pytest.approx(1.5)
    assert s["ape"] == pytest.approx(0.01 / 0.12) and s["ape_min"] == pytest.approx(0.1)
    assert s["within_spread"] and s["ape_beyond_spread"] == 0.0
    out = spread_summary(0.2, [0.12, 0.10, 0.15, 0.13])  # even count: the mean of the middle two
    assert out["median_s"] == pytest.approx(0.125)
    assert not out["within_spread"] and out["ape_beyond_spread"] == pytest.approx(0.05 / 0.125)
    below = spread_summary(0.05, [0.1])
    assert below["spread"] == 1.0 and below["ape_beyond_spread"] == pytest.approx(0.5)
    for bad in ([], [0.1, 0.0]):
        with pytest.raises(ValueError, match="positive measured"):
            spread_summary(0.1, bad)
