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
from hethub_jax.parallel.plan import Plan, balanced_update_fractions, zero1_owners
from hethub_jax.parallel.runtime import PipelineRuntime
from test_hetero_dp import STEPS, assert_replicas_bitwise_equal, check_steps_against, dp_plan, single_device_run
from test_runtime_equivalence import OPTIM, assert_rel, batches, model_config


def with_sharding(plan: Plan, mode: str, **changes) -> Plan:
    return plan.replace(optimizer_sharding=mode, **changes)


# ---- ownership --------------------------------------------------------------------------------
def test_owners_follow_the_shares_by_hand():
    assert zero1_owners({"a": 6, "b": 3, "c": 1}, [3, 1]) == {"a": 0, "b": 0, "c": 1}
    assert zero1_owners({"a": 6, "b": 3, "c": 1}, [1, 1]) == {"a": 0, "b": 1, "c": 1}
    assert zero1_owners({"x": 5}, [1, 4]) == {"x": 1}  # 5/4 < 5/1
    with pytest.raises(ValueError, match="one share >= 1"):
        zero1_owners({"a": 1}, [2, 0])


def test_owned_bytes_are_close_to_the_share_fraction():
    rng = np.random.default_rng(0)
    sizes = {f"p{i}": int(s) for i, s in enumerate(rng.integers(1, 100, 200))}
    owners = zero1_owners(sizes, [48, 16])
    owned = [sum(b for n, b in sizes.items() if owners[n] == r) for r in range(2)]
    assert abs(owned[0] / sum(owned) - 0.75) < 100 / sum(owned)  # within one tensor


def test_owners_accept_real_weights_by_hand():
    """Weights other than batch shares (`PipelineRuntime.set_update_weights`): same greedy, exact."""
    assert zero1_owners({"a": 6, "b": 3, "c": 1}, [0.75, 0.25]) == {"a": 0, "b": 0, "c": 1}  # as [3, 1]
    assert zero1_owners({"a": 6, "b": 3, "c": 1}, [0.99, 0.01]) == {"a": 0, "b": 0, "c": 0}  # 1/0.01 > 10/0.99
    # a: 6/0.9 < 6/0.1 -> 1; b: (6+3)/0.9 = 10 < 3/0.1 = 30 -> 1; c: 1/0.1 = 10 < 10/0.9 -> 0
    assert zero1_owners({"a": 6, "b": 3, "c": 1}, [0.1, 0.9]) == {"a": 1, "b": 1, "c": 0}
    for bad in ([1.0, 0.0], [1.0, float("nan")], [1.0, -0.5]):
        with pytest.raises(ValueError, match="weight > 0"):
            zero1_owners({"a": 1}, bad)


def test_balanced_update_fractions_by_hand():
    """Water-filling of the update into idle time, checked by hand (docstring examples)."""
    x = balanced_update_fractions([0.40, 0.40], [0.02, 0.06])  # (T - 0.4) (1/0.02 + 1/0.06) = 1
    assert x == pytest.approx([0.75, 0.25], rel=1e-9)
    x = balanced_update_fractions([0.40, 0.44], [0.02, 0.06])  # replica 0 finishes at 0.4198 < 0.44
    assert x == pytest.approx([0.99, 0.01], rel=1e-9)
    x = balanced_update_fractions([0.40, 0.44], [0.02, 0.06], min_fraction=0.2)
    assert x == pytest.approx([0.8, 0.2], rel=1e-9)
    # three replicas, none clipped: x_r = (T - b_r) / u_r, b = (0, 1, 2), u = (6, 3, 2), sum 1:
    # T (1/6 + 1/3 + 1/2) - (0 + 1/3 + 1) = 1 -> T = 7/3
    x = balanced_update_fractions([0.0, 1.0, 2.0], [6.0, 3.0, 2.0], min_fraction=0.01)
    assert x == pytest.approx([(7 / 3) / 6, (4 / 3) / 3, (1 / 3) / 2], rel=1e-9)
    assert sum(x) == pytest.approx(1.0)
    for args, msg in ((([0.1], [0.1, 0.2]), "one busy_s and one update_s"), (([0.1, -1.0], [1.0, 1.0]), "busy_s"),
                      (([0.1, 0.1], [1.0, 0.0]), "update_s"), (([0.1, 0.1], [1.0, 1.0], 0.6), "min_fraction")):
        with pytest.raises(ValueError, match=msg):
            balanced_update_fractions(*args)


