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


# ---- the co-run slowdown by the size of the pair (fits.corun.relation) -----------------------------
import math
from types import SimpleNamespace

from hethub_jax.planner.predictor import _corun_factors


def _relation_costs(relation, factor=1.5):
    prof = _prof(factor)
    prof["fits"]["corun"]["relation"] = relation
    return DeviceCosts.from_profile(prof, corun_by_size=True)


def test_corun_extra_interpolates_the_measured_points_in_log_ratio():
    c = _relation_costs([[10.0, 0.0], [0.1, 1.0], [1.0, 0.5]])  # unsorted on purpose
    assert c.corun_relation == ((0.1, 1.0), (1.0, 0.5), (10.0, 0.0))
    assert c.corun_extra(0.1) == pytest.approx(1.0)
    assert c.corun_extra(math.sqrt(0.1)) == pytest.approx(0.75)  # halfway in log between 0.1 and 1
    assert c.corun_extra(math.sqrt(10.0)) == pytest.approx(0.25)
    assert c.corun_extra(0.001) == 1.0 and c.corun_extra(1e4) == 0.0  # held at the end points
    assert _relation_costs([]).corun_extra(3.0) == pytest.approx(0.5)  # no relation: factor - 1
    with pytest.raises(ValueError, match="size_ratio"):
        c.corun_extra(0.0)


def test_from_profile_reads_the_relation_only_when_asked_for():
    """``from_profile`` alone: the one measured factor at every size ratio (the island kind decides later,
    ``test_island_kind_decides_the_corun_model``); ``corun_by_size=True``: the measured points."""
    prof = _prof(1.5)
    prof["fits"]["corun"]["relation"] = [[0.1, 1.0], [10.0, 0.0]]
    c = DeviceCosts.from_profile(prof)
    assert c.corun_relation == () and c.corun_factor == 1.5
    assert c.corun_extra(0.1) == pytest.approx(0.5) and c.corun_extra(10.0) == pytest.approx(0.5)
    by_size = DeviceCosts.from_profile(prof, corun_by_size=True)
    assert by_size.corun_extra(0.1) == pytest.approx(1.0) and by_size.corun_extra(10.0) == 0.0


def test_fit_corun_relation_is_each_pairs_size_ratio_and_extra():
    from hethub_jax.profile import fit_corun
    fit = fit_corun([
        {"call": "first_F", "alone_s": 1.0, "busy_s": 3.0, "neighbour": "large", "neighbour_s": 10.0},
        {"call": "first_B", "alone_s": 2.0, "busy_s": 1.8, "neighbour": "large", "neighbour_s": 10.0},  # faster: 0
        {"call": "last_update", "alone_s": 4.0, "busy_s": 8.0, "neighbour": "large", "neighbour_s": 10.0},
        {"call": "last_FB", "alone_s": 10.0, "busy_s": 11.0, "neighbour": "small", "neighbour_s": 2.0}])
    assert fit["relation"] == [[0.1, pytest.approx(2.0)], [0.2, 0.0], [5.0, pytest.approx(0.1)]]
    assert fit["factor"] == pytest.approx((3.0 + 1.8 + 8.0) / (1.0 + 2.0 + 4.0))  # the large neighbour's calls
    old = fit_corun([{"call": "x", "alone_s": 1.0, "busy_s": 2.0}])  # profiles before the pairs: no relation
    assert old["relation"] == [] and old["factor"] == 2.0


def _ctx(island, costs, factor=1.0):
    return SimpleNamespace(spec=SimpleNamespace(island=island), costs=costs, factor=factor)


