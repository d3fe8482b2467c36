"""The planner's one-process-per-island bound (``search_bounds.process_bound``) and the best-first search
(``search_best_first``), session 8.

References are independent of the bounds: ``predictor.predict``'s pipeline seconds (the process-level
simulator) on random plans, and ``exhaustive_search`` (every plan of the space predicted, no bound) for the
search's result. Tightness checks make a wrong bound fail: one that over-counts exceeds ``predict``; one that
forgets the round trip after an island's forwards falls far below it when the bridge dominates.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hethub_jax.planner import SearchOptions, cluster_from_dict, exhaustive_search, load_model, search
from hethub_jax.planner.pipeline_time import makespan
from hethub_jax.planner.search import Skeleton, _setup, balanced, bridge_for, island_bound
from hethub_jax.planner.search_bounds import process_bound
from search_checks import assert_search_equals_exhaustive


def small_model(layers=6, hidden=32, heads=2, kv=1, vocab=512, tie=False):
    return load_model({"preset": "tiny", "hidden_size": hidden, "intermediate_size": 2 * hidden,
                       "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
                       "vocab_size": vocab, "tie_word_embeddings": tie})


def three_islands(bandwidth):
    return cluster_from_dict({"groups": [{"name": f"g{i}", "device": "cpu", "nodes": 1, "devices_per_node": 2,
                                          "slowdown": sd} for i, sd in enumerate((1.0, 2.0, 3.5))],
                              "default_link": {"bandwidth": bandwidth, "latency_s": 1e-4}})


def random_plans(p, rnd, n, layers=6, schedules=("1f1b", "gpipe")):
    for _ in range(n):
        order = tuple(rnd.sample(["g0", "g1", "g2"], 3))
        k = tuple(rnd.randint(1, 2) for _ in order)
        sk = Skeleton(rnd.choice([1, 2, 4]), rnd.choice(schedules), rnd.choice(["none", "full"]), order, k,
                      (1, 1, 1), (1, 1, 1))
        per_group = list(k)
        for _ in range(layers - sum(k)):
            per_group[rnd.randrange(3)] += 1
        yield sk, tuple(c for m, kk in zip(per_group, k) for c in balanced(m, kk))


@pytest.mark.parametrize("bandwidth", [5e6, 1e9])
def test_process_bound_never_exceeds_predicts_pipeline(bandwidth):
    """On random plans of three CPU islands (1-2 stages each, GPipe and 1F1B, slow and fast bridge): the
    process bound is at most ``predict``'s pipeline seconds, at least the island bound, and strictly above
    both the island bound and the concurrent-stage makespan on some plans (else it would add nothing)."""
    from hethub_jax.planner.predictor import predict
    cfg = small_model()
    p = _setup(cfg, three_islands(bandwidth), 8, 16, None, SearchOptions(), None)
    rnd, above = random.Random(21), 0
    for sk, counts in random_plans(p, rnd, 40):
        M = 8 // sk.microbatch_size
        fw, bw, act, grad, _ = p.action_times(sk, counts)
        pred = predict(cfg, p.pipeline_plan(sk, counts), p.costs, seq_len=16,
                       bridge=bridge_for(p.cluster, list(zip(sk.groups, sk.groups[1:]))))
        pb = process_bound(sk.schedule, sk.stages, M, fw, bw, act, grad)
        ib = island_bound(sk.stages, M, fw, bw, act, grad)
        assert ib * (1 - 1e-12) <= pb <= pred.pipeline_s * (1 + 1e-9), (sk, counts)
        assert p.step_lb(sk, counts) <= pred.step_time_s * (1 + 1e-9)
        above += pb > 1.001 * max(ib, makespan(sk.schedule, M, fw, bw, act, grad))
    assert above > 0


def test_process_bound_is_tight_for_gpipe_when_the_bridge_matters():
    """GPipe with the slowest island first holding two stages, its compute and the bridge of the same
    order: ``predict``'s pipeline is that island's forwards, the round trip through the later stages and
    its backwards, so the bound comes within 1% of it, where the concurrent-stage makespan and the island
    bound are 20% or more below (a bound that forgot one crossing each way would be too)."""
    from hethub_jax.planner.predictor import predict
    cfg = small_model()
    p = _setup(cfg, three_islands(4e6), 8, 16, None, SearchOptions(), None)
    order = ("g2", "g0", "g1")
    sk = Skeleton(2, "gpipe", "none", order, (2, 1, 1), (1, 1, 1), (1, 1, 1))
    counts = (2, 2, 1, 1)
    fw, bw, act, grad, _ = p.action_times(sk, counts)
    pred = predict(cfg, p.pipeline_plan(sk, counts), p.costs, seq_len=16,
                   bridge=bridge_for(p.cluster, list(zip(order, order[1:]))))
    pb = process_bound("gpipe", sk.stages, 4, fw, bw, act, grad)
    assert 0.99 * pred.pipeline_s <= pb <= pred.pipeline_s * (1 + 1e-9)
    assert pb - act[1] - grad[1] < 0.85 * pred.pipeline_s
    assert max(makespan("gpipe", 4, fw, bw, act, grad), island_bound(sk.stages, 4, fw, bw, act, grad)) < 0.85 * pb


def test_gpipe_configuration_and_split_bounds_never_exceed_predict():
    """The configuration bound with the crossings added under GPipe (``search_configs``) and the partial-
    split bound (``SplitBounds.group_lb`` with ``gpipe``) against ``predict`` on random GPipe plans over a
    slow bridge; both come within a factor 2 of it on some plans."""
    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search_configs import configuration_bounds
    cfg = small_model()
    p = _setup(cfg, three_islands(2e6), 8, 16, None, SearchOptions(), None)
    rnd, tight = random.Random(8), 0
    for sk, counts in random_plans(p, rnd, 30, schedules=("gpipe",)):
        mbs, M = sk.microbatch_size, 8 // sk.microbatch_size
        combo = {g: (k, 1, 1) for g, k in zip(sk.groups, sk.stages)}
        figs = [p.choice_figures(g, [combo[g]], mbs, sk.recompute, M, True) for g in p.groups]
        lb = float(configuration_bounds(figs, 6, M, "gpipe", p.delivery_lb(mbs))[0])
        pred = predict(cfg, p.pipeline_plan(sk, counts), p.costs, seq_len=16,
                       bridge=bridge_for(p.cluster, list(zip(sk.groups, sk.groups[1:]))))
        assert lb <= pred.step_time_s * (1 + 1e-9), (sk, counts)
        times = p.tables(sk)
        sb = p.split_bounds(sk, times)
        head, s0, best = 0.0, 0, 0.0
        for j, kk in enumerate(sk.stages):
            comp = [times[s0 + i][c] for i, c in enumerate(counts[s0:s0 + kk])]
            head, glb = sb.group_lb(j, head, comp, sum(counts[s0 + kk:]))
            best = max(best, glb)
            s0 += kk
        assert best <= pred.pipeline_s * (1 + 1e-9), (sk, counts)
        tight += lb >= 0.5 * pred.step_time_s and best >= 0.5 * pred.pipeline_s
    assert tight > 0


@st.composite
def slow_bridge_problems(draw):
    layers = draw(st.integers(2, 5))
    cfg = small_model(layers=layers, vocab=draw(st.sampled_from([256, 2048])), tie=draw(st.booleans()))
    groups = [{"name": f"g{i}", "device": "cpu", "nodes": 1, "devices_per_node": draw(st.sampled_from([1, 2])),
               "slowdown": draw(st.sampled_from([1.0, 2.0, 3.5]))} for i in range(draw(st.integers(2, 3)))]
    bw = draw(st.sampled_from([2e5, 2e6, 1e9]))
    cluster = cluster_from_dict({"groups": groups, "default_link": {"bandwidth": bw, "latency_s": 1e-4}})
    return cfg, cluster, draw(st.sampled_from([2, 4, 8])), 16


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slow_bridge_problems())
def test_best_first_search_equals_exhaustive_enumeration_over_slow_bridges(problem):
    """The best-first search with the process bound against ``exhaustive_search`` (every plan predicted)
    on small clusters whose bridge ranges from dominating the step to negligible: the same top-k step times
    (to the last bits), with fewer ``predict`` calls."""
    cfg, cluster, gbs, seq = problem
    assert_search_equals_exhaustive(cfg, cluster, gbs, seq, SearchOptions(top_k=2, max_stages_per_group=2,
                                                                          hetero_dp=False))


def test_bounds_use_the_dp_mesh_figures_predict_uses():
    """A profile whose (dp=2, tp=1) mesh and dp=2 update are measured 10x faster than one device's: the
    search's stage lines, layer bound and update must ask the costs for the same mesh as ``predict`` (else
    a bound exceeds ``predict`` on dp=2 plans and the search misses the optimum). Checked against
    ``predict`` on every split of some dp=2 configurations and against exhaustive search."""
    from hethub_jax.planner.costs import PROFILE_FORMAT, DeviceCosts
    from hethub_jax.planner.predictor import predict
    line = lambda c0, c1: {"c0": c0, "c1": c1}
    parts = lambda s: {"layer": line(1e-3 * s, 1e-9 * s), "embed": line(1e-4 * s, 0.0),
                       "head": line(2e-4 * s, 1e-9 * s), "base": line(1e-4 * s, 0.0)}
    phases = lambda s: {ph: parts(s * (2.0 if ph.startswith("B") else 1.0)) for ph in ("F", "F_nosave", "B",
                                                                                       "B_recompute")}
    prof = {"format": PROFILE_FORMAT, "device_type": "cpu", "memory_bytes": 10**12,
            "fits": {"compute": {"1": phases(1.0)}, "compute_dp": {"2x1": phases(0.1)},
                     "update": line(1e-3, 1e-9), "update_dp": {"2": line(1e-4, 1e-10)},
                     "allreduce": line(0.0, 0.0)}}
    costs = {g: DeviceCosts.from_profile(prof) for g in ("fast", "slow")}
    cfg = small_model(layers=4)
    cluster = cluster_from_dict({"groups": [{"name": n, "device": "cpu", "nodes": 1, "devices_per_node": 2,
                                             "slowdown": sd} for n, sd in (("fast", 1.0), ("slow", 2.0))]})
    opt = SearchOptions(top_k=2, max_stages_per_group=1, hetero_dp=False, microbatch_sizes=(2,))
    p = _setup(cfg, cluster, 4, 16, costs, opt, None)
    for sched in ("1f1b", "gpipe"):
        sk = Skeleton(2, sched, "none", ("fast", "slow"), (1, 1), (1, 1), (2, 2))
        for n in range(1, 4):
            pred = predict(cfg, p.pipeline_plan(sk, (n, 4 - n)), costs, seq_len=16,
                           bridge=bridge_for(p.cluster, [("fast", "slow")]))
            assert p.step_lb(sk, (n, 4 - n)) <= pred.step_time_s * (1 + 1e-9)
            assert p.step_lb(sk, (n, 4 - n)) >= 0.5 * pred.step_time_s  # the dp=2 figures, not 10x off
    got = search(cfg, cluster, 4, 16, costs=costs, options=opt)
    ref = exhaustive_search(cfg, cluster, 4, 16, costs=costs, options=opt)
    assert got.best.step_time_s == pytest.approx(ref.best.step_time_s, rel=1e-12)


@pytest.mark.parametrize("sched", ["1f1b", "gpipe"])
def test_configuration_memory_caps_admit_every_plan_that_fits(sched):
    """The configuration bound's memory caps (1F1B: per position of the group's stages, the in-flight
    microbatches ``min(k - i, M)``; GPipe: M) must never leave out a plan that fits. Each group's device
    memory is set so that its usable part (capacity less the default memory headroom) is exactly the
    largest stage memory ``predict`` reports for a random plan (the tightest memory it still fits); the bound of that plan's configuration must then be finite and not above
    ``predict``'s step time. Some plans must be ones whose memory would leave a configuration out with
    1-2 layers fewer of headroom (else memory never binds here and the test proves nothing)."""
    import dataclasses

    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search_configs import configuration_bounds
    cfg = small_model(layers=6, hidden=64)
    cluster = three_islands(1e9)
    rnd, binding = random.Random(13), 0
    base = _setup(cfg, cluster, 16, 64, None, SearchOptions(), None)
    for sk, counts in random_plans(base, rnd, 25, schedules=(sched,)):
        mbs, M = sk.microbatch_size, 16 // sk.microbatch_size
        plan = base.pipeline_plan(sk, counts)
        pred = predict(cfg, plan, base.costs, seq_len=64, bridge=bridge_for(cluster, list(zip(sk.groups, sk.groups[1:]))))
        mem = {g: max(s.memory.total for s in pred.stages if s.island == g) for g in sk.groups}
        h = SearchOptions().memory_headroom
        costs = {g: dataclasses.replace(base.costs[g], memory_bytes=int(mem[g] / (1 - h)) + 1) for g in sk.groups}
        p = _setup(cfg, cluster, 16, 64, costs, SearchOptions(), None)
        combo = {g: (k, 1, 1) for g, k in zip(sk.groups, sk.stages)}
        figs = [p.choice_figures(g, [combo[g]], mbs, sk.recompute, M if sched == "gpipe" else 0, True,
                                 M if sched == "1f1b" else 0) for g in p.groups]
        lb = float(configuration_bounds(figs, 6, M, sched, p.delivery_lb(mbs))[0])
        pred2 = predict(cfg, plan, costs, seq_len=64, bridge=bridge_for(cluster, list(zip(sk.groups, sk.groups[1:]))))
        assert p.fits(pred2) and lb <= pred2.step_time_s * (1 + 1e-9), (sk, counts, lb)
        binding += sum(f["cap"][0] for f in figs) < 6 + 2
    assert binding > 0


def test_suffix_minimax_equals_brute_force():
    """``suffix_minimax`` against enumerating every split of x layers over the groups j.. (random
    nondecreasing tables with inf below each group's stage count and above a memory cap)."""
    import itertools
    import math

    from hethub_jax.planner.search_bounds import suffix_minimax
    rnd = random.Random(5)
    for _ in range(30):
        G, L = rnd.randint(1, 4), rnd.randint(1, 9)
        tabs = []
        for _ in range(G):
            k, cap, v, t = rnd.randint(1, 2), rnd.randint(1, L + 1), 0.0, [math.inf]
            for n in range(1, L + 1):
                v += rnd.random()
                t.append(v if k <= n <= cap else math.inf)
            tabs.append(t)
        R = suffix_minimax(tabs, L)
        for j in range(G):
            for x in range(L + 1):
                best = math.inf
                for ns in itertools.product(range(L + 1), repeat=G - j - 1):
                    last = x - sum(ns)
                    if last < 0:
                        continue
                    best = min(best, max(tabs[g][n] for g, n in zip(range(j, G), ns + (last,))))
                assert R[j][x] == best, (j, x)


@pytest.mark.parametrize("bandwidth", [2e6, 1e9])
def test_order_and_rest_bounds_never_exceed_predict(bandwidth):
    """The 1F1B order bound (``search_configs.order_cycle_bounds``, the cycle bound at each island's last
    stage with the crossings of its position) and ``search_bounds.rest_lb`` on each island of a complete
    split (GPipe: ``(M - 1)`` x the island + one microbatch of everything) against ``predict`` on random
    plans; each must also exceed the bound it strengthens on some plan (else it would add nothing)."""
    import itertools

    import numpy as np

    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search_bounds import rest_lb
    from hethub_jax.planner.search_configs import order_cycle_bounds
    cfg = small_model()
    p = _setup(cfg, three_islands(bandwidth), 8, 16, None, SearchOptions(), None)
    rnd, order_gain, rest_gain = random.Random(31), 0, 0
    perms = list(itertools.permutations(range(3)))
    for sk, counts in random_plans(p, rnd, 40):
        mbs, M = sk.microbatch_size, 8 // sk.microbatch_size
        pred = predict(cfg, p.pipeline_plan(sk, counts), p.costs, seq_len=16,
                       bridge=bridge_for(p.cluster, list(zip(sk.groups, sk.groups[1:]))))
        names = list(p.groups)
        figs = [p.choice_figures(g, [(sk.stages[sk.groups.index(g)], 1, 1)], mbs, sk.recompute, 0, True, M)
                for g in names]
        k = np.array([[f["k"][0] for f in figs]], dtype=float)
        load = np.array([[f["K"][0] + f["k"][0] * f["w"][0] for f in figs]])
        own = np.array([[f["own"][0] for f in figs]])
        col = perms.index(tuple(names.index(g) for g in sk.groups))
        ob = float(order_cycle_bounds(k, load, own, M, p.delivery_lb(mbs) / 4)[0, col])
        if sk.schedule == "1f1b":
            assert ob <= pred.pipeline_s * (1 + 1e-9), (sk, counts)
            assert p.order_lb(sk) == pytest.approx(ob, rel=1e-9)
            order_gain += ob > 1.05 * (load.sum() + p.delivery_lb(mbs)) * -(-M // sum(sk.stages))
        times = p.tables(sk)
        sb = p.split_bounds(sk, times)
        s0 = 0
        for kk in sk.stages:
            isl = sum(times[s0 + i][c] for i, c in enumerate(counts[s0:s0 + kk]))
            r = rest_lb(M, sk.schedule == "gpipe", sb.total_lb, sum(sb.rt), isl)
            assert r <= pred.pipeline_s * (1 + 1e-9), (sk, counts)
            rest_gain += sk.schedule == "gpipe" and r > 1.01 * (M * isl + sum(sb.rt))
            s0 += kk
    assert order_gain > 0 and rest_gain > 0


def _group_splits(sk, L):
    """Every per-group layer count (each group >= its stage count) of ``sk`` summing to L."""
    import itertools
    G = len(sk.groups)
    for cuts in itertools.combinations(range(1, L), G - 1):
        b = (0,) + cuts + (L,)
        pg = tuple(b[i + 1] - b[i] for i in range(G))
        if all(n >= k for n, k in zip(pg, sk.stages)):
            yield pg


def _split_predictions(p, sk, times, L, cfg):
    """Yields ``(stage layer counts, predict(...))`` for every split of skeleton ``sk`` into its groups
    (each group's layers balanced over its stages) whose stages fit memory (``times`` finite)."""
    import math

    from hethub_jax.planner.predictor import predict
    for pg in _group_splits(sk, L):
        counts = tuple(c for n, k in zip(pg, sk.stages) for c in balanced(n, k))
        if any(times[s][n] == math.inf for s, n in enumerate(counts)):
            continue
        yield counts, predict(cfg, p.pipeline_plan(sk, counts), p.costs, seq_len=16,
                              bridge=bridge_for(p.cluster, list(zip(sk.groups, sk.groups[1:]))))


@pytest.mark.parametrize("bandwidth", [2e6, 1e9])
def test_joint_suffix_bounds_never_exceed_predict_and_beat_one_layer_per_stage(bandwidth):
    """``search_bounds.joint_suffix_bounds`` (session 9): for every configuration of random three-island
    pipelines (1-2 stages per group, both schedules) and EVERY split that fits, each prefix's head plus
    ``V[j]`` of the layers left is at most ``predict``'s pipeline seconds of that split (the reference: the
    process-level simulator), ``C[j]`` at most the split's actual round trip after the prefix, and the whole
    pipeline's ``V[0][L]`` at most the least ``predict`` over the splits. It must also exceed, on some
    1F1B configurations, both the order bound (``order_lb``) and the root's partial-split bound
    (``SplitBounds.group_lb`` counting each later stage at one layer plus the least slope), and come within
    15% of the least ``predict`` on some, and under 1F1B reach 99% of the least :func:`cycle_bound` over the
    splits on most configurations (a bound that dropped the cycle terms would not), under GPipe 99% of the
    least :func:`process_bound` on every configuration here (one that dropped the round trip after an island
    falls to 77-95% on a third of them)."""
    import math

    import numpy as np

    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search_bounds import cycle_bound, joint_suffix_bounds, process_bound
    L = 7
    cfg = small_model(layers=L)
    p = _setup(cfg, three_islands(bandwidth), 8, 16, None, SearchOptions(), None)
    rnd, gain, tight, checked, cyc_hits, cyc_cases, gp_hits, gp_cases = random.Random(41), 0, 0, 0, 0, 0, 0, 0
    seen = set()
    for sk, _ in random_plans(p, rnd, 14, layers=L):
        if (sk.groups, sk.stages, sk.schedule, sk.microbatch_size, sk.recompute) in seen:
            continue
        seen.add((sk.groups, sk.stages, sk.schedule, sk.microbatch_size, sk.recompute))
        M = 8 // sk.microbatch_size
        times = p.tables(sk)
        sb = p.split_bounds(sk, times)
        V, C = joint_suffix_bounds(np.array(times), sk.stages, sb.copies, sb.rt, M, sk.schedule, L)
        least = cyc = proc = math.inf
        for counts, pred in _split_predictions(p, sk, times, L, cfg):
            least = min(least, pred.pipeline_s)
            fw, bw, act, grad, _ = p.action_times(sk, counts)
            cyc = min(cyc, cycle_bound(M, fw, bw, act, grad))
            proc = min(proc, process_bound(sk.schedule, sk.stages, M, fw, bw, act, grad))
            u = [f + b for f, b in zip(fw, bw)]
            rt = [a + g for a, g in zip(act, grad)] + [0.0]
            head, s0 = 0.0, 0
            for j, k in enumerate(sk.stages):
                x = L - sum(counts[:s0])  # the layers of group j and after (s0: group j's first stage)
                assert head + V[j][x] <= pred.pipeline_s * (1 + 1e-9), (sk, counts, j)
                assert C[j][x] <= sum(u[s0:]) + sum(rt[s0:]) + 1e-12, (sk, counts, j)
                head += sum(u[s0:s0 + k]) + sum(rt[s0:s0 + k])
                s0 += k
            checked += 1
        if least == math.inf:
            assert V[0][L] == math.inf
            continue
        assert V[0][L] <= least * (1 + 1e-9)
        tight += V[0][L] >= 0.85 * least
        if sk.schedule == "1f1b":
            _, root = sb.group_lb(0, 0.0, [times[i][1] for i in range(sk.stages[0])], L - sk.stages[0])
            gain += V[0][L] > 1.02 * max(p.order_lb(sk), root)
            cyc_cases += 1
            cyc_hits += V[0][L] >= 0.99 * cyc
        else:
            gp_cases += 1
            gp_hits += V[0][L] >= 0.99 * proc
    assert checked > 20 and tight > 0 and gain > 0 and cyc_hits > cyc_cases / 2 and gp_hits == gp_cases > 0


def test_order_fits_equals_brute_force_over_splits():
    """``_Planner.order_fits`` (balanced() capacity of each group at its pipeline positions) against trying
    every split with the memory-capped tables: False exactly when no split fits (also for more stages than
    layers, 3 x 3 > 8). Memory is set so that caps bind: the device sizes are derived from the PREDICTED
    memory (``stage_memory_bytes``) of a 1F1B last stage at microbatch 2 holding n = 2, 4, 6, 8 layers (its
    fused forward + backward's residuals included): capacities whose usable part (less the default memory
    headroom) is exactly that memory. At some size some orders fail and some fit (not guessed constants:
    with the fused stage's residuals counted, the sizes used before let no order fit)."""
    import dataclasses
    import itertools
    import math

    from hethub_jax.planner.predictor import stage_memory_bytes
    L = 8
    cfg = small_model(layers=L, hidden=64)
    cluster = three_islands(1e9)
    base = _setup(cfg, cluster, 16, 64, None, SearchOptions(), None)
    usable = 1 - SearchOptions().memory_headroom
    sizes = [stage_memory_bytes(cfg, 0, n - 1, False, True, microbatch_size=2, seq_len=64, dp=1, tp=1, in_flight=0,
                                recompute="none").total / usable for n in (2, 4, 6, 8)]
    outcomes, mixed = set(), 0
    for mem in sizes:
        costs = {g: dataclasses.replace(base.costs[g], memory_bytes=int(mem)) for g in base.groups}
        p = _setup(cfg, cluster, 16, 64, costs, SearchOptions(), None)
        here = set()
        for order in itertools.permutations(["g0", "g1", "g2"]):
            for k in itertools.product((1, 2, 3), repeat=3):
                for sched, mbs in (("1f1b", 2), ("1f1b", 8), ("gpipe", 4)):
                    sk = Skeleton(mbs, sched, "none", order, k, (1, 1, 1), (1, 1, 1))
                    times = p.tables(sk)
                    fits = any(all(times[s][n] < math.inf for s, n in enumerate(
                        c for m, kk in zip(pg, k) for c in balanced(m, kk))) for pg in _group_splits(sk, L))
                    assert p.order_fits(sk) == fits, (sk, mem)
                    here.add(fits)
        outcomes |= here
        mixed += here == {True, False}
    assert outcomes == {True, False} and mixed > 0


@pytest.mark.parametrize("bandwidth", [2e6, 1e9])
def test_kind_bound_holds_for_every_tp_dp_choice_and_split(bandwidth):
    """``_Planner.kind_bound`` (session 9: one joint suffix bound per pipeline order and stage counts, on the
    elementwise least stage tables over the groups' TP/DP choices) and ``kind_config_lb`` (its least over
    the orders) against ``predict`` on EVERY split of random configurations whose groups take different TP
    degrees (so the choices differ in speed and memory): never above the step time nor the configuration's
    own joint bound, and above half of the least step time on some configurations (a bound that took the slowest choice would exceed ``predict``; one that
    forgot the crossings would be far below)."""
    import math

    import numpy as np

    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search_bounds import joint_suffix_bounds
    L = 6
    cfg = small_model(layers=L)
    p = _setup(cfg, three_islands(bandwidth), 8, 16, None, SearchOptions(), None)
    rnd, tight, checked = random.Random(77), 0, 0
    for _ in range(16):
        mbs, sched, rec = rnd.choice([1, 2, 4]), rnd.choice(["1f1b", "gpipe"]), rnd.choice(["none", "full"])
        order = tuple(rnd.sample(["g0", "g1", "g2"], 3))
        combo = {g: rnd.choice(p.choices(g, mbs)) for g in order}
        sk = Skeleton(mbs, sched, rec, order, tuple(combo[g][0] for g in order), tuple(combo[g][1] for g in order),
                      tuple(combo[g][2] for g in order))
        kb = p.kind_bound(mbs, rec, sched, sk.groups, sk.stages)
        cb = p.kind_config_lb(mbs, rec, sched, tuple(combo[g] for g in p.groups))
        assert cb <= kb
        times = p.tables(sk)
        sb = p.split_bounds(sk, times)
        own = joint_suffix_bounds(np.array(times), sk.stages, sb.copies, sb.rt, 8 // mbs, sched, L)[0][0][L]
        assert kb <= own * (1 + 1e-12)
        least = math.inf
        for counts, pred in _split_predictions(p, sk, times, L, cfg):
            assert kb <= pred.step_time_s * (1 + 1e-9), (sk, counts)
            least = min(least, pred.step_time_s)
            checked += 1
        tight += least < math.inf and kb >= 0.5 * least
    assert checked > 20 and tight > 0


def test_replica_may_fit_never_drops_a_replica_that_fits():
    """``_Planner.replica_may_fit`` (the hetero-DP family's memory filter, session 9) against the replica's
    own capped tables (what ``replica_of`` admits): whenever it says False, no balanced layer spread of that
    choice fits under either schedule; and at the memory sizes used it says False on some choices and True
    on some (else it filters nothing, or everything); some 1F1B replicas that fit would be dropped by a
    filter that counted M microbatches in flight on the first stage instead of ``min(k, M)``."""
    import dataclasses
    import math
    L = 8
    cfg = small_model(layers=L, hidden=64)
    cluster = cluster_from_dict({"groups": [{"name": "g1", "device": "cpu", "nodes": 2, "devices_per_node": 2}]})
    base = _setup(cfg, cluster, 16, 512, None, SearchOptions(max_stages_per_group=4), None)
    said, tight = set(), 0
    for mem in (1.5 ** e * 1e6 for e in range(14)):
        costs = {g: dataclasses.replace(base.costs[g], memory_bytes=int(mem)) for g in base.groups}
        p = _setup(cfg, cluster, 16, 512, costs, SearchOptions(max_stages_per_group=4), None)
        for mbs in (1, 2, 8):
            M = 16 // mbs
            for rec in ("none", "full"):
                for k, tp, dp in p.choices("g1", mbs):
                    ok = p.replica_may_fit("g1", k, tp, dp, mbs, rec, M)
                    said.add(ok)
                    for sched in ("1f1b", "gpipe"):
                        sk = Skeleton(mbs, sched, rec, ("g1",), (k,), (tp,), (dp,))
                        fits = p.group_tables(sk, p.tables(sk, M))[0][L] < math.inf
                        assert ok or not fits, (k, tp, dp, mbs, rec, sched, mem)
                        tight += ok and fits and sched == "1f1b" and 2 <= k < M and k * p.stage_cap(
                            "g1", tp, dp, mbs, rec, False, False, M) < L
    assert said == {True, False} and tight > 0


def test_joint_group_step_rows_and_ranges_match_the_full_recursion():
    """``joint_group_step`` (numpy, restricted to the layer counts that fit, several suffixes at once for
    the root) against the same recursion written out in pure Python over every layer count (single-stage
    groups, random tables with memory caps, no crossings), and never above the brute-force least of the
    terms over every split; each root row of a batch equals that row alone."""
    import itertools
    import math

    import numpy as np

    from hethub_jax.planner.search_bounds import joint_group_step, joint_suffix_bounds, terminal_suffix
    rnd = random.Random(9)
    for _ in range(60):
        L, M, G = rnd.randint(3, 7), rnd.choice([1, 3, 8]), rnd.randint(1, 3)
        sched = rnd.choice(["1f1b", "gpipe"])
        tabs = np.full((G, L + 1), math.inf)
        for g in range(G):
            lo, cap = rnd.randint(1, 2), rnd.randint(2, L)
            a, b = rnd.random(), rnd.random()
            tabs[g, lo:cap + 1] = a + b * np.arange(lo, cap + 1)
        V, C = joint_suffix_bounds(tabs, [1] * G, [0.0] * G, [0.0] * G, M, sched, L)
        # the recursion in pure Python: group g (stage g, S - g stages to the end) holding n layers
        Vr, Cr = [0.0] + [math.inf] * L, [0.0] + [math.inf] * L
        for g in range(G - 1, -1, -1):
            nv, nc = [math.inf] * (L + 1), [math.inf] * (L + 1)
            for x in range(L + 1):
                for n in range(x + 1):
                    t, y = tabs[g, n], x - n
                    if t == math.inf or Cr[y] == math.inf:
                        continue
                    a = M * t
                    if sched == "1f1b":
                        a = max(a, -(-M // (G - g)) * (t + Cr[y]))
                    else:
                        a = max(a, M * t + Cr[y])
                    nv[x] = min(nv[x], max(a, t + Vr[y]))
                    nc[x] = min(nc[x], t + Cr[y])
            Vr, Cr = nv, nc
            for x in range(L + 1):
                assert V[g][x] == pytest.approx(Vr[x], rel=1e-12, abs=0) if Vr[x] < math.inf else V[g][x] == math.inf
                assert C[g][x] == pytest.approx(Cr[x], rel=1e-12, abs=0) if Cr[x] < math.inf else C[g][x] == math.inf
        best = math.inf
        for cuts in itertools.combinations(range(1, L), G - 1):
            b = (0,) + cuts + (L,)
            t = [tabs[g, b[g + 1] - b[g]] for g in range(G)]
            if any(x == math.inf for x in t):
                continue
            terms = [sum(t[:g]) + M * t[g] for g in range(G)]
            if sched == "1f1b":
                terms += [sum(t[:g]) + -(-M // (G - g)) * sum(t[g:]) for g in range(G)]
            else:
                terms += [sum(t[:g]) + M * t[g] + sum(t[g + 1:]) for g in range(G)]
            best = min(best, max(terms))
        assert V[0][L] <= best * (1 + 1e-12)
        rows = [terminal_suffix(L)] + [(np.sort(np.random.default_rng(i).random(L + 1)),) * 2 for i in range(3)]
        got, _ = joint_group_step(tabs[:1], [0.0], [G], M, sched, np.stack([r[0] for r in rows]),
                                  np.stack([r[1] for r in rows]), root=True)
        for i, (v, c) in enumerate(rows):
            one, _ = joint_group_step(tabs[:1], [0.0], [G], M, sched, v, c, root=True)
            assert got[i] == one


def test_row_cheap_bound_is_below_every_configuration_of_its_row():
    """``_Planner.row_cheap_bound`` (session 9: a configuration row is built only when the stream reaches
    it) against ``configuration_bounds`` of every configuration of the row, for every (microbatch size,
    recompute, schedule) of a three-group cluster with several TP/stage choices: never above the least
    finite one, and within 5% of it on most rows (fast bridge: the loads dominate; a relaxation taking the
    slowest choice or the fewest stages would exceed it, one that dropped the loads would fall far below)."""
    import math

    from hethub_jax.planner.search_configs import configuration_bounds
    cfg = small_model(layers=8, heads=4, kv=2)
    cluster = cluster_from_dict({"groups": [{"name": f"g{i}", "device": "cpu", "nodes": 2, "devices_per_node": 2,
                                             "slowdown": sd} for i, sd in enumerate((1.0, 2.0, 3.5))],
                                 "default_link": {"bandwidth": 1e9, "latency_s": 1e-4}})
    p = _setup(cfg, cluster, 16, 16, None, SearchOptions(max_stages_per_group=3), None)
    names, rows, close = list(p.groups), 0, 0
    for mbs in p.microbatch_sizes():
        M = 16 // mbs
        for rec in ("none", "full"):
            choices = [p.choices(g, mbs) for g in names]
            for sched in ("1f1b", "gpipe"):
                per = [p.choice_figures(g, cs, mbs, rec, M if sched == "gpipe" else 0, True,
                                        M if sched == "1f1b" else 0) for g, cs in zip(names, choices)]
                full = configuration_bounds(per, 8, M, sched, p.delivery_lb(mbs))
                least = float(full.min())
                cheap = p.row_cheap_bound(per, M, sched, mbs)
                assert cheap <= least * (1 + 1e-12), (mbs, rec, sched)
                if least < math.inf:
                    rows += 1
                    close += cheap >= 0.95 * least
    assert rows > 4 and close > rows / 2
