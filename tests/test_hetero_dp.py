"""Heterogeneous data parallelism: speed-proportional shares and exact token-weighted gradients."""

import numpy as np
import pytest

from hethub_jax.parallel.plan import Plan
from hethub_jax.parallel.runtime import PipelineRuntime
from hethub_jax.reference import ReferenceTrainer
from test_runtime_equivalence import OPTIM, RTOL, assert_rel, batches, model_config, reference


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


def test_replicas_equal_single_device_on_padded_batch():
    plan = dp_plan([3.0, 1.0])
    ref = reference(False, 10, padded=True)
    data = batches(10, padded=True)
    rt = PipelineRuntime(plan, model_config(False), OPTIM, seed=7)
    loss0, grads = rt.gradients(data[0])
    assert_rel(loss0, ref["loss0"], "loss")
    for n, g in ref["grads"].items():
        assert_rel(grads[n], g, f"gradient {n}")
    # The test data makes the naive combination (average of the two replicas' mean-loss gradients)
    # wrong by far more than the tolerance: rows carry very different numbers of non-pad tokens.
    single = ReferenceTrainer(model_config(False), OPTIM, seed=7)
    parts = [single.gradients({k: v[a:b] for k, v in data[0].items()})[1] for a, b in [(0, 8), (8, 10)]]
    naive = {n: (parts[0][n] + parts[1][n]) / 2 for n in parts[0]}
    worst = max(np.max(np.abs(naive[n] - g)) / np.max(np.abs(g)) for n, g in ref["grads"].items())
    assert worst > 100 * RTOL, worst
    for step, b in enumerate(data[:3]):
        assert_rel(rt.train_step(b).loss, ref["losses"][step], f"loss at step {step}")
    got = rt.params()
    for n, p in ref["params"].items():
        assert_rel(got[n], p, f"parameter {n}")
    # both replicas hold bitwise identical parameters and optimizer states
    a, b = rt.checkpoint_state()["r0s0"], rt.checkpoint_state()["r1s0"]
    import jax

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


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