def test_corun_factors_by_hand_small_call_beside_a_large_one():
    """a computes 1 s at t = 0..1, b 10 s at t = 0..10 on one host. With the relation (0.1: +100%,
    10: +0%) a's call (size ratio 0.1) is slowed to 2x, b's (ratio 10) not at all; the symmetric
    factor 1.5 would slow a 1.5x and b by 1 + 0.5 x 1/10."""
    act = lambda: SimpleNamespace(is_compute=True)
    fa, fb = act(), act()
    events = [((0, 0), fa, 0.0, 1.0), ((1, 0), fb, 0.0, 10.0)]
    hosts = {(0, 0): "h", (1, 0): "h"}
    rel = _relation_costs([[0.1, 1.0], [10.0, 0.0]])
    f = _corun_factors(events, {(0, 0): _ctx("a", rel), (1, 0): _ctx("b", rel)}, hosts)
    assert f[((0, 0), id(fa))] == pytest.approx(2.0) and f[((1, 0), id(fb))] == pytest.approx(1.0)
    # a later call of a inside b's long one (b started 5 s before it) and one after it: 2x and untouched
    fa2, fa3 = act(), act()
    f = _corun_factors(events + [((0, 0), fa2, 5.0, 6.0), ((0, 0), fa3, 10.0, 11.0)],
                       {(0, 0): _ctx("a", rel), (1, 0): _ctx("b", rel)}, hosts)
    assert f[((0, 0), id(fa2))] == pytest.approx(2.0) and f[((0, 0), id(fa3))] == 1.0
    sym = _relation_costs([])
    f = _corun_factors(events, {(0, 0): _ctx("a", sym), (1, 0): _ctx("b", sym)}, hosts)
    assert f[((0, 0), id(fa))] == pytest.approx(1.5) and f[((1, 0), id(fb))] == pytest.approx(1.05)
    # the ratio is of seconds alone: a's 1 s in the timeline at the previous round's factor 2 is 0.5 s
    # alone (ratio 0.05, held at +100%); b's 10 s at factor 1.25 is 8 s alone (ratio 16: +0%)
    f = _corun_factors(events, {(0, 0): _ctx("a", rel), (1, 0): _ctx("b", rel)}, hosts,
                       {((0, 0), id(fa)): 2.0, ((1, 0), id(fb)): 1.25})
    assert f[((0, 0), id(fa))] == pytest.approx(2.0) and f[((1, 0), id(fb))] == pytest.approx(1.0)


def test_two_equal_replicas_take_the_relation_at_size_ratio_one():
    """Two equal replicas on two islands of one host compute the same actions at the same times:
    every action beside an equal one (size ratio 1), so the pipeline takes (1 + extra(1)) x alone,
    extra(1) = 0.6 halfway in log between the measured (0.5, 0.2) and (2, 1.0); on hardware of
    their own the relation changes nothing."""
    from tests.test_predictor import _two_replicas
    rel = _relation_costs([[0.5, 0.2], [2.0, 1.0]], factor=3.0)
    plan = _two_replicas(3)
    alone = predict(Cfg, plan, {"a": rel, "b": rel}, seq_len=8)
    no_rel = predict(Cfg, plan, {"a": _relation_costs([], 3.0), "b": _relation_costs([], 3.0)}, seq_len=8)
    assert alone.step_time_s == pytest.approx(no_rel.step_time_s, rel=1e-12)
    shared = rel.on_shared_host("h")
    both = predict(Cfg, plan, {"a": shared, "b": shared}, seq_len=8)
    assert both.pipeline_s == pytest.approx(1.6 * alone.pipeline_s, rel=1e-9)


def test_measure_corun_times_each_call_beside_a_large_and_a_small_neighbour():
    """The profiler's samples on this machine's XLA:CPU (2 fake devices): every call beside the large
    neighbour (another last stage's fused F+B), the last stage's fused F+B also beside the small one
    (another first stage's F then B), each with its neighbour's seconds alone; the fit's relation
    has one point per stage-call sample at ``alone_s / neighbour_s`` (no timing asserted: shared cores)."""
    import jax

    from hethub_jax.models.config import get_preset
    from hethub_jax.profile import fit_corun, measure_corun
    devs = jax.devices()
    if len(devs) < 2 or devs[0].platform != "cpu":
        pytest.skip("needs 2 CPU devices")
    s = measure_corun(get_preset("tiny"), devs[:2], 16, 1)
    assert [(x["call"], x["neighbour"]) for x in s] == [("first_F", "large"), ("first_B", "large"), ("last_FB", "large"),
                                                       ("last_update", "large"), ("last_FB", "small")]
    assert all(x["alone_s"] > 0 and x["busy_s"] > 0 and x["neighbour_s"] > 0 for x in s)
    fit = fit_corun(s)
    want = sorted(x["alone_s"] / x["neighbour_s"] for x in s if x["call"] != "last_update")
    assert [r for r, _ in fit["relation"]] == pytest.approx(want)
    assert all(e >= 0 for _, e in fit["relation"])
    assert measure_corun(get_preset("tiny"), devs[:1], 16, 1) == []


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


@pytest.mark.slow
def test_measure_corun_with_a_process_neighbour():
    """``measure_corun(neighbour="process")``: the same calls beside the same neighbours as with a thread, the
    neighbour computed by a process of its own (``_NeighbourProcess``, started and stopped by the call), every
    sample marked ``neighbour_kind: process`` and the fit saying so; another kind is refused. No timing asserted
    (shared cores); about 15 s (the neighbour process's JAX start-up and compilation)."""
    import jax

    from hethub_jax.models.config import get_preset
    from hethub_jax.profile import fit_corun, measure_corun
    devs = jax.devices()
    if len(devs) < 2 or devs[0].platform != "cpu":
        pytest.skip("needs 2 CPU devices")
    s = measure_corun(get_preset("tiny"), devs[:2], 16, 1, "process")
    assert [(x["call"], x["neighbour"]) for x in s] == [("first_F", "large"), ("first_B", "large"), ("last_FB", "large"),
                                                       ("last_update", "large"), ("last_FB", "small")]
    assert all(x["alone_s"] > 0 and x["busy_s"] > 0 and x["neighbour_s"] > 0 for x in s)
    assert {x["neighbour_kind"] for x in s} == {"process"}
    assert fit_corun(s)["neighbour_kind"] == "process"
    with pytest.raises(ValueError, match="neighbour"):
        measure_corun(get_preset("tiny"), devs[:2], 16, 1, "bogus")


