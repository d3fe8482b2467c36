"""Heterogeneous data parallelism: speed-proportional shares and exact token-weighted gradients."""

import jax
import numpy as np
import pytest

from hethub_jax.parallel.plan import Plan
from hethub_jax.parallel.runtime import PipelineRuntime
from hethub_jax.reference import ReferenceTrainer
from test_runtime_equivalence import OPTIM, RTOL, assert_rel, batches, model_config


def dp_plan(throughputs=None, shares=None, gbs=10, slowdown=1.0):
    reps = []
    for i in range(2):
        rep = {"stages": [{"island": f"i{i}", "first_layer": 0, "last_layer": 10}]}
        if throughputs:
            rep["throughput"] = throughputs[i]
        if shares:
            rep["batch_share"] = shares[i]
        reps.append(rep)
    return Plan.from_dict({
        "islands": [{"name": "i0", "platform": "cpu"}, {"name": "i1", "platform": "cpu", "slowdown": slowdown}],
        "replicas": reps, "global_batch_size": gbs, "microbatch_size": 1, "schedule": "1f1b",
        "recompute": "none"})


def test_speed_proportional_shares():
    assert dp_plan([3.0, 1.0]).batch_shares() == [8, 2]  # slowest needs 8/3 time units, (7,3) needs 3
    assert dp_plan().batch_shares() == [5, 5]
    with pytest.raises(ValueError, match="global batch smaller than the number of replicas"):
        dp_plan(gbs=1).validate(model_config(False))


def unpadded(gbs: int):
    """Like `batches(gbs)` but with no pad at all: every row has the same number of tokens."""
    return [dict(b, loss_mask=np.ones_like(b["loss_mask"])) for b in batches(gbs)]


# OPTIM warms up from learning rate 0 over one step, so step 0 leaves the parameters unchanged. The
# equality tests run that step first and then compare the 3 steps that move the parameters. (Not
# warmup_steps=0: Adam's first update with a non-zero rate is g / (|g| + eps), about sign(g), which
# turns float32 rounding differences of gradient entries with |g| ~ eps = 1e-8 into differences of
# order lr in the parameters, far above the tolerance; measured 1.8e-4 relative.)
STEPS = 3


def single_device_run(cfg, data):
    """The unsplit single-device run: loss and gradients of batch 0, then the warm-up step on batch 0
    and the compared steps on batches 1..STEPS, with the loss and the parameters after each."""
    ref = ReferenceTrainer(cfg, OPTIM, seed=7)
    loss0, grads = ref.gradients(data[0])
    losses, params = [], [ref.flat_params()]
    for b in data[:1 + STEPS]:
        losses.append(ref.train_step(b)[0])
        params.append(ref.flat_params())
    return dict(loss0=loss0, grads=grads, losses=losses, params=params)


def check_steps_against(rt, ref, data):
    """Batch-0 loss and gradients; the warm-up step (learning rate 0: nothing moves); then STEPS
    steps, each with the reference's loss and parameters, each changing every parameter tensor."""
    loss0, grads = rt.gradients(data[0])
    assert_rel(loss0, ref["loss0"], "loss")
    assert set(grads) == set(ref["grads"])
    for n, g in ref["grads"].items():
        assert_rel(grads[n], g, f"gradient {n}")
    before = rt.params()
    for n, p in ref["params"][0].items():
        np.testing.assert_array_equal(before[n], p)  # the same initial weights
    assert_rel(rt.train_step(data[0]).loss, ref["losses"][0], "loss at the warm-up step")
    for n, p in rt.params().items():
        np.testing.assert_array_equal(p, before[n])  # learning rate 0
    for step in range(1, 1 + STEPS):
        assert_rel(rt.train_step(data[step]).loss, ref["losses"][step], f"loss at step {step}")
        got = rt.params()
        unchanged = [n for n in got if np.array_equal(got[n], before[n])]
        assert not unchanged, f"step {step} left parameters unchanged: {unchanged}"
        for n, p in ref["params"][step + 1].items():
            assert_rel(got[n], p, f"parameter {n} after step {step}")
        before = got


def assert_replicas_bitwise_equal(rt):
    """Both replicas hold bitwise identical parameters and optimizer states."""
    a, b = rt.checkpoint_state()["r0s0"], rt.checkpoint_state()["r1s0"]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def worst_rel(got, want):
    return max(np.max(np.abs(got[n] - g)) / np.max(np.abs(g)) for n, g in want.items())


