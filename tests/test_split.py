"""One island per stage (``hethub_jax.parallel.split``) and the planner's runnable candidates
(``hethub_jax.planner.runnable``, the plan CLI). The MPI run of a split plan against the unsplit
single-device reference is ``tests/test_runtime_multiprocess.py::
test_two_stages_on_one_island_of_four_processes_run_split_one_island_per_stage``."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hethub_jax.parallel.plan import Plan
from hethub_jax.parallel.rules import check_runtime_support
from hethub_jax.parallel.split import main as split_main
from hethub_jax.parallel.split import split_islands


@st.composite
def plans(draw):
    """Random valid plans: 1-3 islands of 1-4 processes x 1-4 devices; per island 1-3 stages, each on
    explicit or default devices (disjoint), stages in a random pipeline order, one layer each."""
    islands, stages = [], []
    for i in range(draw(st.integers(1, 3))):
        procs, per = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        islands.append({"name": f"i{i}", "platform": "cpu", "num_processes": procs, "devices_per_process": per})
        free = draw(st.permutations(range(procs * per)))
        explicit = draw(st.booleans())
        used = 0
        for _ in range(draw(st.integers(1, 3))):
            n = draw(st.sampled_from([k for k in (1, 2, 4) if used + k <= procs * per] or [0]))
            if n == 0:
                break
            dp = draw(st.sampled_from([1, n]))
            s = {"island": f"i{i}", "dp": dp, "tp": n // dp}
            if explicit:
                s["devices"] = list(free[used:used + n])
            stages.append(s)
            used += n
    order = draw(st.permutations(range(len(stages))))
    stages = [dict(stages[j], first_layer=k, last_layer=k) for k, j in enumerate(order)]
    return Plan.from_dict({"islands": islands, "stages": stages, "global_batch_size": 8, "microbatch_size": 4})


def _physical(plan, r, s):
    """Per device of stage (r, s) in mesh order: (island, process, device inside the process)."""
    isl = plan.island(plan.stage(r, s).island)
    return [(isl.name, d // isl.devices_per_process, d % isl.devices_per_process) for d in plan.stage_devices(r, s)]


def _processes(plan, r, s):
    return {(i, p) for i, p, _ in _physical(plan, r, s)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_split_keeps_every_stage_on_the_same_devices_and_runs_iff_no_process_is_shared(plan):
    new, origin = split_islands(plan)
    keys = [(0, s) for s in range(plan.num_stages(0))]
    assert [(x.first_layer, x.dp, x.tp) for x in new.replicas[0].stages] == \
        [(x.first_layer, x.dp, x.tp) for x in plan.replicas[0].stages]
    # brute force: one map (old island, process) -> (new island, process) over all stages, injective,
    # order-kept inside each new island, same device inside the process, same platform and sizes
    where = {}
    for k in keys:
        for (oi, op, od), (ni, np_, nd) in zip(_physical(plan, *k), _physical(new, *k)):
            assert od == nd and origin[ni] == oi
            assert where.setdefault((oi, op), (ni, np_)) == (ni, np_)
    assert len(set(where.values())) == len(where)
    for (oi, op), (ni, np_) in where.items():
        assert all(np_ < q for (o2, p2), (n2, q) in where.items() if n2 == ni and op < p2)
        a, b = plan.island(oi), new.island(ni)
        assert (a.platform, a.devices_per_process, a.slowdown) == (b.platform, b.devices_per_process, b.slowdown)
    # every process of a new island of several processes holds a stage; single-process islands unchanged
    for isl in new.islands:
        held = {p for k in keys for i, p, _ in _physical(new, *k) if i == isl.name}
        assert held == set(range(isl.num_processes)) or plan.island(origin[isl.name]).num_processes == 1
    # runs iff no two stages of an island of several processes share a process while one of them spans
    # several (then their component has >= 2 stages on >= 2 processes; stages sharing one process only
    # make an island of that one process), pairwise brute force
    blocked = any(a != b and _processes(plan, *a) & _processes(plan, *b)
                  and plan.island(plan.stage(*a).island).num_processes > 1
                  and max(len(_processes(plan, *a)), len(_processes(plan, *b))) > 1 for a in keys for b in keys)
    try:
        check_runtime_support(new)
        assert not blocked
    except ValueError as e:
        assert blocked and "no split into one island per stage runs them" in str(e)
    assert split_islands(new)[0] == new  # idempotent


def _two_on_a(devices=None):
    s1 = {"island": "a", "first_layer": 6, "last_layer": 10, "dp": 2, "tp": 1}
    if devices:
        s1["devices"] = devices
    return Plan.from_dict({
        "islands": [{"name": "a", "platform": "cpu", "num_processes": 4, "devices_per_process": 2},
                    {"name": "b", "platform": "cpu"}],
        "stages": [{"island": "b", "first_layer": 0, "last_layer": 1},
                   {"island": "a", "first_layer": 2, "last_layer": 5, "dp": 2, "tp": 2}, s1],
        "global_batch_size": 8, "microbatch_size": 2})


def test_refusal_names_the_split_or_the_shared_processes_and_checkpoints_follow():
    from hethub_jax import checkpoint
    plan = _two_on_a()  # stage 2 on devices 4-5 = process 2 only; process 3 holds nothing
    with pytest.raises(ValueError, match=r"island 'a' has 4 processes and runs stages \[\(0, 1\), \(0, 2\)\].*"
                                         r"split it into one island per stage"):
        check_runtime_support(plan)
    with pytest.raises(ValueError, match="runs on processes"):
        checkpoint.check_supported(plan)  # stages on only some processes of island a
    new, origin = split_islands(plan)
    assert [(i.name, i.num_processes) for i in new.islands] == [("a.0", 2), ("a.1", 1), ("b", 1)]
    assert origin == {"a.0": "a", "a.1": "a", "b": "b"} and new.world_size == 4
    check_runtime_support(new)
    checkpoint.check_supported(new)  # each stage on every process of its island
    with pytest.raises(ValueError, match=r"stages \[\(0, 1\), \(0, 2\)\] hold processes \[0, 1, 3\] of it, sharing some"):
        check_runtime_support(_two_on_a([2, 6]))  # device 2 is process 1's, held by stage 1 too
    with pytest.raises(ValueError, match="name 'a.0' of its part 0 is taken"):
        split_islands(_two_on_a().replace(islands=[*_two_on_a().to_dict()["islands"][:1],
                                                   {"name": "a.0", "platform": "cpu"}],
                                          replicas=[{"stages": [{"island": "a.0", "first_layer": 0, "last_layer": 1},
                                                                *_two_on_a().to_dict()["replicas"][0]["stages"][1:]]}]))


def test_a_stage_joining_two_components_merges_them():
    plan = Plan.from_dict({  # stages on process 0, on process 2, then one on both: one component
        "islands": [{"name": "a", "platform": "cpu", "num_processes": 3, "devices_per_process": 2}],
        "stages": [{"island": "a", "first_layer": 0, "last_layer": 0, "devices": [0]},
                   {"island": "a", "first_layer": 1, "last_layer": 1, "devices": [4]},
                   {"island": "a", "first_layer": 2, "last_layer": 2, "dp": 2, "devices": [1, 5]}],
        "global_batch_size": 8, "microbatch_size": 2})
    new, origin = split_islands(plan)
    assert [(i.name, i.num_processes) for i in new.islands] == [("a", 2)] and origin == {"a": "a"}
    assert [new.stage_devices(0, s) for s in range(3)] == [[0], [2], [1, 3]]
    with pytest.raises(ValueError, match=r"stages \[\(0, 0\), \(0, 1\), \(0, 2\)\] hold processes \[0, 2\]"):
        check_runtime_support(plan)


def test_split_command_writes_the_split_plan(tmp_path, capsys):
    src, out = tmp_path / "plan.json", tmp_path / "split.json"
    _two_on_a().to_json(src)
    assert split_main([str(src), str(out)]) == 0
    assert Plan.from_json(str(out)) == split_islands(_two_on_a())[0]
    assert split_main([]) == 2 and "usage" in capsys.readouterr().err
    assert split_main([str(tmp_path / "missing.json")]) == 2


CLUSTER = {"name": "two-groups", "groups": [{"name": "a", "device": "H100-SXM", "nodes": 4},
                                            {"name": "b", "device": "MI300X", "nodes": 2}]}


def _overlap(records, islands):
    recs = [x for x in records if x.island in islands and x.end_s > x.start_s]
    return any(x.stage != y.stage and x.start_s < y.end_s and y.start_s < x.end_s for x in recs for y in recs)


def test_planner_splits_a_multi_node_group_holding_two_stages_and_predicts_it_as_it_runs():
    from hethub_jax.planner import SearchOptions, load_cluster, load_model, search
    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.runnable import runnable_result
    from hethub_jax.planner.search import bridge_for, group_costs
    cfg, cluster = load_model("llama3-70b"), load_cluster(CLUSTER).resolved()
    # headroom 0 (the capacity in full, as when this case was chosen): its best plan holds 2 stages on
    # group a for memory; the default 5% headroom picks another one
    opt = SearchOptions(top_k=2, microbatch_sizes=(1,), hetero_dp=False, memory_headroom=0.0)
    res = search(cfg, cluster, 16, 2048, options=opt)
    searched = res.best
    with pytest.raises(ValueError, match="split it into one island per stage"):  # group a holds 2 stages (memory)
        check_runtime_support(searched.plan)
    out = runnable_result(res, cfg, cluster, 2048, options=opt)
    best = out.best
    check_runtime_support(best.plan)
    assert best.searched is not None and set(best.island_groups.values()) == {"a", "b"}
    costs = group_costs(cluster, opt.efficiency)
    pairs = list(zip([x.island for x in best.searched.plan.replicas[0].stages],
                     [x.island for x in best.searched.plan.replicas[0].stages][1:]))
    ref = predict(cfg, best.plan, {n: costs[g] for n, g in best.island_groups.items()}, seq_len=2048,
                  bridge=bridge_for(cluster, pairs))
    assert best.step_time_s == ref.step_time_s
    assert [c.step_time_s for c in out.candidates] == sorted(c.step_time_s for c in out.candidates)
    split_a = [n for n, g in best.island_groups.items() if g == "a"]
    assert len(split_a) >= 2
    # the runtime runs one process per split island: the group's stages overlap in time; as searched
    # (one island, one action at a time) they never do
    assert _overlap(best.prediction.timeline, set(split_a))
    assert not _overlap(best.searched.prediction.timeline, {"a"})


def test_plan_cli_prints_split_runnable_plans_and_as_searched_with_no_split(tmp_path, capsys):
    from hethub_jax.plan import main
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(CLUSTER))
    args = ["--model", "llama3-70b", "--cluster", str(path), "--global-batch", "16", "--seq-len", "2048",
            "--top", "1", "--microbatch-sizes", "1", "--no-hetero-dp", "--no-upper-bound",
            "--memory-headroom", "0", "--json"]  # headroom 0: the case of the test above
    assert main(args + ["--out", str(tmp_path / "p.json")]) == 0
    c = json.loads(capsys.readouterr().out)["candidates"][0]
    assert c["runnable"] is True and c["not_runnable_because"] is None
    assert sorted(set(c["island_groups"].values())) == ["a", "b"] and "a.1" in c["island_groups"]
    assert c["searched_step_time_s"] != c["step_time_s"]
    check_runtime_support(Plan.from_json(str(tmp_path / "p.json")))
    assert main(args + ["--no-split"]) == 0
    c = json.loads(capsys.readouterr().out)["candidates"][0]
    assert c["runnable"] is False and "split it into one island per stage" in c["not_runnable_because"]
    assert main(args[:-1]) == 0
    text = capsys.readouterr().out
    assert "split per stage" in text and "group a -> islands a.0, a.1" in text and "NOT RUNNABLE" not in text


def test_a_candidate_no_split_runs_keeps_its_not_runnable_line():
    from hethub_jax.models.config import LlamaConfig
    from hethub_jax.plan import candidate_dict, format_candidate
    from hethub_jax.planner.catalog import get_device
    from hethub_jax.planner.cluster import load_cluster
    from hethub_jax.planner.costs import DeviceCosts
    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.runnable import split_candidate
    from hethub_jax.planner.search import Candidate
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=11, num_attention_heads=2)
    costs = {n: DeviceCosts.from_catalog(get_device("cpu")) for n in ("a", "b")}
    cluster = load_cluster({"name": "c", "groups": [{"name": "a", "device": "cpu", "nodes": 4, "devices_per_node": 2},
                                                    {"name": "b", "device": "cpu", "nodes": 1}]}).resolved()
    plan = _two_on_a([2, 6])  # stage 2 shares process 1 with stage 1 and spans processes 1 and 3
    c = split_candidate(Candidate(plan, predict(cfg, plan, costs, seq_len=16), "pipeline", ((2, 4, 5),), 0.1),
                        cfg, cluster, costs, 16)
    assert c.searched is not None and [i.name for i in c.plan.islands] == ["a", "b"]  # idle process 2 dropped

    class _G:
        device, memory_gb = "cpu", 1.0
    text = format_candidate(0, c, {"a": _G(), "b": _G()}, None)
    assert "NOT RUNNABLE YET: island 'a' has 3 processes" in text and "sharing some" in text
    assert "processes holding no stage left out" in text and "split per stage" not in text
    assert candidate_dict(c)["runnable"] is False


# ---- session 9: the planner emits only runnable plans (rules.uniform_stages_run) ----------------------

def _uniform(k, d, p):
    """``k`` stages of ``d`` devices each (default devices: one after another) on one island of
    processes of ``p`` devices, as many processes as they need."""
    return Plan.from_dict({
        "islands": [{"name": "a", "platform": "cpu", "num_processes": -(-k * d // p), "devices_per_process": p}],
        "stages": [{"island": "a", "dp": d, "tp": 1, "first_layer": i, "last_layer": i} for i in range(k)],
        "global_batch_size": d, "microbatch_size": d})


def _runs(plan):
    try:
        check_runtime_support(split_islands(plan)[0])
    except ValueError:
        return False
    return True


def test_uniform_stages_run_is_what_the_split_and_the_runtime_check_say():
    from hethub_jax.parallel.rules import uniform_stages_run
    for k in range(1, 5):
        for d in range(1, 21):
            for p in range(1, 9):
                assert uniform_stages_run(k, d, p) == _runs(_uniform(k, d, p)), (k, d, p)
    assert not uniform_stages_run(2, 12, 8) and uniform_stages_run(2, 16, 8) and uniform_stages_run(3, 2, 8)
    with pytest.raises(ValueError, match=">= 1"):
        uniform_stages_run(0, 1, 1)


def _small_cfg(layers):
    from hethub_jax.planner import load_model
    return load_model({"preset": "tiny", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256})


#: a group of 3 nodes x 8 devices at microbatch 12: the largest DP for 2 stages at TP 1 is 12, i.e. 12
#: devices per stage, which spans nodes 0-1 and 1-2 (no split runs it); the runtime's rule gives DP 4
NODES8 = {"name": "n8", "groups": [{"name": "a", "device": "cpu", "nodes": 3, "devices_per_node": 8},
                                   {"name": "b", "device": "cpu", "nodes": 2, "devices_per_node": 4}]}


def test_level_two_keeps_only_stage_sizes_the_runtime_runs_and_without_the_rule_plans_do_not_run():
    """Mutation check of the restriction: without it (``runnable_stages=False``) the planner emits a
    candidate that no split runs; with it (default) every candidate runs after the split."""
    from hethub_jax.planner import SearchOptions, plan
    from hethub_jax.planner.search import _setup
    cfg = _small_cfg(6)
    opt = dict(microbatch_sizes=(12,), max_stages_per_group=2, tp_degrees=(1,), hetero_dp=False)
    p = _setup(cfg, NODES8, 12, 16, None, SearchOptions(**opt), None)
    assert (2, 1, 4) in p.choices("a", 12) and (1, 1, 12) in p.choices("a", 12)
    assert p.restricted[("a", 12, 2, 1)] == (12, 4)
    free = _setup(cfg, NODES8, 12, 16, None, SearchOptions(**opt, runnable_stages=False), None)
    assert (2, 1, 12) in free.choices("a", 12) and not free.restricted
    res = plan(cfg, NODES8, 12, 16, top_k=40, upper_bound=False, **opt)
    assert len(res.candidates) > 1 and all(_runs(c.plan) for c in res.candidates)
    assert any(sum(c.island_groups[x.island] == "b" for x in c.plan.replicas[0].stages) >= 2
               for c in res.candidates)  # several stages on a multi-node group (b: one node each)
    bad = plan(cfg, NODES8, 12, 16, top_k=40, upper_bound=False, runnable_stages=False, **opt)
    assert not all(_runs(c.plan) for c in bad.candidates)


@st.composite
def node_clusters(draw):
    """Random clusters of 1-2 groups of 2-3 nodes x 4 or 8 devices (cpu), a small model and batch."""
    groups = [{"name": f"g{i}", "device": "cpu", "nodes": draw(st.integers(2, 3)),
               "devices_per_node": draw(st.sampled_from([4, 8])), "slowdown": draw(st.sampled_from([1.0, 2.0]))}
              for i in range(draw(st.integers(1, 2)))]
    return (_small_cfg(draw(st.integers(3, 6))), {"name": "r", "groups": groups},
            draw(st.sampled_from([6, 12, 24])), draw(st.sampled_from([1, 2, 3])))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(node_clusters())
def test_every_emitted_candidate_runs_on_random_multi_node_clusters(problem):
    """Every candidate of ``planner.plan`` (split per stage) passes ``check_runtime_support``, and every
    stage layout of the searched plans satisfies ``uniform_stages_run`` (no NOT RUNNABLE candidate)."""
    from hethub_jax.plan import candidate_dict
    from hethub_jax.planner import PlanningError, plan
    from hethub_jax.parallel.rules import uniform_stages_run
    cfg, cluster, gbs, stages = problem
    try:
        res = plan(cfg, cluster, gbs, 16, top_k=12, upper_bound=False, max_stages_per_group=stages)
    except PlanningError:
        return
    for c in res.candidates:
        check_runtime_support(c.plan)
        assert candidate_dict(c)["runnable"] is True
        src = c.searched.plan if c.searched is not None else c.plan
        for isl in src.islands:
            keys = src.island_stages(isl.name)
            if keys:
                st0 = src.stage(*keys[0])
                assert uniform_stages_run(len(keys), st0.dp * st0.tp, isl.devices_per_process)


def test_runtime_rule_as_binding_constraint_is_named():
    """3 nodes x 8 devices, microbatch 12, 8 layers: two stages of 12 devices (DP 12) fit 4 MB per device,
    but the runtime's rule lowers DP to 4 (3x the activations per device) and one stage of 8 layers does
    not fit: the error names the rule and the plan that would fit without it."""
    import dataclasses

    from hethub_jax.planner import PlanningError, SearchOptions, exhaustive_search, load_cluster, search
    from hethub_jax.planner.search import group_costs
    cfg = _small_cfg(8)
    cl = {"name": "one", "groups": [NODES8["groups"][0]]}
    costs = {"a": dataclasses.replace(group_costs(load_cluster(cl))["a"], memory_bytes=4e6)}
    opt = SearchOptions(microbatch_sizes=(12,), max_stages_per_group=2, top_k=1, schedules=("1f1b",),
                        recompute=("none",), tp_degrees=(1,))
    free = search(cfg, cl, 12, 16, costs=costs, options=dataclasses.replace(opt, runnable_stages=False)).best
    assert [(s.dp, s.tp) for s in free.plan.replicas[0].stages] == [(12, 1), (12, 1)] and not _runs(free.plan)
    for f in (search, exhaustive_search):
        with pytest.raises(PlanningError, match="binding constraint is today's runtime's stage-size rule") as e:
            f(cfg, cl, 12, 16, costs=costs, options=opt)
        msg = str(e.value)
        assert "dp 12 -> 4" in msg and "2 stage(s) of dp 12 x tp 1 = 12 devices on 8-device nodes" in msg


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(node_clusters())
def test_search_equals_exhaustive_enumeration_of_the_runnable_space(problem):
    """The restricted level 2 is the same for both (``_Planner.choices``): the search stays exact on
    multi-node groups where the runtime's rule lowers DP (e.g. microbatch 12 or 6 on 8-device nodes)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from search_checks import assert_search_equals_exhaustive

    from hethub_jax.planner import SearchOptions, load_cluster
    cfg, cluster, gbs, stages = problem
    cfg = _small_cfg(min(cfg.num_hidden_layers, 4))
    assert_search_equals_exhaustive(cfg, load_cluster(cluster), gbs, 16,
                                    SearchOptions(top_k=2, max_stages_per_group=min(stages, 2)))


def test_search_equals_exhaustive_where_the_runtime_rule_lowers_dp():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from search_checks import assert_search_equals_exhaustive

    from hethub_jax.planner import SearchOptions, load_cluster
    assert_search_equals_exhaustive(_small_cfg(4), load_cluster(NODES8), 12, 16,
                                    SearchOptions(top_k=2, max_stages_per_group=2, microbatch_sizes=(6, 12)))
