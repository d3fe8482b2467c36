"""Pure-Python tests of the pipeline schedules (no JAX)."""
import itertools

import pytest

from hethub_jax.parallel.schedule import (
    Action, ActionKind, ScheduleDeadlock, SCHEDULES, execution_order, get_schedule, gpipe,
    in_flight_bound, max_in_flight, one_f_one_b, validate_schedule)

GRID = list(itertools.product(sorted(SCHEDULES), range(1, 6), range(1, 9)))


@pytest.mark.parametrize("name,S,M", GRID)
def test_schedule_valid_and_runs(name, S, M):
    sched = get_schedule(name)(S, M)
    assert len(sched) == S
    validate_schedule(sched)
    order = execution_order(sched)
    assert sorted(order) == [(s, i) for s in range(S) for i in range(len(sched[s]))]
    for s, acts in enumerate(sched):
        kinds = [a.kind for a in acts]
        assert kinds.count(ActionKind.F) == M and kinds.count(ActionKind.B) == M
        # first stage receives no activation, last stage sends none; each message once per microbatch
        assert kinds.count(ActionKind.RECV_ACT) == (M if s > 0 else 0)
        assert kinds.count(ActionKind.SEND_GRAD) == (M if s > 0 else 0)
        assert kinds.count(ActionKind.SEND_ACT) == (M if s < S - 1 else 0)
        assert kinds.count(ActionKind.RECV_GRAD) == (M if s < S - 1 else 0)
        assert len(acts) == 2 * M + 2 * M * ((s > 0) + (s < S - 1))
        # each RECV directly precedes the compute that consumes it; each SEND directly follows its producer
        for i, a in enumerate(acts):
            if a.is_recv:
                want = ActionKind.F if a.kind == ActionKind.RECV_ACT else ActionKind.B
                assert acts[i + 1] == Action(want, a.microbatch)
            if a.is_send:
                want = ActionKind.F if a.kind == ActionKind.SEND_ACT else ActionKind.B
                assert acts[i - 1] == Action(want, a.microbatch)


@pytest.mark.parametrize("name,S,M", GRID)
def test_in_flight_bounds(name, S, M):
    sched = get_schedule(name)(S, M)
    for s, acts in enumerate(sched):
        bound = in_flight_bound(name, S, s, M)
        assert max_in_flight(acts) <= bound
        if name == "1f1b":
            # the promise of the issue: at most the number of stages after s, plus one
            assert bound == min(S - s, M) <= S - s
            assert max_in_flight(acts) == bound  # and 1F1B actually uses its warm-up depth
        else:
            assert max_in_flight(acts) == M


def test_one_f_one_b_layout():
    # S=3, M=4, stage 0: warm-up min(S-0-1, M) = 2 forwards, then F2 B0 F3 B1, cool-down B2 B3
    comp = [str(a) for a in one_f_one_b(3, 4)[0] if a.is_compute]
    assert comp == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    last = [str(a) for a in one_f_one_b(3, 4)[2] if a.is_compute]
    assert last == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    # fewer microbatches than stages: warm-up capped at M
    comp = [str(a) for a in one_f_one_b(4, 2)[0] if a.is_compute]
    assert comp == ["F0", "F1", "B0", "B1"]


def test_single_stage_has_no_comm():
    for name in SCHEDULES:
        acts = get_schedule(name)(1, 3)[0]
        assert all(a.is_compute for a in acts)


def test_action_str_and_checks():
    assert str(Action("F", 3)) == "F3"
    assert str(Action(ActionKind.B, 0)) == "B0"
    assert str(Action("SEND_ACT", 2, 1)) == "SEND_ACT2->1"
    assert str(Action("RECV_GRAD", 2, 3)) == "RECV_GRAD2<-3"
    with pytest.raises(ValueError, match="need a peer"):
        Action("SEND_ACT", 0)
    with pytest.raises(ValueError, match="take no peer"):
        Action("F", 0, 1)
    with pytest.raises(ValueError):
        Action("X", 0)
    with pytest.raises(ValueError, match="unknown schedule"):
        get_schedule("zb")
    with pytest.raises(ValueError, match="num_microbatches"):
        gpipe(2, 0)


def _drop(sched, s, text):
    out = [list(a) for a in sched]
    out[s] = [a for a in out[s] if str(a) != text]
    return out


def test_dropped_send_is_rejected():
    sched = one_f_one_b(3, 4)
    with pytest.raises(ValueError, match="missing SEND_ACT of microbatch 2"):
        validate_schedule(_drop(sched, 1, "SEND_ACT2->2"))
    # without the structural check, the receiver waits forever
    with pytest.raises(ScheduleDeadlock, match=r"stage 2 at RECV_ACT2<-1"):
        execution_order(_drop(sched, 1, "SEND_ACT2->2"))


def test_dropped_recv_is_rejected():
    with pytest.raises(ValueError, match="missing RECV_GRAD of microbatch 0"):
        validate_schedule(_drop(gpipe(2, 2), 0, "RECV_GRAD0<-1"))


def test_cyclic_wait_is_a_deadlock():
    # stage 0 waits for the gradient of mb 0 before sending the activation of mb 0: a cycle
    sched = [list(a) for a in gpipe(2, 2)]
    s0 = sched[0]
    i_send = s0.index(Action("SEND_ACT", 0, 1))
    i_recv = s0.index(Action("RECV_GRAD", 0, 1))
    moved = s0.pop(i_recv)
    s0.insert(i_send, moved)  # RECV_GRAD0 now between F0 and SEND_ACT0
    with pytest.raises(ScheduleDeadlock, match="RECV_GRAD0<-1"):
        execution_order(sched)
    with pytest.raises(ScheduleDeadlock):
        validate_schedule(sched)


def test_structural_errors():
    sched = [list(a) for a in gpipe(2, 2)]
    # B before F
    bad = [list(sched[0]), sched[1]]
    bad[0].remove(Action("B", 1))
    bad[0].insert(0, Action("B", 1))
    with pytest.raises(ValueError, match="B1 .* runs before F1"):
        validate_schedule(bad)
    # duplicated forward
    bad = [sched[0] + [Action("F", 0)], sched[1]]
    with pytest.raises(ValueError, match="more than once"):
        validate_schedule(bad)
    # wrong peer
    bad = [[Action("SEND_ACT", 0, 3) if str(a) == "SEND_ACT0->1" else a for a in sched[0]], sched[1]]
    with pytest.raises(ValueError, match="must have peer stage 1"):
        validate_schedule(bad)
    # missing backward of one microbatch on one stage
    with pytest.raises(ValueError, match="missing B1"):
        validate_schedule(_drop(sched, 1, "B1"))
    # receive of an activation placed after the forward that consumes it
    bad = [sched[0], list(sched[1])]
    r = bad[1].pop(bad[1].index(Action("RECV_ACT", 1, 0)))
    bad[1].insert(bad[1].index(Action("F", 1)) + 1, r)
    with pytest.raises(ValueError, match="must come before the compute of microbatch 1"):
        validate_schedule(bad)


def test_execution_order_is_deterministic():
    sched = one_f_one_b(4, 6)
    assert execution_order(sched) == execution_order(sched)
