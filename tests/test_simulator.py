"""Pure-Python tests of the schedule simulator and the Chrome trace writer (no JAX)."""
import itertools
import json

import pytest

from hethub_jax.parallel.schedule import Action, ScheduleDeadlock, SCHEDULES, get_schedule, gpipe, one_f_one_b
from hethub_jax.parallel.trace import ActionRecord, to_chrome_trace
from hethub_jax.planner.simulator import simulate


def uniform(t_f, t_b):
    return lambda stage, a: t_f if a.kind == "F" else t_b


def no_comm(src, dst, a):
    return 0.0


CASES = list(itertools.product(sorted(SCHEDULES), range(1, 6), range(1, 9), [(1.0, 2.0), (0.3, 0.5)]))


@pytest.mark.parametrize("name,S,M,times", CASES)
def test_uniform_makespan_and_bubble(name, S, M, times):
    t_f, t_b = times
    tl = simulate(get_schedule(name)(S, M), uniform(t_f, t_b), no_comm)
    # textbook (GPipe, Huang et al. 2019 sec. 2.3; 1F1B, Narayanan et al. 2021 sec. 2.2.1):
    # (M + S - 1) slots of (t_f + t_b), of which each stage is busy in M
    assert tl.makespan_s == pytest.approx((M + S - 1) * (t_f + t_b))
    for s in range(S):
        assert tl.busy_s[s] == pytest.approx(M * (t_f + t_b))
        assert tl.bubble_fraction[s] == pytest.approx((S - 1) / (M + S - 1))
    assert tl.mean_bubble_fraction == pytest.approx((S - 1) / (M + S - 1))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_slow_stage_bounds_makespan(name):
    S, M, slow, k = 4, 6, 2, 3.0
    t_f, t_b = 1.0, 2.0
    times = lambda s, a: (t_f if a.kind == "F" else t_b) * (k if s == slow else 1.0)
    tl = simulate(get_schedule(name)(S, M), times, no_comm)
    assert tl.makespan_s >= M * k * (t_f + t_b) - 1e-9
    # the slow stage is the bottleneck: its bubble is the smallest
    assert min(range(S), key=lambda s: tl.bubble_fraction[s]) == slow


def test_comm_time_delays_delivery():
    # 2 stages, 1 microbatch, comm c: F0 (t_f) -> c -> F0 (t_f) -> B0 (t_b) -> c -> B0 (t_b)
    t_f, t_b, c = 1.0, 2.0, 0.25
    tl = simulate(gpipe(2, 1), uniform(t_f, t_b), lambda src, dst, a: c)
    assert tl.makespan_s == pytest.approx(2 * t_f + 2 * t_b + 2 * c)
    recv = [e for e in tl.events if str(e[1]) == "RECV_ACT0<-0"][0]
    assert recv[2] == pytest.approx(0.0) and recv[3] == pytest.approx(t_f + c)  # waits from 0 to delivery


def test_comm_called_with_peers():
    seen = []
    simulate(one_f_one_b(3, 2), uniform(1, 1), lambda src, dst, a: seen.append((src, dst, a.kind.value)) or 0)
    assert (0, 1, "SEND_ACT") in seen and (2, 1, "SEND_GRAD") in seen
    assert all(abs(src - dst) == 1 for src, dst, _ in seen)
    assert len(seen) == 2 * 2 * 2  # 2 links x 2 directions x 2 microbatches


def test_deadlock_and_bad_times_raise():
    sched = [list(a) for a in gpipe(2, 1)]
    sched[1].remove(Action("SEND_GRAD", 0, 0))
    with pytest.raises(ScheduleDeadlock):
        simulate(sched, uniform(1, 1), no_comm)
    with pytest.raises(ValueError, match="finite and >= 0"):
        simulate(gpipe(2, 1), uniform(-1, 1), no_comm)


def test_chrome_trace_from_timeline(tmp_path):
    S, M = 3, 4
    tl = simulate(one_f_one_b(S, M), uniform(1e-3, 2e-3), no_comm)
    path = tmp_path / "sim.json"
    to_chrome_trace(tl, path)
    data = json.loads(path.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl.events)
    f3 = [e for e in xs if e["name"] == "F3" and e["tid"] == 0][0]
    start = [e for e in tl.events if e[0] == 0 and str(e[1]) == "F3"][0][2]
    assert f3["ts"] == pytest.approx(start * 1e6) and f3["dur"] == pytest.approx(1e3)  # microseconds
    # compute only
    to_chrome_trace(tl, path, include_comm=False)
    xs = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 2 * S * M


def test_chrome_trace_from_records_and_dicts(tmp_path):
    recs = [ActionRecord(0, "F0", 10.0, 10.5, island="fast"), ActionRecord(1, "F0", 10.6, 11.6, island="slow"),
            {"stage": 1, "action": "B0", "start_s": 11.6, "end_s": 13.6, "island": "slow"}]
    out = to_chrome_trace(recs, tmp_path / "run.json")
    xs = [e for e in out["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in xs] == ["F0", "F0", "B0"]
    assert xs[0]["ts"] == 0 and xs[1]["ts"] == pytest.approx(0.6e6)  # relative to the earliest record
    assert xs[0]["pid"] != xs[1]["pid"] == xs[2]["pid"]  # one process per island
    names = {e["args"]["name"] for e in out["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"replica 0 / island fast", "replica 0 / island slow"}