@pytest.mark.parametrize("weights", [[0.99, 0.01], [1e-9, 1.0], [1.0, 1e-9], [0.2, 0.8]])
def test_update_weights_keep_the_update_exact(weights):
    """`set_update_weights` moves ownership (here after two steps, moments synchronised first; a
    weight of 1e-9 leaves replica 0 or 1 owning no tensor at all): loss and parameters stay the
    replicated run's (reference: the same plan with `optimizer_sharding: replicated`), replicas
    bitwise equal."""
    cfg = model_config(False)
    data = batches(10, n=4, padded=True, seed=11)
    runs = [PipelineRuntime(with_sharding(dp_plan([3.0, 1.0]), m), cfg, OPTIM, seed=5) for m in ("zero1", "replicated")]
    for i, b in enumerate(data):
        if i == 2:
            runs[0].set_update_weights(weights)
            sizes = runs[0]._param_bytes
            owned = [sum(sizes[n] for n, r in runs[0].owner_of.items() if r == j) for j in range(2)]
            if min(weights) < 1e-6:  # one replica owns everything
                assert owned[weights.index(min(weights))] == 0
            else:  # within one tensor of the weight's fraction
                assert abs(owned[0] / sum(owned) - weights[0] / sum(weights)) <= max(sizes.values()) / sum(owned)
        losses = [rt.train_step(b).loss for rt in runs]
        assert_rel(losses[0], losses[1], f"loss of step {i}")
    for n, p in runs[1].params().items():
        assert_rel(runs[0].params()[n], p, f"parameter {n}")
    assert_replicas_bitwise_equal(runs[0])
    with pytest.raises(ValueError, match="one per replica"):
        runs[0].set_update_weights([1.0])


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
def _run_ranks(n, body, timeout: float = 30.0):
    """``body(comm)`` on ``n`` ranks in threads of this process (`LocalCommunicator`); rank -> result.
    Re-raises a rank's error; fails when a rank does not finish within ``timeout + 60`` seconds."""
    comms = LocalCommunicator.create(n, timeout=timeout)
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
        t.join(timeout + 60)
    assert not errors, errors
    assert len(out) == n, "a rank did not finish"
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


# ---- replicas of several pipeline stages, with different stage splits ---------------------------
def split_replicas_plan(layout: str, schedule: str = "1f1b") -> Plan:
    """Two replicas, throughputs 3:1 (shares 8:2 of 10), two islands of one process each.
    "split": replica 0 runs two stages on island i0 (layers 0-5, 6-10), replica 1 three stages on
    island i1 (0-2, 3-7, 8-10): every tensor's holders are one stage on each island.
    "crossed": replica 0 runs 0-5 on i0 and 6-10 on i1, replica 1 runs 0-3 on i1 and 4-10 on i0:
    each island runs a stage of both replicas; layers 4-5 are held twice on i0 (summed there), the
    others once on each island."""
    splits = {"split": ([("i0", 0, 5), ("i0", 6, 10)], [("i1", 0, 2), ("i1", 3, 7), ("i1", 8, 10)]),
              "crossed": ([("i0", 0, 5), ("i1", 6, 10)], [("i1", 0, 3), ("i0", 4, 10)])}[layout]
    reps = [{"stages": [{"island": i, "first_layer": a, "last_layer": b} for i, a, b in stages], "throughput": t}
            for stages, t in zip(splits, (3.0, 1.0))]
    return Plan.from_dict({
        "islands": [{"name": "i0", "platform": "cpu", "devices_per_process": 3},
                    {"name": "i1", "platform": "cpu", "devices_per_process": 3}],
        "replicas": reps, "global_batch_size": 10, "microbatch_size": 1, "schedule": schedule,
        "recompute": "none", "optimizer_sharding": "zero1"})


