"""The fast array simulator against the straightforward reference (``tests/sim_reference.py``, the
simulator and ``predict`` pipeline code from before the rewrite): equal outputs, float for float, on
random plans and random action lists (pure Python, no JAX)."""
import pickle
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sim_reference as ref
from hethub_jax.parallel.plan import Plan
from hethub_jax.parallel.schedule import Action, ScheduleDeadlock, execution_order, get_schedule, max_in_flight
from hethub_jax.planner.costs import PROFILE_FORMAT, DeviceCosts, LinkModel
from hethub_jax.planner.predictor import LazyRecords, predict, predicted_records
from hethub_jax.planner.simulator import ScheduleArrays, schedule_arrays, simulate_processes


class Cfg:
    """A model config without the models package (plain attributes, as LlamaConfig has them)."""
    vocab_size, hidden_size, intermediate_size, num_hidden_layers = 1000, 64, 128, 8
    num_attention_heads, num_key_value_heads, head_dim = 4, 2, 16
    tie_word_embeddings, dtype, param_dtype = False, "float32", "float32"


# "nice" binary fractions and zeros make ties in time (the order-sensitive cases), uniform floats the rest
TIMES = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.001, 2.0))


def profile(t_f, t_b, t_fb, t_layer, host, update):
    """A profile with fixed per-action seconds (F / F_nosave, B, B_recompute and the fused F+B), a
    per-layer term, host copies (``host`` s + bytes / 1e15 B/s) and an update time."""
    zero = {"c0": 0.0, "c1": 0.0}

    def parts(t):
        return {"layer": {"c0": t_layer, "c1": 0.0}, "embed": zero, "head": zero, "base": {"c0": t, "c1": 0.0}}

    fits = {"compute": {"1": {"F": parts(t_f), "F_nosave": parts(t_f), "B": parts(t_b), "B_recompute": parts(t_fb)}},
            "update": {"c0": update, "c1": 0.0}, "allreduce": zero}
    if host > 0:  # else no host copies at all (0 s)
        fits["host_copy"] = {"c0": host, "c1": 0.0}
    return {"format": PROFILE_FORMAT, "device_type": "dev", "memory_bytes": 10**12, "fits": fits}


