"""Measured whole-stage shapes (``python -m hethub_jax.profile --stage-shapes``) in the cost model and the
predictor, and the profile's note on other processes' CPU share excluding the job's own ranks (issue 17,
benchmarks/hetero_e2e.py). Synthetic profiles, hand-checked figures, no timing."""
from __future__ import annotations

import os

import pytest

from hethub_jax.planner.costs import PROFILE_FORMAT, DeviceCosts
from hethub_jax.planner.predictor import predict, predicted_records, stage_compute_s

SEQ = 8


def _cfg():
    from hethub_jax.models.config import LlamaConfig
    return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                       tie_word_embeddings=False)


def _profile(shapes=()):
    """Every stage call costs 0.5 s + 0.5 s per layer in every phase (no per-token term, no embedding or head
    cost: ``tests/test_train_insight.fixed_profile``'s lines with t = 1 s), no update or all-reduce cost;
    ``shapes``: ``stage_shape`` samples as ``(layers, is_first, is_last, phase, tokens, seconds)``."""
    zero = {"c0": 0.0, "c1": 0.0}
    parts = {"layer": {"c0": 0.5, "c1": 0.0}, "embed": zero, "head": zero, "base": {"c0": 0.5, "c1": 0.0}}
    return {"format": PROFILE_FORMAT, "device_type": "cpu", "memory_bytes": 10**12, "emulated_slowdown": 1.0,
            "seq_len": SEQ,
            "fits": {"compute": {"1": {ph: parts for ph in ("F", "F_nosave", "B", "B_recompute")}},
                     "update": zero, "allreduce": zero},
            "samples": [{"kind": "stage_shape", "layers": n, "is_first": f, "is_last": l, "dp": 1, "tp": 1,
                         "phase": ph, "tokens": t, "microbatch_size": t // SEQ, "seconds": s,
                         "first_layer": 0, "last_layer": n - 1} for n, f, l, ph, t, s in shapes]}


WHOLE = [(4, True, True, "B_recompute", 16, 3.0), (4, True, True, "B_recompute", 32, 7.0),
         (4, True, True, "B_recompute", 64, 11.0), (4, True, True, "F", 16, 1.0)]


def test_measured_stage_seconds_are_read_and_interpolated_not_extrapolated():
    c = DeviceCosts.from_profile(_profile(WHOLE))
    m = lambda tokens, phase="B_recompute", layers=4, first=True, last=True: c.measured_stage_s(
        layers, first, last, tokens, 1, phase)
    assert m(16) == 3.0 and m(32) == 7.0 and m(64) == 11.0          # measured counts: the measured seconds
    assert m(24) == pytest.approx(5.0) and m(48) == pytest.approx(9.0)  # halfway between two counts
    assert m(8) is None and m(128) is None                          # outside: no extrapolation
    assert m(16, "F") == 1.0 and m(24, "F") is None                 # one count of a phase: only there
    assert m(16, "B") is None                                       # a phase not measured
    assert m(16, layers=3) is None and m(16, last=False) is None    # another shape
    assert c.measured_stage_s(4, True, True, 16, 2, "B_recompute") is None  # another TP degree
    with pytest.raises(ValueError, match="phase"):
        c.measured_stage_s(4, True, True, 16, 1, "X")
    # repeated samples of one count: their mean
    c2 = DeviceCosts.from_profile(_profile(WHOLE + [(4, True, True, "B_recompute", 16, 4.0)]))
    assert c2.measured_stage_s(4, True, True, 16, 1, "B_recompute") == pytest.approx(3.5)
    # the catalog and profiles without the samples: none measured
    assert DeviceCosts.from_catalog("cpu").measured_stage_s(4, True, True, 16, 1, "F") is None
    assert DeviceCosts.from_profile(_profile()).stage_shapes == {}


def test_stage_compute_uses_the_measured_shape_and_the_fits_otherwise():
    cfg, c = _cfg(), DeviceCosts.from_profile(_profile(WHOLE))
    whole = lambda tokens, phase: stage_compute_s(cfg, c, 0, 3, True, True, tokens, SEQ, 1, phase)
    assert whole(32, "B_recompute") == 7.0 and whole(48, "B_recompute") == pytest.approx(9.0)
    # not measured (another phase, count or shape): the fitted lines, 0.5 + 4 x 0.5 = 2.5 s per phase; the
    # fitted B_recompute is floored at B + F_nosave = 5 s (predictor.stage_compute_s)
    assert whole(32, "B") == pytest.approx(2.5) and whole(128, "F") == pytest.approx(2.5)
    assert whole(128, "B_recompute") == pytest.approx(5.0)
    assert stage_compute_s(cfg, c, 0, 1, True, False, 32, SEQ, 1, "F") == pytest.approx(1.5)