def _opt_by_name(st, opt_state) -> dict[str, np.ndarray]:
    """"slot|name" -> host array of a stage's per-tensor optimizer-state leaves (Adam's moments)."""
    return {f"{e[0]}|{e[1]}": np.asarray(x) for e, x in zip(st.opt_state_names(), jax.tree.leaves(opt_state),
                                                             strict=True) if e is not None}


def assert_holders_bitwise_equal(per_stage: dict) -> None:
    """Every holder of a parameter (any replica, any stage) holds it, and its Adam moments, bitwise
    equal. ``per_stage``: stage key -> {"params": flat name -> array, "opt": "slot|name" -> array}."""
    for part in ("params", "opt"):
        seen: dict[str, tuple] = {}
        for k, d in sorted(per_stage.items()):
            for n, v in d[part].items():
                if n in seen:
                    np.testing.assert_array_equal(v, seen[n][1], err_msg=f"{part} {n}: stage {k} vs {seen[n][0]}")
                else:
                    seen[n] = (k, v)


def _stage_state(rt) -> dict:
    """Per local stage: flat parameters and optimizer-state leaves by name, every moment current
    (`checkpoint_state` is a collective under ZeRO-1: every rank calls it)."""
    state = rt.checkpoint_state()
    return {(r, s): {"params": rt.stage_params((r, s)), "opt": _opt_by_name(rt.stages[(r, s)], state[f"r{r}s{s}"]["opt_state"])}
            for r, s in rt.local_keys}


def _run_plan_ranks(plan: Plan, body, timeout: float = 600.0) -> dict:
    """``body(comm)`` on every rank of ``plan`` in threads of this process (`LocalCommunicator`, the
    in-process bridge; every rank sees this process's devices); rank -> its result."""
    return _run_ranks(plan.world_size, body, timeout)


def _count_calls(monkeypatch) -> dict:
    """Counts the point-to-point ZeRO-1 exchanges (`zero.reduce_to_owners`, `zero.gather_from_owners`)
    and the group all-reduces (`allreduce_tree`) per communicator: (id(comm), function) -> calls
    (the gather may run on a background thread)."""
    counts: dict = {}
    for fn in ("reduce_to_owners", "gather_from_owners"):
        orig = getattr(zero, fn)

        def wrapped(comm, *a, _orig=orig, _fn=fn, **kw):
            key = (id(comm), _fn)
            counts[key] = counts.get(key, 0) + 1
            return _orig(comm, *a, **kw)
        monkeypatch.setattr(zero, fn, wrapped)
    orig_tree = LocalCommunicator.allreduce_tree

    def tree(self, *a, **kw):
        key = (id(self), "allreduce_tree")
        counts[key] = counts.get(key, 0) + 1
        return orig_tree(self, *a, **kw)
    monkeypatch.setattr(LocalCommunicator, "allreduce_tree", tree)
    return counts


@pytest.mark.parametrize("layout,schedule,overlap", [("split", "1f1b", False), ("split", "gpipe", False),
                                                     ("crossed", "1f1b", False), ("crossed", "gpipe", False),
                                                     ("split", "gpipe", True), ("crossed", "1f1b", True)])
