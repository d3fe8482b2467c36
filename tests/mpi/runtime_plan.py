"""Multi-rank pipeline runtime against the unsplit reference: `mpiexec -n K python runtime_plan.py CASE`.

One island per rank (the plan's rank layout). Every rank runs its own stages with the MPI host
bridge, computes the unsplit single-device reference itself, and checks the loss of every step, the
gradients of its stages and their parameters after 3 steps (float32, relative 1e-5). It prints
"DIGEST rank R <sha256 of its replica's parameters and optimizer state>" and "OK rank R".
Cases: split3 (11 layers [5,4,2] with 1F1B, then [7,3,1] with GPipe, on 3 ranks), tied2 (tied embeddings, first and last stage on 2
ranks), hdp2 (2 data-parallel replicas, throughputs 3:1 -> shares 8:2, padded sequences; the update sharded,
ZeRO-1), hdp2_buckets (the same, bucketed), hdp2_mixed (bucketed, throughputs 9:1 -> shares 9:1: rank 1's
replica of one microbatch runs it fused and hands its whole gradient to the buckets), hdp2_replicated (the same, the update replicated), hybrid4
(2 replicas x 2 pipeline stages on 4 ranks; ZeRO-1), splits2 (2 replicas of two stages split differently,
layers 0-5 / 6-10 on rank 0 and 0-3 / 4-10 on rank 1, throughputs 3:1; ZeRO-1 reducing to the owners, the
parameter gather in the background: `overlap_param_gather`).
"""
import hashlib
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..")]

from hethub_jax import cluster  # noqa: E402

cluster.install_abort_on_exception()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hethub_jax.comm.mpi import MPIHostBridge  # noqa: E402
from hethub_jax.parallel.plan import Plan  # noqa: E402
from hethub_jax.parallel.runtime import PipelineRuntime  # noqa: E402
from test_runtime_equivalence import (OPTIM, assert_rel, batches, model_config,  # noqa: E402
                                      reference, split_plan)

case = sys.argv[1]
world = MPIHostBridge(MPI.COMM_WORLD, timeout=120)
rank = world.rank


def replicas_plan(n_islands, stages_per_replica, throughputs, gbs=10):
    isl = [{"name": f"i{j}", "platform": "cpu", "devices_per_process": 2} for j in range(n_islands)]
    reps, j = [], 0
    for t in throughputs:
        stages, first = [], 0
        per = [11 - 5 * (stages_per_replica - 1)] + [5] * (stages_per_replica - 1)
        for n in per:
            stages.append({"island": f"i{j}", "first_layer": first, "last_layer": first + n - 1})
            first, j = first + n, j + 1
        reps.append({"stages": stages, "throughput": t})
    return Plan.from_dict({"islands": isl, "replicas": reps, "global_batch_size": gbs,
                           "microbatch_size": 1, "schedule": "1f1b", "recompute": "none"})


tied = case == "tied2"
if case == "split3":
    plan = split_plan((5, 4, 2), islands=3)
elif case == "tied2":
    plan = split_plan((6, 5), islands=2)
elif case == "hdp2_mixed":
    plan = replicas_plan(2, 1, [9.0, 1.0])
    assert plan.batch_shares() == [9, 1], plan.batch_shares()
elif case in ("hdp2", "hdp2_buckets", "hdp2_replicated"):  # hdp2_buckets: the all-reduce in one bucket per layer
    plan = replicas_plan(2, 1, [3.0, 1.0])
    assert plan.batch_shares() == [8, 2], plan.batch_shares()
    # the update is sharded over the replicas (ZeRO-1, optimizer_sharding "auto") but in hdp2_replicated
    plan = plan.replace(optimizer_sharding="replicated") if case == "hdp2_replicated" else plan
    assert plan.sharded_update() == (case != "hdp2_replicated")
elif case == "splits2":
    plan = Plan.from_dict({
        "islands": [{"name": f"i{j}", "platform": "cpu", "devices_per_process": 2} for j in range(2)],
        "replicas": [{"stages": [{"island": i, "first_layer": a, "last_layer": b} for a, b in split], "throughput": t}
                     for i, split, t in (("i0", [(0, 5), (6, 10)], 3.0), ("i1", [(0, 3), (4, 10)], 1.0))],
        "global_batch_size": 10, "microbatch_size": 1, "schedule": "1f1b", "recompute": "none"})
    assert plan.batch_shares() == [8, 2] and plan.sharded_update(), plan.batch_shares()
elif case == "hybrid4":
    plan = replicas_plan(4, 2, [1.0, 1.0], gbs=8)
else:
    raise SystemExit(f"unknown case {case}")
assert plan.world_size == world.size, (plan.world_size, world.size)

padded = case.startswith("h")
data = batches(plan.global_batch_size, padded=padded)
ref = reference(tied, plan.global_batch_size, padded=padded)


def check(plan):
    # split3: receive buffers and gradient accumulators start NaN-filled (nothing unwritten may leak)
    rt = PipelineRuntime(plan, model_config(tied), OPTIM, seed=7, comm=world, rank=rank,
                         debug_nan=case in ("split3", "hdp2_buckets", "hdp2_mixed"))
    if case in ("hdp2_buckets", "hdp2_mixed"):
        rt.grad_bucket_bytes, rt.first_grad_bucket_bytes = 20_000, 1
    if case == "splits2":
        assert rt._reduce_to_owners()
        rt.overlap_param_gather = True
    loss0, grads = rt.gradients(data[0])
    assert_rel(loss0, ref["loss0"], "loss of batch 0")
    for name, g in grads.items():
        assert_rel(g, ref["grads"][name], f"rank {rank}: gradient {name}")
    for step, b in enumerate(data[:3]):
        assert_rel(rt.train_step(b).loss, ref["losses"][step], f"loss at step {step}")
    params = rt.params()
    for name, p in params.items():
        assert_rel(p, ref["params"][name], f"rank {rank}: parameter {name} after 3 steps")
    if case == "hdp2_mixed":  # rank 0's replica chunked, rank 1's (one microbatch) fused: the same 12 buckets
        assert [rt.chunked_replica(r) for r in range(2)] == [True, False]
        assert rt.last_bucket_stats["num_buckets"] == 12, rt.last_bucket_stats
    if case == "hdp2_buckets":  # every layer its own bucket, all-reduced over the bridge in the background
        chunks = rt._chunks[rt.local_keys[0]][1].chunks
        assert len(chunks) == 11, chunks  # + the dense part of the (untied) embedding gradient:
        assert rt.last_bucket_stats["num_buckets"] == 12, rt.last_bucket_stats
    return rt, params


rt, params = check(plan)
if case == "split3":  # the second split in the same processes (the reference is computed once)
    check(split_plan((7, 3, 1), islands=3, schedule="gpipe"))
if tied:  # both copies of the tied embedding, on different ranks, are bitwise equal
    emb = world.broadcast(params["embed_tokens"] if rank == 0 else np.zeros_like(params["embed_tokens"]), root=0)
    if "embed_tokens" in params:
        np.testing.assert_array_equal(emb, params["embed_tokens"])
h = hashlib.sha256()
for key, item in sorted(rt.checkpoint_state().items()):
    stage_index = key.split("s")[-1]
    h.update(stage_index.encode())
    for leaf in jax.tree.leaves(item):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
print(f"DIGEST rank {rank} {h.hexdigest()}", flush=True)
print(f"OK rank {rank}", flush=True)