def _one_stage_plan(mbs=4, gbs=8, slowdown=1.0):
    from hethub_jax.parallel.plan import Plan
    return Plan.from_dict({"islands": [{"name": "a", "platform": "cpu", "slowdown": slowdown}],
                           "stages": [{"island": "a", "first_layer": 0, "last_layer": 3}],
                           "global_batch_size": gbs, "microbatch_size": mbs, "schedule": "1f1b", "seq_len": SEQ})


@pytest.mark.parametrize("slowdown", [1.0, 3.0])
def test_predicted_fused_forward_backward_of_a_one_stage_plan_is_the_measured_one(slowdown):
    """One stage holding the whole model under 1F1B: every forward is fused with its backward (phase
    B_recompute); at microbatch 4 (32 tokens) that call was measured at 7 s, so each predicted F+B action
    takes 7 s x the EMULATED slowdown and the pipeline 2 microbatches x that."""
    cfg, plan = _cfg(), _one_stage_plan(slowdown=slowdown)
    costs = {"a": DeviceCosts.from_profile(_profile(WHOLE))}
    recs = predicted_records(cfg, plan, costs, seq_len=SEQ)
    fused = [r for r in recs if r.action.startswith("F")]
    assert len(fused) == 2
    assert all(r.end_s - r.start_s == pytest.approx(7.0 * slowdown) for r in fused)
    pred = predict(cfg, plan, costs, seq_len=SEQ)
    assert pred.pipeline_s == pytest.approx(2 * 7.0 * slowdown)
    # without the measured shape: the fitted lines, B_recompute floored at B + F_nosave = 5 s per call
    pred_fit = predict(cfg, plan, {"a": DeviceCosts.from_profile(_profile())}, seq_len=SEQ)
    assert pred_fit.pipeline_s == pytest.approx(2 * 5.0 * slowdown)


def test_parse_stage_shapes():
    from hethub_jax.profile import parse_stage_shapes
    assert parse_stage_shapes("0-7, 0-3,0-7", 8) == [(0, 7), (0, 3)]
    assert parse_stage_shapes("", 8) == []
    for bad in ("0-8", "3-2", "x", "1"):
        with pytest.raises(ValueError, match="stage shape"):
            parse_stage_shapes(bad, 8)


# ---- the profile's note on other processes: the job's own ranks are not "other processes" ----------

def test_process_cpu_seconds_reads_proc_stat(tmp_path, monkeypatch):
    """utime + stime (fields 14, 15 of /proc/<pid>/stat, after a command name that may hold spaces and
    parentheses) over the clock ticks per second; 0.0 for a process that is not there."""
    from hethub_jax import profile
    tck = os.sysconf("SC_CLK_TCK")
    stat = "4242 (python (x) y) S 1 2 3 4 5 6 7 8 9 10 " + f"{3 * tck} {2 * tck}" + " 0 0 20 0 1 0 0 0"
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: __import__("io").StringIO(stat)
                        if p == "/proc/4242/stat" else real_open(p, *a, **k))
    assert profile.process_cpu_seconds(4242) == pytest.approx(5.0)
    monkeypatch.undo()
    assert profile.process_cpu_seconds(2**22 + 12345) == 0.0  # above the kernel's pid limit: never there


def test_a_concurrent_rank_of_the_job_is_not_counted_as_other_load(monkeypatch):
    """Two pinned ranks profiling at once on a 2-core machine (hetero_e2e --profile-islands): the machine's
    busy CPU seconds grow by both ranks' (here 10 s each over 10 s), so without the peer's id the note
    says the others used half the machine (the false alarm); given the peer's id (``--job-pids``) its
    CPU seconds count as the job's and the others' share is 0."""
    from hethub_jax import profile
    peer = {"cpu": 100.0}
    monkeypatch.setattr(profile, "process_cpu_seconds", lambda pid: peer["cpu"] if pid == 777 else 0.0)
    cores = os.cpu_count() or 1
    own0 = sum(os.times()[:2])
    before = profile.cpu_snapshot([777])
    assert before[2] - own0 == pytest.approx(100.0, abs=0.5)  # this process's seconds + the peer's
    assert profile.cpu_snapshot([os.getpid()])[2] - own0 < 0.5  # this process itself is not added twice
    # 10 s later: the machine's busy seconds grew by 10 s per rank, the peer's by 10 s, ours by 10 s
    w, b, o = before
    own_after = o - 100.0 + 10.0
    after_with = (w + 10.0, b + 20.0, own_after + 110.0)
    after_without = (w + 10.0, b + 20.0, own_after)
    assert profile.others_share((w, b, o - 100.0), after_without) == pytest.approx(10.0 / (10.0 * cores))
    assert profile.others_share(before, after_with) == pytest.approx(0.0, abs=1e-12)