def test_zero1_multi_stage_replicas_over_two_islands_equal_single_device(layout, schedule, overlap, monkeypatch):
    """Replicas of several pipeline stages, split differently, one island per rank (threads joined by
    the in-process bridge): every tensor's gradient is reduced to its owner's process only, updated
    there, and sent back to its other holders (point to point: no group all-reduce in a training
    step). Loss and gradients of batch 0, loss and parameters after each of several steps as the
    unsplit run; every stage owns a disjoint part (the slow replica fewer bytes); all holders of a
    tensor end bitwise equal, Adam moments included. ``overlap``: the parameter gather runs in the
    background (`overlap_param_gather`): each step returns with it pending, and the next step (or a
    read of the parameters) waits for it."""
    cfg = model_config(False)
    plan = split_replicas_plan(layout, schedule)
    assert plan.batch_shares() == [8, 2] and plan.sharded_update() and plan.world_size == 2
    data = batches(10, padded=True)
    ref = single_device_run(cfg, data)
    counts = _count_calls(monkeypatch)

    def body(c):
        rt = PipelineRuntime(plan, cfg, OPTIM, seed=7, comm=c, rank=c.rank, debug_nan=True)
        rt.overlap_param_gather = overlap
        assert rt._reduce_to_owners() and rt._gather_in_background() == overlap
        mine = [id(sub) for sub in rt._group_comms.values()]
        total = lambda f: sum(counts.get((i, f), 0) for i in mine)  # noqa: E731
        loss0, grads = rt.gradients(data[0])  # every holder gets every sum here
        fns = ("reduce_to_owners", "gather_from_owners", "allreduce_tree")
        before = {f: total(f) for f in fns}
        losses, params = [], [rt.params()]
        stage_params = []
        for b in data[:1 + STEPS]:
            losses.append(rt.train_step(b).loss)
            assert (rt._pending_gather is not None) == overlap  # pending until read
            params.append(rt.params())
            assert rt._pending_gather is None
            stage_params.append({k: rt.stage_params(k) for k in rt.local_keys})
        calls = {f: total(f) - before[f] for f in fns}
        owned = {k: rt.owned_names(k) for k in rt.local_keys}
        return dict(loss0=loss0, grads=grads, losses=losses, params=params, stage_params=stage_params,
                    calls=calls, owned=owned, sizes=dict(rt._param_bytes), state=_stage_state(rt))
    out = _run_plan_ranks(plan, body)
    names = set(ref["grads"])
    for r, o in out.items():
        assert_rel(o["loss0"], ref["loss0"], f"rank {r}: loss")
        for n, g in o["grads"].items():
            assert_rel(g, ref["grads"][n], f"rank {r}: gradient {n}")
        for step, loss in enumerate(o["losses"]):
            assert_rel(loss, ref["losses"][step], f"rank {r}: loss at step {step}")
        for n, p in o["params"][0].items():
            np.testing.assert_array_equal(p, ref["params"][0][n])  # the same initial weights
            np.testing.assert_array_equal(o["params"][1][n], p)  # the warm-up step moves nothing
        for step in range(1, 1 + STEPS):
            for n, p in o["params"][step + 1].items():
                assert not np.array_equal(p, o["params"][step][n]), f"rank {r}: step {step} left {n} unchanged"
                assert_rel(p, ref["params"][step + 1][n], f"rank {r}: parameter {n} after step {step}")
        # a training step: reduce to the owners, then the owners' tensors back (no group all-reduce)
        steps = 1 + STEPS
        assert o["calls"]["reduce_to_owners"] >= steps and o["calls"]["gather_from_owners"] >= steps, o["calls"]
        assert o["calls"]["allreduce_tree"] == 0, o["calls"]
    # ownership: each tensor is updated by exactly one stage; the slow replica owns fewer bytes
    owners: dict[str, list] = {}
    for o in out.values():
        for k, ns in o["owned"].items():
            for n in ns:
                owners.setdefault(n, []).append(k)
    assert set(owners) == names and all(len(v) == 1 for v in owners.values()), owners
    sizes = out[0]["sizes"]
    nbytes = [sum(sizes[n] for n, v in owners.items() if v[0][0] == r) for r in range(2)]
    assert nbytes[0] > 2 * nbytes[1], nbytes  # shares 8:2
    # every holder of a tensor (both replicas, several stages) is bitwise equal after every step
    for i in range(1 + STEPS):
        assert_holders_bitwise_equal({k: {"params": v, "opt": {}} for o in out.values()
                                      for k, v in o["stage_params"][i].items()})
    assert_holders_bitwise_equal({k: v for o in out.values() for k, v in o["state"].items()})


@pytest.mark.parametrize("layout", ["split", "crossed"])
def test_zero1_multi_stage_replicas_in_one_process_equal_single_device(layout):
    """The same plans in one process (no communicator): the owners' tensors are copied directly."""
    cfg = model_config(False)
    plan = split_replicas_plan(layout)
    data = batches(10, padded=True)
    rt = PipelineRuntime(plan, cfg, OPTIM, seed=7, debug_nan=True)
    check_steps_against(rt, single_device_run(cfg, data), data)
    assert_holders_bitwise_equal(_stage_state(rt))


