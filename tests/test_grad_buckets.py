"""Bucketed gradient all-reduce overlapped with the backward (heterogeneous DP, issue 17.5) and the
share arithmetic with per-step fixed costs.

References: the unsplit single-device run (loss, gradients, parameters after several steps: the
same checks as `test_hetero_dp.py`), exhaustive search for the shares, plain arithmetic for the
bucket cut.
"""

import itertools

import numpy as np
import pytest

from hethub_jax.parallel.buckets import layer_chunks
from hethub_jax.parallel.plan import balanced_shares, proportional_shares
from hethub_jax.parallel.runtime import PipelineRuntime
from test_hetero_dp import assert_replicas_bitwise_equal, check_steps_against, dp_plan, single_device_run
from test_runtime_equivalence import OPTIM, batches, model_config


def exhaustive(units, unit_s, fixed_s):
    """The smallest achievable max_i(fixed_i + unit_i * share_i) over every split."""
    n, best = len(unit_s), None
    for cut in itertools.combinations(range(1, units), n - 1):
        shares = np.diff((0,) + cut + (units,))
        t = max(f + u * s for f, u, s in zip(fixed_s, unit_s, shares))
        best = t if best is None else min(best, t)
    return best


def test_balanced_shares_are_optimal_against_exhaustive_search():
    rng = np.random.default_rng(3)
    for _ in range(300):
        n, units = int(rng.integers(1, 4)), int(rng.integers(3, 13))
        if units < n:
            continue
        unit_s = list(rng.uniform(0.05, 1.0, n))
        fixed_s = list(rng.uniform(0.0, 2.0, n) * (rng.random(n) > 0.3))
        got = balanced_shares(units, unit_s, fixed_s)
        assert sum(got) == units and min(got) >= 1
        t = max(f + u * s for f, u, s in zip(fixed_s, unit_s, got))
        assert t == pytest.approx(exhaustive(units, unit_s, fixed_s), rel=1e-12), (units, unit_s, fixed_s, got)


def test_balanced_shares_without_fixed_costs_are_proportional():
    rng = np.random.default_rng(4)
    for _ in range(100):
        n = int(rng.integers(1, 5))
        units = int(rng.integers(n, 30))
        thr = list(rng.uniform(0.1, 5.0, n))
        assert balanced_shares(units, [1 / t for t in thr], [0.0] * n) == proportional_shares(units, thr)


