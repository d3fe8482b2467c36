"""The PREDICTED bucketed against unbucketed gradient all-reduce of heterogeneous DP (issue 17, session 15):
``hethub_jax.planner.predict_buckets`` and ``predict(..., grad_bucket_mb=...)``. Hand-checked cases and the
schedule simulator as references; no JAX (except the one check that the first bucket matches the runtime's),
no timing."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hethub_jax.parallel.plan import Plan, chunks_last_microbatch  # noqa: E402
from hethub_jax.parallel.schedule import get_schedule  # noqa: E402
from hethub_jax.planner import predict_buckets as pbk  # noqa: E402
from hethub_jax.planner.costs import DeviceCosts, LinkModel  # noqa: E402
from hethub_jax.planner.predictor import predict  # noqa: E402
from hethub_jax.planner.simulator import simulate  # noqa: E402
from tests.test_predictor import Cfg, fixed_profile  # noqa: E402

T = 0.05  # one fused F+B of the whole model, seconds (fixed_profile: independent of layers and tokens)
FAR = LinkModel(0.0, 1e30)  # a bridge that takes no time: the tail is the islands' own work


def _hdp(shares=(3, 1), mb=1, schedule="1f1b", slowdown=3.0):
    """One whole-model replica per island, ``shares`` rows, microbatches of ``mb``, the slow island EMULATED."""
    return Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu"},
                                       {"name": "slow", "platform": "cpu", "slowdown": slowdown}],
                           "replicas": [{"stages": [{"island": "fast", "first_layer": 0, "last_layer": 7}],
                                         "batch_share": shares[0]},
                                        {"stages": [{"island": "slow", "first_layer": 0, "last_layer": 7}],
                                         "batch_share": shares[1]}],
                           "global_batch_size": sum(shares), "microbatch_size": mb, "schedule": schedule,
                           "optimizer_sharding": "replicated"})


def _costs(ratio=None, platform=None):
    prof = fixed_profile(0.02, 0.03, t_fb=T)
    prof["fits"]["host_copy"] = {"c0": 0.0, "c1": 1e-9}  # 1 GB/s each way: the gradient sums take 2 x 1 ns/byte
    if ratio is not None:
        prof["fits"]["chunked_last"] = {"points": [[8, ratio]]}
    if platform:
        prof["platform"] = platform
    c = DeviceCosts.from_profile(prof)
    return {"fast": c, "slow": c}


# ---- the pieces ------------------------------------------------------------------------------------

def test_exposed_s_by_hand():
    assert pbk.exposed_s([1.0, 2.0], [0.5, 0.5], 2.0) == pytest.approx(0.5)  # bucket 1 runs 2.0-2.5
    assert pbk.exposed_s([1.0, 2.0], [0.5, 0.5], 3.0) == 0.0                 # all done before the end
    assert pbk.exposed_s([1.0, 1.0], [0.5, 0.5], 1.5) == pytest.approx(0.5)  # one bucket at a time: 1-1.5-2
    assert pbk.exposed_s([], [], 1.0) == 0.0


def test_ready_times_by_hand():
    # action [1, 2] s, forward a third of it, buckets 0.25 / 0.75 of the bytes: 1 + (1/3 + 2/3 x 0.25), 2
    assert pbk.ready_times(1.0, 2.0, 1 / 3, [0.25, 0.75], True) == pytest.approx([1.5, 2.0])
    assert pbk.ready_times(1.0, 2.0, 1 / 3, [0.25, 0.75], False) == [2.0, 2.0]  # handed over at the end
    with pytest.raises(ValueError):
        pbk.ready_times(2.0, 1.0, 0.5, [1.0], True)


def test_chunked_last_ratio_interpolates_the_measured_points_and_says_when_unmeasured():
    prof = fixed_profile(0.02, 0.03)
    prof["fits"]["chunked_last"] = {"points": [[64, 1.2], [128, 1.1]]}
    c = DeviceCosts.from_profile(prof)
    assert pbk.chunked_last_ratio(c, 96) == (pytest.approx(1.15), "profile")
    assert pbk.chunked_last_ratio(c, 10) == (1.2, "profile") and pbk.chunked_last_ratio(c, 999) == (1.1, "profile")
    assert pbk.chunked_last_ratio(DeviceCosts.from_catalog("H100-SXM"), 64) == (1.0, "not measured (1.0)")


def test_bucket_fractions_follow_the_runtimes_cut():
    from hethub_jax.parallel.bucket_layout import layer_chunks
    from hethub_jax.planner import analytic
    fr = pbk.bucket_fractions(Cfg, 1, 4)  # 1-byte buckets: every layer its own bucket
    assert len(fr) == Cfg.num_hidden_layers and sum(fr) == pytest.approx(1.0)
    lay = analytic.layer_params(Cfg) * 4
    head = (analytic.head_params(Cfg) + analytic.embed_params(Cfg)) * 4
    assert fr[0] == pytest.approx((lay + head) / (Cfg.num_hidden_layers * lay + head))  # the head's bucket
    # huge buckets: the first bucket (1 MiB, as the runtime caps it) closes after the last layer, which the
    # head's bytes already exceed; the second holds every other layer
    total, L = Cfg.num_hidden_layers * lay + head, Cfg.num_hidden_layers
    cut = layer_chunks([lay] * L, 0, head, 10**12, pbk.FIRST_BUCKET_BYTES)
    by_hand = [((b - a + 1) * lay + (head if j == 0 else 0)) / total for j, (a, b) in enumerate(cut)]
    assert pbk.bucket_fractions(Cfg, 10**12, 4) == pytest.approx(tuple(by_hand))
    n = len(layer_chunks([lay] * Cfg.num_hidden_layers, 0, head, 3 * lay, min(pbk.FIRST_BUCKET_BYTES, 3 * lay)))
    assert len(pbk.bucket_fractions(Cfg, 3 * lay, 4)) == n


def test_first_bucket_is_the_runtimes():
    pytest.importorskip("jax")
    from hethub_jax.parallel import buckets
    assert pbk.FIRST_BUCKET_BYTES == buckets.DEFAULT_FIRST_BUCKET_BYTES


def test_bucketing_off_reason_follows_the_runtimes_plan_conditions():
    assert pbk.bucketing_off_reason(_hdp()) is None
    one = Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu"}],
                          "stages": [{"island": "fast", "first_layer": 0, "last_layer": 7}],
                          "global_batch_size": 2, "microbatch_size": 1})
    assert "one replica" in pbk.bucketing_off_reason(one)
    assert "does not follow" in pbk.bucketing_off_reason(_hdp((4, 2), schedule="gpipe"))  # all F, then all B


# ---- through predict ---------------------------------------------------------------------------------

def test_one_replica_with_one_microbatch_is_never_chunked_nor_bucketed():
    one = Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu"}],
                          "stages": [{"island": "fast", "first_layer": 0, "last_layer": 7}],
                          "global_batch_size": 1, "microbatch_size": 1})
    p = predict(Cfg, one, {"fast": _costs(ratio=2.0)["fast"]}, seq_len=8, grad_bucket_mb=25)
    assert not chunks_last_microbatch(one.num_microbatches(0))
    assert p.grad_allreduce == "unbucketed" and p.step_time_bucketed_s is None and p.buckets is None
    assert p.step_time_s == p.step_time_unbucketed_s
    # a one-microbatch replica of a hetero-DP plan is not chunked either (it hands its gradient over)
    q = predict(Cfg, _hdp((3, 1)), _costs(ratio=2.0), seq_len=8, grad_bucket_mb=25, bridge=FAR)
    assert q.buckets["chunked_replicas"] == {"r0 (fast)": True, "r1 (slow)": False}
    assert set(q.buckets["ratio"]) == {"r0 (fast)"}


@pytest.mark.parametrize("ratio", [1.0, 1.5, 2.0])
def test_the_chunked_term_lengthens_exactly_the_chunked_replicas_last_action(ratio):
    """Shares 3:1 of microbatches of 1, the slow island EMULATED 3x: the fast replica (3 microbatches)
    chunks its last, the slow one (1) does not. Fast: 2 T + ratio T; slow: 3 T (its fused F+B and the
    emulated wait). The bucketed pipeline is the later of the two; the unbucketed one 3 T."""
    p = predict(Cfg, _hdp((3, 1)), _costs(ratio=ratio), seq_len=8, grad_bucket_mb=25, bridge=FAR)
    assert p.buckets["pipeline_s"] == pytest.approx(max(2 * T + ratio * T, 3 * T))
    assert p.step_time_unbucketed_s - p.buckets["pipeline_s"] + 0 == pytest.approx(
        predict(Cfg, _hdp((3, 1)), _costs(ratio=ratio), seq_len=8, bridge=FAR).step_time_s - p.buckets["pipeline_s"])
    fast_last = [r for r in p.timeline if r.island == "fast" and r.action.startswith("F")][-1]
    assert fast_last.end_s - fast_last.start_s == pytest.approx(ratio * T)
    assert p.buckets["ratio_source"] == {"r0 (fast)": "profile"}


def test_both_replicas_chunked_against_the_schedule_simulator():
    """Shares 6:2 (hetero_e2e's planned shape): both replicas chunk their last microbatch. Each replica's
    pipeline from ``simulate`` over its own 1F1B list with the last F carrying the chunked F+B (ratio x T,
    x3 on the EMULATED island) and every B 0 (fused); the PREDICTED bucketed pipeline is the later one."""
    ratio = 1.3
    p = predict(Cfg, _hdp((6, 2)), _costs(ratio=ratio), seq_len=8, grad_bucket_mb=25, bridge=FAR)
    ends = []
    for m, f in ((6, 1.0), (2, 3.0)):
        acts = get_schedule("1f1b")(1, m)
        last_f = max(i for i, a in enumerate(acts[0]) if a.kind.name == "F")
        tl = simulate(acts, lambda s, a, lf=acts[0][last_f], f=f: (f * T * (ratio if a is lf else 1.0)
                                                                   if a.kind.name == "F" else 0.0),
                      lambda *_: 0.0)
        ends.append(tl.makespan_s)
    assert p.buckets["pipeline_s"] == pytest.approx(max(ends))
    assert p.buckets["chunked_replicas"] == {"r0 (fast)": True, "r1 (slow)": True}


def test_the_unbucketed_step_has_no_overlap():
    """The unbucketed step is pipeline + gradient sums and norm + update, whatever the bucket size asked,
    and is what ``predict`` returned before session 15 (no ``grad_bucket_mb``)."""
    bridge = LinkModel(1e-3, 1e8)  # a slow bridge: 0.0xx s of all-reduce that buckets could hide
    base = predict(Cfg, _hdp((6, 2)), _costs(), seq_len=8, bridge=bridge)
    assert base.grad_allreduce == "unbucketed" and base.step_time_s == base.step_time_unbucketed_s
    assert base.step_time_s == pytest.approx(base.pipeline_s + base.allreduce_s + base.update_s)
    for mb in (1, 25, 1000):
        b = predict(Cfg, _hdp((6, 2)), _costs(), seq_len=8, bridge=bridge, grad_bucket_mb=mb)
        assert b.step_time_unbucketed_s == pytest.approx(base.step_time_s)
        assert b.grad_allreduce == "bucketed" and b.step_time_s == b.step_time_bucketed_s
        assert b.step_time_s == pytest.approx(b.pipeline_s + b.allreduce_s + b.update_s)
        # with a chunked ratio of 1 and no host work on the core, buckets can only hide: never slower
        assert b.step_time_bucketed_s <= b.step_time_unbucketed_s + 1e-12
        assert b.buckets["hidden_s"] > 0 and b.buckets["exposed_s"] <= b.buckets["hidden_s"] + 1e-12


def test_one_microbatch_slow_replica_hides_nothing():
    """The slow replica (one microbatch, critical) hands its whole gradient over at its end: every bucket
    is ready only then, so the whole cross-island transfer is exposed, and its own sums stay after the
    pipeline (as unbucketed): the bucketed step is no faster."""
    bridge = LinkModel(1e-3, 1e8)
    b = predict(Cfg, _hdp((3, 1)), _costs(), seq_len=8, bridge=bridge, grad_bucket_mb=25)
    assert b.buckets["cross_s"] > 0 and b.buckets["cross_exposed_s"] == pytest.approx(b.buckets["cross_s"])
    assert b.step_time_bucketed_s == pytest.approx(b.step_time_unbucketed_s)
    assert b.buckets["faster"] == "unbucketed"


def test_host_sums_move_onto_a_cpu_islands_core():
    """On a cpu-platform island the bucket thread's gradient sums run on the island's core during the
    chunked microbatch: the fast replica's last action grows by its island's sums and they leave the
    tail; on an accelerator they are not added to the action."""
    cpu = predict(Cfg, _hdp((6, 2), slowdown=1.0), _costs(platform="cpu"), seq_len=8, grad_bucket_mb=25, bridge=FAR)
    acc = predict(Cfg, _hdp((6, 2), slowdown=1.0), _costs(), seq_len=8, grad_bucket_mb=25, bridge=FAR)
    add = cpu.buckets["on_core_s"]["r0 (fast)"]
    assert add > 0 and acc.buckets["on_core_s"]["r0 (fast)"] == 0.0
    assert cpu.buckets["pipeline_s"] == pytest.approx(acc.buckets["pipeline_s"] + add)
    c = _costs(platform="cpu")["fast"]
    from hethub_jax.planner import analytic
    n = analytic.stage_params(Cfg, 0, 7, True, True)
    tensors = 9 * Cfg.num_hidden_layers + 2 + (0 if Cfg.tie_word_embeddings else 1)
    assert add == pytest.approx(c.shared_sum_s(4.0 * n, tensors), rel=0.05)


def test_train_banner_gives_both_paths_and_the_faster():
    from hethub_jax.train_predict import grad_allreduce_line, predict_run
    run = predict_run(Cfg, _hdp((6, 2)), 8, costs=_costs(ratio=1.5, platform="cpu"), grad_bucket_mb=25.0)
    p = run.prediction
    assert p.grad_allreduce == "bucketed" and p.step_time_s == p.step_time_bucketed_s
    # a 1.5x chunked microbatch on both replicas and the sums on the cores: PREDICTED slower than unbucketed
    assert p.step_time_bucketed_s > p.step_time_unbucketed_s and p.buckets["faster"] == "unbucketed"
    line = grad_allreduce_line(p)
    assert "PREDICTED faster: unbucketed" in line and "this run: bucketed" in line and line in run.banner()
    s = run.summary()
    assert (s["step_time_bucketed_s"], s["step_time_unbucketed_s"], s["faster_grad_allreduce"]) == (
        p.step_time_bucketed_s, p.step_time_unbucketed_s, "unbucketed")
    off = predict_run(Cfg, _hdp((6, 2)), 8, costs=_costs(ratio=1.5, platform="cpu")).prediction
    assert off.grad_allreduce == "unbucketed" and off.step_time_s == p.step_time_unbucketed_s
    assert grad_allreduce_line(predict_run(Cfg, _hdp((2, 2), schedule="gpipe"), 8, costs=_costs()).prediction) is None


def test_profile_fit_of_the_chunked_samples_by_hand():
    from hethub_jax.profile import fit_chunked_last
    samples = [{"kind": "chunked_last", "tokens": 512, "fused_seconds": 0.5, "seconds": 0.6, "copies_seconds": 0.7},
               {"kind": "chunked_last", "tokens": 256, "fused_seconds": 0.2, "seconds": 0.25, "copies_seconds": 0.3}]
    fit = fit_chunked_last(samples)
    assert fit["points"] == [[256, pytest.approx(1.25)], [512, pytest.approx(1.2)]]
    assert fit["copies_points"] == [[256, pytest.approx(1.5)], [512, pytest.approx(1.4)]]
    assert fit_chunked_last([]) is None
    prof = fixed_profile(0.02, 0.03)
    prof["fits"]["chunked_last"] = fit  # the predictor reads what the profiler writes
    assert pbk.chunked_last_ratio(DeviceCosts.from_profile(prof), 384) == (pytest.approx(1.225), "profile")


def test_auto_predicts_the_path_the_runtime_rule_keeps():
    """``grad_bucket_mb="auto"`` (training's default): the PREDICTED step is the path
    ``plan.keeps_bucketed_allreduce`` keeps given the two PREDICTED step times (the runtime's rule on its
    measured seconds), with 25 MiB buckets; bad values are refused."""
    from hethub_jax.parallel.plan import keeps_bucketed_allreduce
    for ratio in (1.5, 3.0):
        p = predict(Cfg, _hdp((3, 1)), _costs(ratio=ratio), seq_len=8, grad_bucket_mb="auto", bridge=FAR)
        keep = keeps_bucketed_allreduce(p.step_time_bucketed_s, p.step_time_unbucketed_s)
        assert p.step_time_s == (p.step_time_bucketed_s if keep else p.step_time_unbucketed_s)
        b = predict(Cfg, _hdp((3, 1)), _costs(ratio=ratio), seq_len=8, grad_bucket_mb=25, bridge=FAR)
        assert b.step_time_bucketed_s == p.step_time_bucketed_s
    for bad in ("fast", 0, -1.0, True):
        with pytest.raises(ValueError, match="'auto' or None"):
            predict(Cfg, _hdp((3, 1)), _costs(), seq_len=8, grad_bucket_mb=bad)


@pytest.mark.parametrize("kept", ["bucketed", "unbucketed"])
def test_the_run_predicts_the_path_its_warm_up_kept(kept, capsys):
    """Session 16 (a new user's report): ``auto``'s warm-up MEASURED one path while the PREDICTED step (and the
    banner's "this run:") was the other's. ``train._predict_kept_path`` re-predicts on the kept path: the run's
    PREDICTED step is then that path's figure of ``predict`` (independent call), the other path's kept beside it;
    nothing changes when the warm-up kept the PREDICTED path or did not choose."""
    from types import SimpleNamespace
    from hethub_jax import train
    from hethub_jax.train_predict import grad_allreduce_line, predict_run
    plan, costs = _hdp((6, 2)), _costs(ratio=1.5, platform="cpu")
    rp = predict_run(Cfg, plan, 8, costs=costs, grad_bucket_mb="auto")
    choice = {"path": kept, "bucket_mb": 25.0, "bucketed_s": 1.0, "unbucketed_s": 1.0}
    run = SimpleNamespace(rt=SimpleNamespace(grad_bucket_choice=choice), prediction=rp, plan=plan,
                          cfg=SimpleNamespace(model=Cfg), log=True)
    train._predict_kept_path(run)
    want = predict(Cfg, plan, dict(costs), seq_len=8, grad_bucket_mb=25.0 if kept == "bucketed" else None)
    p = run.prediction.prediction
    assert p.grad_allreduce == kept and p.step_time_s == want.step_time_s
    assert (p.step_time_bucketed_s, p.step_time_unbucketed_s) == (rp.prediction.step_time_bucketed_s,
                                                                    rp.prediction.step_time_unbucketed_s)
    assert f"this run: {kept}" in grad_allreduce_line(p)
    said = capsys.readouterr().out
    assert (run.prediction is rp) == (rp.prediction.grad_allreduce == kept) and (not said) == (run.prediction is rp)
    run.rt.grad_bucket_choice = None  # no choice (a number or null grad_bucket_mb): the prediction stays
    before = run.prediction
    train._predict_kept_path(run)
    assert run.prediction is before