def test_zero1_multi_stage_replicas_checkpoint_round_trip_over_two_islands():
    """Tied embeddings (first and last stage of each replica hold the embedding: four holders, two
    per island in "crossed"), one island per rank: three steps, a checkpoint (every Adam moment
    gathered from its owner), a fresh runtime (another seed) restored from it, two more steps:
    bitwise the uninterrupted run, every holder bitwise equal; the checkpointed state is that of
    the replicated update of the same plan, run alongside (float32 rounding of the sums). The last
    steps run the parameter gather in the background (`overlap_param_gather`)."""
    cfg = model_config(True)
    data = batches(10, n=5, padded=True)
    plan = split_replicas_plan("crossed")

    def body(c):
        runs = {m: PipelineRuntime(plan.replace(optimizer_sharding=m), cfg, OPTIM, seed=7, comm=c, rank=c.rank)
                for m in ("zero1", "replicated")}
        for b in data[:3]:
            for rt in runs.values():
                rt.train_step(b)
        saved = jax.tree.map(np.asarray, runs["zero1"].checkpoint_state())
        want = jax.tree.map(np.asarray, runs["replicated"].checkpoint_state())
        rt = runs["zero1"]
        rt.overlap_param_gather = True  # the last steps' gathers run in the background
        cont = [rt.train_step(b).loss for b in data[3:]]
        fresh = PipelineRuntime(plan, cfg, OPTIM, seed=3, comm=c, rank=c.rank)
        fresh.overlap_param_gather = True
        fresh.restore_checkpoint_state(saved)
        fresh.step = 3
        losses = [fresh.train_step(b).loss for b in data[3:]]
        return dict(saved=saved, want=want, cont=cont, losses=losses, params=rt.params(),
                    fresh=fresh.params(), state=_stage_state(fresh))
    out = _run_plan_ranks(plan, body)
    for r, o in out.items():
        for k in o["want"]:
            for x, y in zip(jax.tree.leaves(o["saved"][k]), jax.tree.leaves(o["want"][k]), strict=True):
                assert_rel(x, y, f"rank {r}: {k} checkpoint leaf")
        assert o["losses"] == o["cont"], (o["losses"], o["cont"])
        for n, p in o["params"].items():
            np.testing.assert_array_equal(o["fresh"][n], p)
    assert_holders_bitwise_equal({k: v for o in out.values() for k, v in o["state"].items()})


def test_measured_update_fractions_feed_the_ownership_and_stay_exact(monkeypatch):
    """`measure_step_costs` keeps each replica's F/B seconds per step and whole-update seconds
    (`last_step_costs`); `balanced_update_fractions` of them, set as update weights, trains as the
    replicated run does. The emulated waits are recorded, not slept (no timing asserted)."""
    from hethub_jax.parallel import runtime as rtm
    waits = []
    monkeypatch.setattr(rtm, "emulated_wait", waits.append)
    cfg = model_config(False)
    data = batches(10, n=3, padded=True, seed=4)
    runs = [PipelineRuntime(with_sharding(dp_plan([3.0, 1.0], slowdown=3.0), m), cfg, OPTIM, seed=2)
            for m in ("zero1", "replicated")]
    runs[0].measure_step_costs(data[0], steps=3)
    costs = runs[0].last_step_costs
    assert set(costs) == {"busy_s", "update_s"} and all(len(v) == 2 for v in costs.values())
    assert all(v > 0 for vs in costs.values() for v in vs)
    assert waits and all(w >= 0 for w in waits)  # island i1's actions and update were stretched
    x = balanced_update_fractions(costs["busy_s"], costs["update_s"])
    runs[0].set_update_weights(x)
    assert runs[0].update_weights == pytest.approx(x)
    for b in data:
        losses = [rt.train_step(b).loss for rt in runs]
        assert_rel(losses[0], losses[1], "loss")
    for n, p in runs[1].params().items():
        assert_rel(runs[0].params()[n], p, f"parameter {n}")