def test_a_fixed_cost_moves_samples_to_the_other_replica():
    # per sample 1 s each; replica 1 pays 2 s per step more (e.g. its update on an emulated slow
    # island): 8 units split 5/3 (times 5 and 5), not 4/4 (times 4 and 6).
    assert balanced_shares(8, [1.0, 1.0], [0.0, 2.0]) == [5, 3]
    assert balanced_shares(8, [1.0, 1.0], [0.0, 0.0]) == [4, 4]
    with pytest.raises(ValueError, match="fixed_s of replica 1"):
        balanced_shares(8, [1.0, 1.0], [0.0, -1.0])
    with pytest.raises(ValueError, match="unit_s of replica 0"):
        balanced_shares(8, [0.0, 1.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="smaller than the number of replicas"):
        balanced_shares(1, [1.0, 1.0], [0.0, 0.0])


def test_layer_chunks_cut_from_the_last_layer():
    # 6 layers of 10 bytes, head 25: first bucket (cap 30) = head + layers 5 (35 >= 30); then
    # buckets of >= 20 bytes: layers 4-3, 2-1; the rest (layer 0) is the last bucket.
    assert layer_chunks([10] * 6, 0, 25, 20, 30) == [(5, 5), (3, 4), (1, 2), (0, 0)]
    assert layer_chunks([10] * 6, 0, 0, 10**6, 10**6) == [(0, 5)]   # one bucket
    assert layer_chunks([10] * 3, 4, 0, 1, 1) == [(6, 6), (5, 5), (4, 4)]  # every layer its own
    with pytest.raises(ValueError, match="bucket sizes"):
        layer_chunks([10], 0, 0, 0, 1)


@pytest.mark.parametrize("tied", [False, True])
def test_bucketed_dp_equals_single_device(tied):
    """Several buckets (every 2-3 layers its own), NaN-filled buffers, right-padded rows, global-norm
    clipping (OPTIM clips at 1.0): the same loss, gradients and parameters as the unsplit run."""
    cfg = model_config(tied)
    plan = dp_plan([3.0, 1.0])
    data = batches(10, padded=True)
    rt = PipelineRuntime(plan, cfg, OPTIM, seed=7, debug_nan=True)
    rt.grad_bucket_bytes, rt.first_grad_bucket_bytes = 20_000, 1
    check_steps_against(rt, single_device_run(cfg, data), data)
    assert_replicas_bitwise_equal(rt)
    chunks = rt._chunks[(0, 0)][1]
    assert len(chunks.chunks) >= 4 and chunks.split_embed, chunks.chunks
    # one bucket per chunk, plus the dense embedding part of an untied model
    assert rt.last_bucket_stats["num_buckets"] == len(chunks.chunks) + (0 if tied else 1), rt.last_bucket_stats


def test_chunking_rule_by_hand():
    from hethub_jax.parallel.plan import chunks_last_microbatch
    assert [chunks_last_microbatch(m) for m in (1, 2, 3, 12)] == [False, True, True, True]
    with pytest.raises(ValueError, match="at least one microbatch"):
        chunks_last_microbatch(0)


@pytest.mark.parametrize("tied", [False, True])
def test_one_microbatch_replica_hands_its_whole_gradient_to_the_buckets(tied, monkeypatch):
    """Shares 9/1 of microbatches of 1: replica 0 (9 microbatches) runs its last one chunked, replica 1
    (one microbatch: `plan.chunks_last_microbatch` is False) runs it fused, with no accumulator buffer,
    and hands its whole gradient (embedding sparse part as zero rows) to the same bucket collectives.
    Reference: the unsplit single-device run (loss, gradients, parameters over several steps), NaN-filled
    buffers, padded rows, global-norm clipping."""
    from hethub_jax.parallel import buckets as bk
    cfg = model_config(tied)
    plan = dp_plan(shares=[9, 1])
    data = batches(10, padded=True)
    rt = PipelineRuntime(plan, cfg, OPTIM, seed=7, debug_nan=True)
    rt.grad_bucket_bytes, rt.first_grad_bucket_bytes = 20_000, 1
    assert [rt.chunked_replica(r) for r in range(2)] == [True, False]
    chunked, handed = [], []
    orig_fb, orig_hand = bk.StageChunks.forward_backward, bk.StageChunks.hand_over_whole
    monkeypatch.setattr(bk.StageChunks, "forward_backward",
                        lambda self, *a, **k: (chunked.append(self), orig_fb(self, *a, **k))[1])
    monkeypatch.setattr(bk.StageChunks, "hand_over_whole",
                        lambda self, *a, **k: (handed.append(self), orig_hand(self, *a, **k))[1])
    check_steps_against(rt, single_device_run(cfg, data), data)
    assert_replicas_bitwise_equal(rt)
    assert set(chunked) == {rt._chunks[(0, 0)][1]} and set(handed) == {rt._chunks[(1, 0)][1]}
    chunks = rt._chunks[(0, 0)][1]
    assert len(chunks.chunks) >= 4 and chunks.split_embed, chunks.chunks
    assert rt.last_bucket_stats["num_buckets"] == len(chunks.chunks) + (0 if tied else 1), rt.last_bucket_stats


def test_emulated_wait_leaves_out_the_bucket_threads_cpu_time(monkeypatch):
    """On an emulated slow island the wait after an action is (factor - 1) x the island's own compute:
    the action's wall time less the CPU time the bucket all-reduce thread took meanwhile (it shares the
    core; on a real accelerator it runs on the host beside the compute). Reference: that arithmetic on
    a recorded wait, with the thread's CPU clock replaced by known values."""
    import time

    import hethub_jax.parallel.runtime as runtime_mod
    rt = PipelineRuntime(dp_plan([3.0, 1.0], slowdown=3.0), model_config(False), OPTIM, seed=0)
    waits, bg = [], iter([10.0, 10.04])  # the thread's CPU clock at the action's start and at its end
    monkeypatch.setattr(runtime_mod, "emulated_wait", waits.append)
    monkeypatch.setattr(rt, "_bg_cpu", lambda: next(bg))
    t0, bg0 = rt._mark()
    time.sleep(0.1)
    t1 = time.perf_counter()
    rt._emulate((1, 0), np.zeros(1), t0, bg0)
    wall = time.perf_counter() - t0
    assert 2 * (t1 - t0 - 0.04) <= waits[0] <= 2 * (wall - 0.04), (waits, wall)
    rt._emulate((0, 0), np.zeros(1), time.perf_counter())  # the fast island: no wait
    assert len(waits) == 1


def test_bucketing_off_reason_matches_what_a_step_does():
    """GPipe on one-stage replicas with several microbatches each runs all forwards, then all backwards:
    the last backward does not follow its own forward, so the bucketed path (which runs the last
    microbatch's forward and backward together in layer buckets) does not apply, by design. The runtime
    says so in words (training's banner, the benchmarks: no bare "0 gradient buckets"), and a step agrees
    with it: buckets exactly when no reason is given (1F1B; GPipe with one microbatch per replica)."""
    from hethub_jax.parallel.plan import Plan
    cfg = model_config(False)
    cases = [("1f1b", [8, 2], 10, True), ("gpipe", [8, 2], 10, False), ("gpipe", [1, 1], 2, True)]
    for schedule, shares, gbs, bucketed in cases:
        d = dp_plan(shares=shares, gbs=gbs).to_dict()
        d["schedule"] = schedule
        rt = PipelineRuntime(Plan.from_dict(d), cfg, OPTIM, seed=7)
        rt.set_grad_buckets(0.02)
        why, line = rt.grad_bucket_off_reason(), rt.grad_bucket_line()
        assert (why is None) == bucketed, (schedule, shares, why)
        assert ("NOT bucketed" in line) != bucketed and (bucketed or "gpipe" in why), line
        rt.last_bucket_stats = None
        rt.train_step(batches(gbs, n=1)[0])
        assert (rt.last_bucket_stats is not None and rt.last_bucket_stats["num_buckets"] > 0) == bucketed
    rt.set_grad_buckets(None)
    assert "train.grad_bucket_mb null" in rt.grad_bucket_off_reason()


def test_keeps_bucketed_allreduce_by_hand():
    """The decision rule of ``train.grad_bucket_mb: auto`` (and of a predictor): bucketed only when
    faster by more than 2% of the unbucketed step; a tie or a smaller gain keeps the simpler unbucketed
    path; bad seconds are refused."""
    from hethub_jax.parallel.plan import keeps_bucketed_allreduce
    assert keeps_bucketed_allreduce(0.40, 0.45) is True
    assert keeps_bucketed_allreduce(0.45, 0.40) is False
    assert keeps_bucketed_allreduce(0.5, 0.5) is False
    # the margin: bucketed must be faster by more than BUCKETED_MIN_GAIN (2%) of the unbucketed step
    assert keeps_bucketed_allreduce(0.495, 0.5) is False  # 1% faster: not evidence
    assert keeps_bucketed_allreduce(0.485, 0.5) is True   # 3% faster
    assert keeps_bucketed_allreduce(np.float32(1.0), 2) is True
    for bad in (-0.1, float("nan"), float("inf"), "1.0", None, True):
        with pytest.raises(ValueError, match="bucketed_step_s must be a finite number"):
            keeps_bucketed_allreduce(bad, 1.0)
        with pytest.raises(ValueError, match="unbucketed_step_s must be a finite number"):
            keeps_bucketed_allreduce(1.0, bad)


class PathClock:
    """A stubbed timer for `PipelineRuntime.choose_grad_buckets`: every second call (a timing's end)
    advances the clock by the cost of the path the runtime is on at that moment (bucketed when
    `grad_bucket_bytes` is set), so each timed pass measures exactly that cost."""

    def __init__(self, rt, bucketed_s, unbucketed_s):
        self.rt, self.cost, self.now, self.calls = rt, (bucketed_s, unbucketed_s), 100.0, 0

    def __call__(self):
        self.calls += 1
        if self.calls % 2 == 0:
            self.now += self.cost[0] if self.rt.grad_bucket_bytes is not None else self.cost[1]
        return self.now


@pytest.mark.parametrize("bucketed_s,unbucketed_s", [(0.3, 0.5), (0.5, 0.3)])
def test_auto_keeps_the_path_measured_faster_and_stays_exact(bucketed_s, unbucketed_s):
    """``grad_bucket_mb: auto`` with a stubbed timer: the runtime keeps the path whose timed passes
    took less (the stub's costs come back as the measured seconds), says so in its banner line, and
    training afterwards matches the unsplit single-device run (the timed passes apply no update).
    Shares 9/1: one chunked and one fused (one-microbatch) replica."""
    cfg = model_config(True)
    data = batches(10, padded=True)
    rt = PipelineRuntime(dp_plan(shares=[9, 1]), cfg, OPTIM, seed=7, debug_nan=True)
    rt.set_grad_buckets("auto")
    assert rt.grad_bucket_auto_pending and rt.grad_bucket_bytes == 25 * 2**20
    rt.grad_bucket_bytes, rt.first_grad_bucket_bytes = 20_000, 1  # several buckets on the small test model
    clock = PathClock(rt, bucketed_s, unbucketed_s)
    rec = rt.choose_grad_buckets(data[0], steps=2, timer=clock)
    assert clock.calls == 2 * 2 * 2  # two paths, two timed passes each, two timer calls per pass
    keep = bucketed_s < unbucketed_s  # 40% apart: far beyond the rule's 2% margin
    assert rec["path"] == ("bucketed" if keep else "unbucketed") and rec["reason"] is None
    assert rec["bucketed_s"] == pytest.approx(bucketed_s) and rec["unbucketed_s"] == pytest.approx(unbucketed_s)
    assert rt.grad_bucket_bytes == (20_000 if keep else None) and not rt.grad_bucket_auto_pending
    assert (rt._bucket_pool is not None and bool(rt._chunks)) == keep  # unbucketed: no thread, no buckets left
    assert "MEASURED" in rt.grad_bucket_line() and ("NOT bucketed" in rt.grad_bucket_line()) != keep
    assert rt.choose_grad_buckets(data[0], timer=clock) is rec and clock.calls == 8  # chosen once
    rt.last_bucket_stats = None
    check_steps_against(rt, single_device_run(cfg, data), data)
    assert_replicas_bitwise_equal(rt)
    assert (rt.last_bucket_stats is not None) == keep


def test_auto_chooses_at_the_first_step_when_nobody_measured():
    """A runtime left at ``auto`` measures both paths before its first `train_step` (real clock) and
    trains exactly as the unsplit run; a one-replica plan times nothing and says why."""
    from hethub_jax.parallel.plan import Plan
    cfg = model_config(False)
    data = batches(10, padded=True)
    rt = PipelineRuntime(dp_plan([3.0, 1.0]), cfg, OPTIM, seed=7, debug_nan=True)
    rt.set_grad_buckets("auto")
    check_steps_against(rt, single_device_run(cfg, data), data)
    assert_replicas_bitwise_equal(rt)
    rec = rt.grad_bucket_choice
    assert rec["path"] in ("bucketed", "unbucketed") and rec["bucketed_s"] > 0 and rec["unbucketed_s"] > 0
    one = PipelineRuntime(Plan.from_dict({
        "islands": [{"name": "i0", "platform": "cpu"}], "stages": [{"island": "i0", "first_layer": 0, "last_layer": 10}],
        "global_batch_size": 2, "microbatch_size": 1, "schedule": "1f1b", "recompute": "none"}), cfg, OPTIM, seed=7)
    one.set_grad_buckets("auto")
    rec = one.choose_grad_buckets({}, timer=lambda: pytest.fail("nothing to time"))
    assert rec["path"] is None and rec["bucketed_s"] is None and "one replica" in rec["reason"]


def test_bad_grad_bucket_values_give_a_clear_error():
    from hethub_jax.config import ConfigError, from_dict
    rt = PipelineRuntime(dp_plan([3.0, 1.0]), model_config(False), OPTIM, seed=7)
    for bad in ("fast", "AUTO", -1.0, 0, float("nan"), True, [25]):
        with pytest.raises(ValueError, match="number of MiB > 0, 'auto' or None"):
            rt.set_grad_buckets(bad)
        with pytest.raises(ConfigError, match="grad_bucket_mb must be a number of MiB > 0, 'auto'"):
            from_dict({"train": {"grad_bucket_mb": bad}})
    rt.set_grad_buckets("auto")
    with pytest.raises(ValueError, match="steps >= 1"):
        rt.choose_grad_buckets(batches(10, n=1)[0], steps=0)
    assert from_dict({"train": {}}).train.grad_bucket_mb == "auto"
    assert from_dict({"train": {"grad_bucket_mb": 10}}).train.grad_bucket_mb == 10.0