# ---- the planner with measured shapes: its bounds must stay lower bounds of predict -----------------

@pytest.mark.parametrize("scale", [(0.25, 0.25), (0.25, 1.6), (1.6, 0.25)])
@pytest.mark.parametrize("shape", [(0, 3), (0, 2), (2, 3)])
def test_search_with_measured_stage_shapes_equals_exhaustive(scale, shape):
    """hetero_e2e's cluster shape (two one-device groups, one EMULATED 3x slower), a 4-layer model, every
    microbatch size of a global batch of 8: one stage shape (the whole model, its first three layers or
    its last two) measured at every microbatch size and phase at ``scale`` x what the fitted lines give
    (``scale[0]`` at microbatches 1 and 2, ``scale[1]`` at 4 and 8; below the lines a bound built from
    the lines alone exceeds predict's figure: before the search knew of measured shapes it missed the
    best plan for the (0, 2) shape at 0.25). The search's best plan must equal exhaustive search's (every
    plan predicted, no bounds)."""
    import copy as _copy

    from hethub_jax.planner import SearchOptions, cluster_from_dict, exhaustive_search, search
    cfg = _cfg()
    lines = DeviceCosts.from_profile(_fit_profile())
    fl, ll = shape
    n, first, last = ll - fl + 1, fl == 0, ll == cfg.num_hidden_layers - 1
    shapes = [(n, first, last, ph, m * SEQ,
               scale[m >= 4] * stage_compute_s(cfg, lines, fl, ll, first, last, m * SEQ, SEQ, 1, ph))
              for m in (1, 2, 4, 8) for ph in ("F", "F_nosave", "B", "B_recompute")]
    prof = _fit_profile()
    prof["samples"] = _profile(shapes)["samples"]
    costs = {g: DeviceCosts.from_profile(prof) for g in ("fast", "slow")}
    assert costs["fast"].measured_stage_s(n, first, last, 4 * SEQ, 1, "F") is not None
    cluster = cluster_from_dict({"groups": [{"name": "fast", "device": "cpu", "nodes": 1, "devices_per_node": 1},
                                            {"name": "slow", "device": "cpu", "nodes": 1, "devices_per_node": 1,
                                             "slowdown": 3.0}],
                                 "links": [{"between": ["fast", "slow"], "bandwidth": 1e9, "latency_s": 5e-5}]})
    opt = SearchOptions(top_k=1, tp_degrees=(1,))
    got = search(cfg, cluster, 8, SEQ, costs=_copy.deepcopy(costs), options=opt)
    ref = exhaustive_search(cfg, cluster, 8, SEQ, costs=_copy.deepcopy(costs), options=opt)
    assert got.best.step_time_s == pytest.approx(ref.best.step_time_s, rel=1e-12)


def _fit_profile():
    """Lines with a per-token term (tests/test_dp_profile.py's shape): base 2e-4 s, a layer 1e-4 s + 2e-9 s
    per forward FLOP, the embedding and head free; backward phases 2x; update 1e-4 s per call."""
    zero = {"c0": 0.0, "c1": 0.0}
    parts = lambda s: {"layer": {"c0": 1e-4 * s, "c1": 2e-9 * s}, "embed": zero, "head": {"c0": 3e-4 * s, "c1": 1e-9 * s},
                       "base": {"c0": 2e-4 * s, "c1": 0.0}}
    return {"format": PROFILE_FORMAT, "device_type": "cpu", "memory_bytes": 10**12, "emulated_slowdown": 1.0,
            "seq_len": SEQ,
            "fits": {"compute": {"1": {ph: parts(2.0 if ph.startswith("B") else 1.0)
                                       for ph in ("F", "F_nosave", "B", "B_recompute")}},
                     "update": {"c0": 1e-4, "c1": 0.0}, "allreduce": zero}}
