"""Sharded optimizer update across heterogeneous-DP replicas (ZeRO-1, `Plan.optimizer_sharding`).

References: the unsplit single-device run (`hethub_jax.reference.ReferenceTrainer`) for loss,
gradients and parameters; the replicated update of the same plan; plain numpy sums for the host
collectives of `hethub_jax.parallel.zero`.
"""

import threading

import jax
import numpy as np
import pytest

from hethub_jax.comm import LocalCommunicator
from hethub_jax.parallel import zero
from hethub_jax.parallel.plan import Plan, zero1_owners
from hethub_jax.parallel.runtime import PipelineRuntime
from test_hetero_dp import assert_replicas_bitwise_equal, check_steps_against, dp_plan, single_device_run
from test_runtime_equivalence import OPTIM, assert_rel, batches, model_config


def with_sharding(plan: Plan, mode: str, **changes) -> Plan:
    return plan.replace(optimizer_sharding=mode, **changes)


# ---- ownership --------------------------------------------------------------------------------
def test_owners_follow_the_shares_by_hand():
    assert zero1_owners({"a": 6, "b": 3, "c": 1}, [3, 1]) == {"a": 0, "b": 0, "c": 1}
    assert zero1_owners({"a": 6, "b": 3, "c": 1}, [1, 1]) == {"a": 0, "b": 1, "c": 1}
    assert zero1_owners({"x": 5}, [1, 4]) == {"x": 1}  # 5/4 < 5/1
    with pytest.raises(ValueError, match="one share >= 1 per replica"):
        zero1_owners({"a": 1}, [2, 0])


def test_owned_bytes_are_close_to_the_share_fraction():
    rng = np.random.default_rng(0)
    sizes = {f"p{i}": int(s) for i, s in enumerate(rng.integers(1, 100, 200))}
    owners = zero1_owners(sizes, [48, 16])
    owned = [sum(b for n, b in sizes.items() if owners[n] == r) for r in range(2)]
    assert abs(owned[0] / sum(owned) - 0.75) < 100 / sum(owned)  # within one tensor


# ---- the plan field ---------------------------------------------------------------------------
def test_plan_field_default_auto_and_validation():
    plan = dp_plan([3.0, 1.0])
    assert plan.optimizer_sharding == "auto" and plan.sharded_update()
    assert "optimizer_sharding" not in plan.to_dict()  # omitted when auto
    assert not with_sharding(plan, "replicated").sharded_update()
    assert with_sharding(plan, "zero1").to_dict()["optimizer_sharding"] == "zero1"
    one = Plan.from_dict({"islands": [{"name": "a", "platform": "cpu"}],
                          "stages": [{"island": "a", "first_layer": 0, "last_layer": 10}],
                          "global_batch_size": 2, "microbatch_size": 1, "optimizer_sharding": "zero1"})
    assert not one.sharded_update()  # one replica: nothing to shard
    with pytest.raises(ValueError, match="optimizer_sharding must be one of"):
        with_sharding(plan, "zero3").validate(model_config(False))
    multi = Plan.from_dict(dict(plan.to_dict(), islands=[{"name": "i0", "platform": "cpu", "num_processes": 2},
                                                         {"name": "i1", "platform": "cpu"}]))
    assert not multi.sharded_update()  # auto: replicated on an island of several processes
    with pytest.raises(ValueError, match="'zero1' needs every island to be one process"):
        with_sharding(multi, "zero1").validate(model_config(False))


# ---- host collectives -------------------------------------------------------------------------
def _run_ranks(n, body):
    comms = LocalCommunicator.create(n, timeout=30)
    out, errors = {}, {}

    def run(c):
        try:
            out[c.rank] = body(c)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[c.rank] = e
    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_reduce_to_owners_and_gather_from_owners_three_ranks():
    rng = np.random.default_rng(1)
    shapes = {"a": (3, 4), "b": (5,), "c": (2, 2), "d": (7,)}
    dtypes = {"a": np.float32, "b": np.float32, "c": np.float16, "d": np.float32}
    owner = {"a": 0, "b": 2, "c": 2, "d": 1}.__getitem__
    local = [{n: rng.standard_normal(s).astype(dtypes[n]) for n, s in shapes.items()} for _ in range(3)]
    sums = {n: local[0][n] + local[1][n] + local[2][n] for n in shapes}

    def body(c):
        red = zero.reduce_to_owners(c, local[c.rank], owner)
        got = zero.gather_from_owners(c, {n: red[n] for n in shapes if owner(n) == c.rank}, local[0], owner)
        return red, got
    out = _run_ranks(3, body)
    for r, (red, got) in out.items():
        for n in shapes:
            if owner(n) == r:
                np.testing.assert_array_equal(red[n], sums[n])  # same order: ranks 0, 1, 2
                assert n not in got
            else:
                assert red[n] is None
                np.testing.assert_array_equal(got[n], sums[n])
                assert got[n].dtype == dtypes[n]