def test_island_kind_decides_the_corun_model(monkeypatch):
    """``CORUN_BY_SIZE_DEFAULT`` decides per kind: islands as PROCESSES sharing a host (``on_shared_host``)
    and islands as threads of one process (``in_process``) are slowed by the measured relation by size
    ratio where the table says True, else by the one factor (both False today), unless the caller chose (``from_profile`` or the method's ``corun_by_size``). By hand, as
    ``test_two_equal_replicas_take_the_relation_at_size_ratio_one``: two equal replicas overlap wholly at
    size ratio 1, so the pipeline takes ``1 + extra(1)`` x its seconds alone: 1.6 with the relation
    ((0.5, +0.2), (2, +1.0): +0.6 at 1, halfway in log), 3.0 with the one factor 3.0."""
    from hethub_jax.planner import costs as costs_mod
    from tests.test_predictor import _two_replicas
    # the defaults of today (docs/benchmarks.md, issue 13: session 15's two quiet runs), then both kinds
    # each way through the one table
    assert costs_mod.CORUN_BY_SIZE_DEFAULT == {"processes": False, "threads": False}
    monkeypatch.setitem(costs_mod.CORUN_BY_SIZE_DEFAULT, "processes", True)
    plan = _two_replicas(3)
    prof = _prof(3.0)
    prof["fits"]["corun"]["relation"] = [[0.5, 0.2], [2.0, 1.0]]
    no_relation = _prof(3.0)
    alone = predict(Cfg, plan, {i: DeviceCosts.from_profile(prof) for i in "ab"}, seq_len=8).pipeline_s

    def ratio(costs):
        return predict(Cfg, plan, {"a": costs, "b": costs}, seq_len=8).pipeline_s / alone

    assert ratio(DeviceCosts.from_profile(prof).on_shared_host("h")) == pytest.approx(1.6, rel=1e-9)  # processes
    assert ratio(DeviceCosts.from_profile(prof).in_process("p")) == pytest.approx(3.0, rel=1e-9)  # threads
    # the caller's choice wins, in from_profile or in the method
    assert ratio(DeviceCosts.from_profile(prof, corun_by_size=False).on_shared_host("h")) == pytest.approx(3.0, rel=1e-9)
    assert ratio(DeviceCosts.from_profile(prof).on_shared_host("h", corun_by_size=False)) == pytest.approx(3.0, rel=1e-9)
    assert ratio(DeviceCosts.from_profile(prof, corun_by_size=True).in_process("p")) == pytest.approx(1.6, rel=1e-9)
    assert ratio(DeviceCosts.from_profile(prof).in_process("p", corun_by_size=True)) == pytest.approx(1.6, rel=1e-9)
    # no relation measured (profiles made with --corun off, or before session 12): the one factor either way
    assert ratio(DeviceCosts.from_profile(no_relation).on_shared_host("h")) == pytest.approx(3.0, rel=1e-9)
    # the table the other way round: processes by the one factor, threads by the relation
    monkeypatch.setitem(costs_mod.CORUN_BY_SIZE_DEFAULT, "processes", False)
    monkeypatch.setitem(costs_mod.CORUN_BY_SIZE_DEFAULT, "threads", True)
    assert ratio(DeviceCosts.from_profile(prof).on_shared_host("h")) == pytest.approx(3.0, rel=1e-9)
    assert ratio(DeviceCosts.from_profile(prof).in_process("p")) == pytest.approx(1.6, rel=1e-9)


# ---- the bridge's all-reduce of the shared gradients, measured (session 15) ---------------------------------