@pytest.mark.parametrize("padded", [False, True])
def test_replicas_equal_single_device(padded):
    plan = dp_plan([3.0, 1.0])
    assert plan.batch_shares() == [8, 2]
    cfg = model_config(False)
    data = batches(10, padded=True) if padded else unpadded(10)
    ref = single_device_run(cfg, data)
    rt = PipelineRuntime(plan, cfg, OPTIM, seed=7)
    # Combining the replicas' per-replica mean gradients any other way than by token weights is wrong
    # by far more than the tolerance, except where it is the same thing: a plain average weights the
    # replicas equally although their shares are 8 and 2 (wrong with or without pads); a
    # sample-weighted average (8 g0 + 2 g1) / 10 equals the token-weighted one when every row has
    # the same number of tokens (unpadded), and misses when rows carry very different numbers of
    # non-pad tokens (padded).
    single = ReferenceTrainer(cfg, OPTIM, seed=7)
    parts = [single.gradients({k: v[a:b] for k, v in data[0].items()})[1] for a, b in [(0, 8), (8, 10)]]
    plain = {n: (parts[0][n] + parts[1][n]) / 2 for n in parts[0]}
    by_samples = {n: (8 * parts[0][n] + 2 * parts[1][n]) / 10 for n in parts[0]}
    assert worst_rel(plain, ref["grads"]) > 100 * RTOL, worst_rel(plain, ref["grads"])
    if padded:
        assert worst_rel(by_samples, ref["grads"]) > 100 * RTOL, worst_rel(by_samples, ref["grads"])
    else:
        assert worst_rel(by_samples, ref["grads"]) < RTOL, worst_rel(by_samples, ref["grads"])
    check_steps_against(rt, ref, data)
    assert_replicas_bitwise_equal(rt)


def test_replica_with_in_island_dp_mesh_equals_single_device():
    # Replica 0's stage runs on a (dp=2, tp=1) mesh of two devices of island i0 (XLA reduces its
    # gradients over dp), replica 1 on one device of island i1; throughputs 3:1 over 4 microbatches of
    # 2 samples give shares (6, 2) (a share must be a multiple of microbatch_size, and microbatch_size
    # a multiple of every stage's dp).
    plan = Plan.from_dict({
        "islands": [{"name": "i0", "platform": "cpu", "devices_per_process": 2},
                    {"name": "i1", "platform": "cpu"}],
        "replicas": [
            {"stages": [{"island": "i0", "dp": 2, "first_layer": 0, "last_layer": 10}], "throughput": 3.0},
            {"stages": [{"island": "i1", "dp": 1, "first_layer": 0, "last_layer": 10}], "throughput": 1.0}],
        "global_batch_size": 8, "microbatch_size": 2, "schedule": "1f1b", "recompute": "none"})
    assert plan.batch_shares() == [6, 2]
    cfg = model_config(False)
    # Right-padded rows of very different lengths (the extreme pads). With Adam's default eps a
    # near-zero gradient entry made this comparison ill-conditioned; OPTIM's eps (see
    # test_runtime_equivalence) keeps it well inside the tolerance.
    data = batches(8, padded=True)
    rt = PipelineRuntime(plan, cfg, OPTIM, seed=7)
    assert dict(rt.stages[(0, 0)].mesh.shape) == {"dp": 2, "tp": 1}
    assert len(rt.stages[(0, 0)].mesh.devices.flat) == 2
    assert dict(rt.stages[(1, 0)].mesh.shape) == {"dp": 1, "tp": 1}
    check_steps_against(rt, single_device_run(cfg, data), data)
    assert_replicas_bitwise_equal(rt)


def test_warmup_measurement_gives_the_slow_replica_a_smaller_share():
    plan = dp_plan(gbs=8, slowdown=8.0)  # island i1 EMULATED 8x slower: a wide margin over timing noise
    rt = PipelineRuntime(plan, model_config(False), OPTIM, seed=1)
    data = batches(8)
    thr = rt.measure_throughputs(data[0], steps=1)
    assert thr[0] > 2 * thr[1], thr
    from hethub_jax.parallel.plan import proportional_shares

    shares = proportional_shares(8, thr)
    assert shares[0] > shares[1]
    rt.set_batch_shares(shares)
    before = rt.params()
    rt.train_step(data[1])  # learning rate 0 at step 0 (warm-up from 0)
    res = rt.train_step(data[2])
    assert np.isfinite(res.loss) and any(np.any(before[n] != p) for n, p in rt.params().items())
    with pytest.raises(ValueError, match="summing to global_batch_size"):
        rt.set_batch_shares([4, 3])