# ---- the runtime against the unsplit run -------------------------------------------------------
@pytest.mark.parametrize("schedule,buckets", [("1f1b", True), ("gpipe", False)])
def test_zero1_equals_single_device(schedule, buckets):
    """Shares 8:2, right-padded rows, clipping by the global norm: loss, gradients and parameters
    after several steps as the unsplit run; the replicas own disjoint parameter sets (the slow one
    fewer bytes) and end bitwise identical, optimizer state included."""
    cfg = model_config(False)
    plan = with_sharding(dp_plan([3.0, 1.0]), "zero1", schedule=schedule)
    data = batches(10, padded=True)
    rt = PipelineRuntime(plan, cfg, OPTIM, seed=7, debug_nan=True)
    if buckets:
        rt.grad_bucket_bytes, rt.first_grad_bucket_bytes = 20_000, 1
    owned = [rt.owned_names((r, 0)) for r in range(2)]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    assert owned[0] | owned[1] == set(rt.stages[(0, 0)].flat())
    nbytes = [sum(rt._param_bytes[n] for n in o) for o in owned]
    assert nbytes[0] > 2 * nbytes[1], nbytes  # shares 8:2
    check_steps_against(rt, single_device_run(cfg, data), data)
    assert (rt.last_bucket_stats is not None) == buckets
    assert_replicas_bitwise_equal(rt)


def test_zero1_checkpoint_round_trip_mid_training():
    """Two steps, a checkpoint (every Adam moment gathered from its owner), a fresh runtime restored
    from it (replicated, then zero1 again), two more steps: the same as the uninterrupted zero1 run
    and as the replicated run, which match the unsplit run step by step (test above)."""
    cfg = model_config(True)
    data = batches(10, n=5, padded=True)
    base = dp_plan([3.0, 1.0])
    runs = {m: PipelineRuntime(with_sharding(base, m), cfg, OPTIM, seed=7) for m in ("zero1", "replicated")}
    for b in data[:3]:
        for rt in runs.values():
            rt.train_step(b)
    saved = runs["zero1"].checkpoint_state()
    want = runs["replicated"].checkpoint_state()
    for k in want:  # the gathered state is the replicated run's (float32 rounding of the sums)
        for x, y in zip(jax.tree.leaves(saved[k]), jax.tree.leaves(want[k]), strict=True):
            assert_rel(np.asarray(x), np.asarray(y), f"{k} checkpoint leaf")
    saved = jax.tree.map(np.asarray, saved)
    cont = {}  # the uninterrupted runs: losses of the last steps and the final parameters
    for m, rt in runs.items():
        cont[m] = ([rt.train_step(b).loss for b in data[3:]], rt.params())
    for mode in ("zero1", "replicated"):
        fresh = PipelineRuntime(with_sharding(base, mode), cfg, OPTIM, seed=3)
        fresh.restore_checkpoint_state(saved)
        fresh.step = 3
        losses = [fresh.train_step(b).loss for b in data[3:]]
        for got, want in zip(losses, cont[mode][0], strict=True):
            assert_rel(got, want, f"{mode}: loss after restore")
        for n, p in cont[mode][1].items():
            if mode == "zero1":  # bitwise: the same arithmetic on the same values
                np.testing.assert_array_equal(fresh.params()[n], p)
            else:
                assert_rel(fresh.params()[n], p, f"parameter {n} after restore")
        assert_replicas_bitwise_equal(fresh)


def test_changing_shares_after_steps_keeps_the_update_exact():
    """set_batch_shares after training steps moves ownership: the moments are synchronised first, so
    the run stays the replicated run's."""
    cfg = model_config(False)
    data = batches(10, n=4, padded=True)
    runs = [PipelineRuntime(with_sharding(dp_plan([3.0, 1.0]), m), cfg, OPTIM, seed=7) for m in ("zero1", "replicated")]
    before = runs[0].owner_of
    for i, b in enumerate(data):
        if i == 2:
            for rt in runs:
                rt.set_batch_shares([4, 6])
            assert runs[0].owner_of != before
        for rt in runs:
            rt.train_step(b)
    for n, p in runs[1].params().items():
        assert_rel(runs[0].params()[n], p, f"parameter {n}")