def test_measured_bridge_allreduce_replaces_the_ring_formula_for_the_shared_sum():
    """Two stages on two islands holding the tied embedding (vocab x hidden float32) sum its gradient over the
    bridge. Without a measured all-reduce the predictor's ring formula for 2 islands, ``2 alpha + bytes / bw``;
    with ``DeviceCosts.with_bridge_allreduce`` the measured line ``c0 + c1 x bytes`` instead. By hand: the
    step's ``allreduce_s`` moves by exactly the difference (islands on hardware of their own, so nothing is
    co-run scaled), and nothing else in the step does."""
    from hethub_jax.planner.costs import LinkModel

    class Tied(Cfg):
        tie_word_embeddings = True

    nbytes = 4.0 * Tied.vocab_size * Tied.hidden_size
    plan = chain_plan(2, 4, islands=["a", "b"])
    link = LinkModel(2e-4, 1e10)
    base = DeviceCosts.from_profile(fixed_profile(0.01, 0.02, update=0.004))
    ring = predict(Tied, plan, {"a": base, "b": base}, seq_len=8, bridge=link)
    meas = base.with_bridge_allreduce({"c0": 1e-3, "c1": 2e-9})
    got = predict(Tied, plan, {"a": meas, "b": meas}, seq_len=8, bridge=link)
    assert meas.bridge_allreduce_s(nbytes) == pytest.approx(1e-3 + 2e-9 * nbytes)
    assert got.allreduce_s - ring.allreduce_s == pytest.approx((1e-3 + 2e-9 * nbytes) - (2 * 2e-4 + nbytes / 1e10))
    assert got.update_s == pytest.approx(ring.update_s) and got.pipeline_s == pytest.approx(ring.pipeline_s)
    # only one island measured: the ring formula (the measurement is of the pair)
    one = predict(Tied, plan, {"a": meas, "b": base}, seq_len=8, bridge=link)
    assert one.allreduce_s == pytest.approx(ring.allreduce_s)
    assert base.bridge_allreduce_s(nbytes) is None and meas.with_bridge_allreduce(None).bridge_allreduce_fit is None
    with pytest.raises(ValueError, match="c1 >= 0"):
        base.with_bridge_allreduce({"c0": 0.0, "c1": -1.0})


def _ns(**kw):
    import argparse
    d = dict(corun="auto", corun_neighbour="process", pin=True)
    d.update(kw)
    return argparse.Namespace(**d)


def test_pinned_profile_refuses_what_would_share_its_core(monkeypatch):
    """``hethub_jax.profile --pin`` stops before any work, naming the constraint: a co-run neighbour THREAD
    would share the pinned core; ranks of a multi-rank launcher would all pin to one core. This process is
    not pinned by the refusals."""
    import os

    from hethub_jax import profile
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with pytest.raises(SystemExit, match="--corun-neighbour process"):
        profile._pin_profile(_ns(corun_neighbour="thread"))
    monkeypatch.setenv("MPI_LOCALRANKID", "0")
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    with pytest.raises(SystemExit, match="2 ranks"):
        profile._pin_profile(_ns())
    if before is not None:
        assert os.sched_getaffinity(0) == before
    import jax

    from hethub_jax.models.config import get_preset
    with pytest.raises(ValueError, match="must be a process"):
        profile.measure_corun(get_preset("tiny"), jax.devices()[:2], 16, 1, "thread", neighbour_core=1)


def test_pinned_profile_pins_itself_and_names_the_neighbour_core():
    """In a fresh process: ``_pin_profile`` pins every thread to the first usable core and returns the second for
    the co-run neighbour process (the profile JSON's ``pinned``); with the co-run off a thread neighbour is fine."""
    import json
    import os
    import subprocess
    import sys
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs CPU affinity and 2 usable cores")
    cpus = sorted(os.sched_getaffinity(0))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "MPI_", "PMIX_"))}
    env["PYTHONPATH"] = root
    got = []
    for corun, neighbour in (("auto", "process"), ("off", "thread")):
        code = ("import argparse, json, os\n"
                "from hethub_jax import profile\n"
                f"a = profile._pin_profile(argparse.Namespace(corun={corun!r}, corun_neighbour={neighbour!r}, pin=True))\n"
                "print(json.dumps([a, sorted(os.sched_getaffinity(0))]))\n")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        got.append(json.loads(out.strip().splitlines()[-1]))
    for pinned, own in got:
        assert (pinned["core"], pinned["neighbour_core"]) == (cpus[0], cpus[1])
        assert own == [cpus[0]]


@pytest.mark.slow
def test_pinned_neighbour_process_runs_on_its_core():
    """``_NeighbourProcess(core=c)``: every thread of the neighbour process (its JAX pool included, started after
    it pinned itself) may run on core ``c`` only, and it still answers its calls. About 15 s (its JAX start-up)."""
    import os

    from hethub_jax.models.config import get_preset
    from hethub_jax.profile import _NeighbourProcess
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs CPU affinity and 2 usable cores")
    core = sorted(os.sched_getaffinity(0))[1]
    p = _NeighbourProcess(get_preset("tiny"), 16, core)
    try:
        p.call(b"F")()
        tids = os.listdir(f"/proc/{p._p.pid}/task")
        assert len(tids) > 1  # JAX's threads exist by now
        assert {frozenset(os.sched_getaffinity(int(t))) for t in tids} == {frozenset({core})}
    finally:
        p.close()