@st.composite
def problems(draw):
    """A random valid plan (1-3 islands, 1-3 replicas of 1-5 stages, stages of one island next to each
    other or not, GPipe or 1F1B, recompute none/full, 1-12 microbatches per replica), per-island costs,
    a bridge and a concurrency model."""
    n_isl = draw(st.integers(1, 3))
    islands = [{"name": f"i{j}", "platform": "cpu", "devices_per_process": 16,
                "slowdown": draw(st.sampled_from([1.0, 2.0, 3.5]))} for j in range(n_isl)]
    replicas, shares = [], []
    for _ in range(draw(st.integers(1, 3))):
        S = draw(st.integers(1, 5))
        cuts = sorted(draw(st.lists(st.integers(1, 7), min_size=S - 1, max_size=S - 1, unique=True)))
        bounds = [0] + cuts + [8]
        replicas.append({"stages": [{"island": f"i{draw(st.integers(0, n_isl - 1))}", "first_layer": bounds[s],
                                     "last_layer": bounds[s + 1] - 1} for s in range(S)]})
        shares.append(draw(st.integers(1, 12)))
    if len(replicas) > 1:
        for rep, n in zip(replicas, shares):
            rep["batch_share"] = n
    used = {st_["island"] for rep in replicas for st_ in rep["stages"]}
    islands = [i for i in islands if i["name"] in used]  # every island must run a stage
    plan = Plan.from_dict({"islands": islands, "replicas": replicas, "global_batch_size": sum(shares),
                           "microbatch_size": 1, "schedule": draw(st.sampled_from(["gpipe", "1f1b"])),
                           "recompute": draw(st.sampled_from(["none", "full"]))})
    costs = {i["name"]: DeviceCosts.from_profile(profile(*[draw(TIMES) for _ in range(3)], draw(TIMES) / 8,
                                                         draw(TIMES) / 4, draw(TIMES)))
             for i in islands}
    bridge = draw(st.sampled_from([LinkModel(0.0, 1e30), LinkModel(20e-6, 1e9), LinkModel(0.25, 1e30)]))
    return plan, costs, bridge, draw(st.sampled_from(["runtime", "stages"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_predict_equals_the_reference_on_random_plans(problem):
    plan, costs, bridge, concurrency = problem
    got = predict(Cfg, plan, costs, seq_len=8, bridge=bridge, concurrency=concurrency)
    want = ref.reference_predict(Cfg, plan, costs, seq_len=8, bridge=bridge, concurrency=concurrency)
    assert got.step_time_s == want.step_time_s and got.pipeline_s == want.pipeline_s
    assert got.critical_path == want.critical_path
    assert got.stages == want.stages
    assert tuple(got.timeline) == want.timeline  # same records, same order, same floats
    # the reference predates the bucketed path's figures (session 15): without grad_bucket_mb the step is
    # the unbucketed one, the rest as the reference's
    assert got.grad_allreduce == "unbucketed" and got.step_time_unbucketed_s == got.step_time_s
    assert replace(got, step_time_unbucketed_s=None, step_time_bucketed_s=None, buckets=None) == want


@st.composite
def action_lists(draw):
    """Random schedules of 1-3 replicas on 1-4 processes (any stage on any process), random action and
    delivery times (with zeros and ties)."""
    name, lists, proc = draw(st.sampled_from(["gpipe", "1f1b"])), {}, {}
    n_proc = draw(st.integers(1, 4))
    for r in range(draw(st.integers(1, 3))):
        acts = get_schedule(name)(draw(st.integers(1, 5)), draw(st.integers(1, 6)))
        for s, a in enumerate(acts):
            lists[(r, s)], proc[(r, s)] = a, draw(st.integers(0, n_proc - 1))
    seed = draw(st.integers(0, 2**32 - 1))
    return lists, proc, seed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(action_lists())
def test_simulate_processes_equals_the_reference(case):
    lists, proc, seed = case
    rng = random.Random(seed)
    pick = lambda: rng.choice([0.0, 0.25, 0.5, rng.uniform(0, 1)])  # noqa: E731
    at = {(k, i): pick() for k in lists for i in range(len(lists[k]))}
    dl = {(k, str(a)): pick() for k in lists for a in lists[k] if a.is_send}
    args = (lists, proc, lambda k, i: at[(k, i)], lambda k, a: dl[(k, str(a))])
    assert simulate_processes(*args) == ref.simulate_processes(*args)


def test_deadlock_names_the_same_waits_as_the_reference():
    lists = {(0, 0): [Action("RECV_GRAD", 0, 1), Action("F", 0)], (0, 1): [Action("RECV_ACT", 0, 0), Action("F", 0)]}
    args = (lists, {(0, 0): "a", (0, 1): "a"}, lambda k, i: 1.0, lambda k, a: 0.0)
    with pytest.raises(ScheduleDeadlock) as got:
        simulate_processes(*args)
    with pytest.raises(ScheduleDeadlock) as want:
        ref.simulate_processes(*args)
    assert str(got.value) == str(want.value)


def test_bad_callback_time_is_an_error():
    acts = get_schedule("1f1b")(2, 2)
    with pytest.raises(ValueError, match="action_time"):
        simulate_processes({(0, 0): acts[0], (0, 1): acts[1]}, {(0, 0): 0, (0, 1): 0},
                           lambda k, i: -1.0, lambda k, a: 0.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedule_arrays_without_actions_equal_those_of_the_action_lists(name):
    """The integer form built without Action objects equals the one read off get_schedule's lists."""
    fields = ["code", "recv_msg", "send_msg", "sender", "num_messages", "offsets", "stage_codes", "stage_of",
              "compute", "prev_recv", "next_send", "fused_f", "last_fused_f", "all_fused", "in_flight"]
    for S in range(1, 7):
        for M in range(1, 11):
            acts = get_schedule(name)(S, M)
            fast, slow = schedule_arrays(name, S, M), ScheduleArrays.from_lists(acts)
            for f in fields:
                assert getattr(fast, f) == getattr(slow, f), (S, M, f)
            assert fast.in_flight == [max_in_flight(a) for a in acts]
            assert fast.exec_order == [slow.offsets[s] + i for s, i in execution_order(acts)] == slow.exec_order
            assert fast.lists == tuple(tuple(a) for a in acts) and fast.labels == slow.labels
    with pytest.raises(ValueError, match="num_microbatches"):
        schedule_arrays(name, 2, 0)


def test_schedule_arrays_match_the_action_lists():
    arr = schedule_arrays("1f1b", 3, 4)
    assert arr.lists == tuple(tuple(a) for a in get_schedule("1f1b")(3, 4))
    for s, acts in enumerate(arr.lists):
        for i, a in enumerate(acts):
            g = arr.offsets[s] + i
            assert arr.labels[g] == str(a) and arr.stage_of[g] == s
            if a.is_send:
                assert arr.sender[arr.send_msg[g]] == g and arr.recv_msg[g] == -1
            if a.is_recv:  # the id it waits on is the one its SEND delivers
                snd = arr.sender[arr.recv_msg[g]]
                peer = arr.stage_of[snd]
                assert peer == a.peer and arr.lists[peer][snd - arr.offsets[peer]].microbatch == a.microbatch


def test_timeline_is_lazy_but_behaves_as_a_tuple():
    plan = Plan.from_dict({"islands": [{"name": "a", "platform": "cpu", "devices_per_process": 2}],
                           "stages": [{"island": "a", "first_layer": 0, "last_layer": 3},
                                      {"island": "a", "first_layer": 4, "last_layer": 7}],
                           "global_batch_size": 3, "microbatch_size": 1})
    costs = {"a": DeviceCosts.from_profile(profile(0.1, 0.2, 0.3, 0.0, 0.01, 0.05))}
    p = predict(Cfg, plan, costs, seq_len=8)
    assert isinstance(p.timeline, LazyRecords)
    want = ref.reference_predict(Cfg, plan, costs, seq_len=8).timeline
    assert len(p.timeline) == len(want) and p.timeline[0] == want[0] and p.timeline == want
    assert pickle.loads(pickle.dumps(p)).timeline == want
    assert [r.start_s for r in predicted_records(Cfg, plan, costs, seq_len=8, prediction=p)] == \
        [r.start_s for r in want]
    assert p.to_dict()["timeline"][-1]["action"] == want[-1].action


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_pipeline_time_compute_order_equals_the_action_lists_order(name):
    """``pipeline_time.compute_order`` (built from the integer form) against the compute actions of
    ``execution_order`` over get_schedule's lists."""
    from hethub_jax.planner.pipeline_time import compute_order
    for S in range(1, 8):
        for M in range(1, 12):
            acts = get_schedule(name)(S, M)
            want = tuple((s, acts[s][i].kind == "B", acts[s][i].microbatch) for s, i in execution_order(acts)
                         if acts[s][i].is_compute)
            assert compute_order.__wrapped__(name, S, M) == want


def test_pipeline_events_and_per_action_factors_match_the_reference():
    """``_pipeline``'s events equal the reference's, and a per-action factor (``corun``, keyed by
    ``(key, id(action))``) scales exactly the actions it names."""
    from hethub_jax.planner import predictor as P
    plan = Plan.from_dict({"islands": [{"name": "a", "platform": "cpu", "devices_per_process": 2},
                                       {"name": "b", "platform": "cpu"}],
                           "stages": [{"island": "a", "first_layer": 0, "last_layer": 2},
                                      {"island": "a", "first_layer": 3, "last_layer": 5},
                                      {"island": "b", "first_layer": 6, "last_layer": 7}],
                           "global_batch_size": 5, "microbatch_size": 1})
    costs = {n: DeviceCosts.from_profile(profile(0.1, 0.2, 0.3, 0.01, 0.01, 0.05)) for n in "ab"}
    ctxs = {(0, s): P._stage_ctx(Cfg, plan, 0, s, costs, 8) for s in range(3)}
    arrays = {0: schedule_arrays("1f1b", 3, 5)}
    proc = lambda k: ctxs[k].spec.island  # noqa: E731
    bridge = LinkModel(0.001, 1e9)
    pl = P._pipeline(Cfg, plan, ctxs, bridge, 8, 0.0, proc, arrays)
    want, _ = ref._pipeline(Cfg, plan, ctxs, bridge, 8, 0.0, proc, {0: [list(a) for a in arrays[0].lists]})
    assert pl.events() == want
    f0 = next(a for a in arrays[0].lists[0] if a.kind == "F")
    slow = P._pipeline(Cfg, plan, ctxs, bridge, 8, 0.0, proc, arrays, {((0, 0), id(f0)): 3.0})
    ev = {(k, str(a)): (t0, t1) for k, a, t0, t1 in slow.events()}
    base = {(k, str(a)): (t0, t1) for k, a, t0, t1 in pl.events()}
    dur = lambda d, a: d[((0, 0), a)][1] - d[((0, 0), a)][0]  # noqa: E731
    assert dur(ev, "F0") == pytest.approx(3 * dur(base, "F0")) and dur(ev, "F1") == pytest.approx(dur(base, "F1"))
