"""Pipeline runtime with islands of several processes against the unsplit reference (issue 15).

``mpiexec -n K python runtime_multiprocess.py CASE``: the plan's islands take consecutive ranks;
each rank starts its island with ``cluster.start`` (an island of several processes is one
``jax.distributed`` runtime with gloo CPU collectives; fake CPU devices: the island's
``devices_per_process``). Every rank checks the loss of batch 0, the gradients and, after 3 steps,
the parameters of its stage against the unsplit single-device reference it computes itself (float32,
relative 1e-5), and the loss of each step. Prints "OK rank R".

Cases:
  mp22 (4 ranks): island a = 2 processes x 2 devices, stage 0 (layers 0-5) dp 2 x tp 2 (DP across the
    processes, TP inside each); island b = 2 processes x 1 device, stage 1 (layers 6-10) dp 2.
  mp21 (3 ranks): tied embeddings; island a = 2 processes x 1 device, stage 0 (layers 0-5) dp 2;
    island b = 1 process, stage 1 (layers 6-10) dp 1: the boundary re-slices 2 -> 1 and back.
  split (4 ranks): a plan the runtime refuses, island a = 4 processes x 2 devices running two stages
    (layers 0-5 on dp 2 x tp 2 = processes 0-1; layers 6-10 on dp 2 x tp 1, devices [4, 6] = one device
    of each of processes 2-3), split by ``parallel.split.split_islands`` into islands a.0 and a.1 (2
    processes each, stage 1's devices renumbered to [0, 2]): the split plan runs.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..")]

from mpi4py import MPI  # noqa: E402

from hethub_jax import cluster  # noqa: E402
from hethub_jax.parallel.plan import Plan  # noqa: E402  (JAX-free)

cluster.install_abort_on_exception()
case = sys.argv[1]
tied = case == "mp21"
if case == "mp22":
    islands = [("a", 2, 2), ("b", 2, 1)]
    stages = [("a", 0, 5, 2, 2), ("b", 6, 10, 2, 1)]
elif case == "mp21":
    islands = [("a", 2, 1), ("b", 1, 1)]
    stages = [("a", 0, 5, 2, 1), ("b", 6, 10, 1, 1)]
elif case == "split":
    islands = [("a", 4, 2)]
    stages = [("a", 0, 5, 2, 2), ("a", 6, 10, 2, 1, [4, 6])]
else:
    raise SystemExit(f"unknown case {case}")
plan = Plan.from_dict({
    "islands": [{"name": n, "platform": "cpu", "num_processes": p, "devices_per_process": d}
                for n, p, d in islands],
    "stages": [{"island": i, "first_layer": f, "last_layer": la, "dp": dp, "tp": tp,
                **({"devices": x[0]} if x else {})} for i, f, la, dp, tp, *x in stages],
    "global_batch_size": 8, "microbatch_size": 2, "schedule": "1f1b", "recompute": "none"})
if case == "split":
    from hethub_jax.parallel.rules import check_runtime_support  # noqa: E402
    from hethub_jax.parallel.split import split_islands  # noqa: E402
    try:
        check_runtime_support(plan)
        raise AssertionError("the unsplit plan should be refused")
    except ValueError as e:
        assert "split it into one island per stage" in str(e), e
    plan, origin = split_islands(plan)
    assert [(i.name, i.num_processes) for i in plan.islands] == [("a.0", 2), ("a.1", 2)], plan.islands
    assert plan.stage(0, 1).devices == (0, 2) and origin == {"a.0": "a", "a.1": "a"}, (plan, origin)
    check_runtime_support(plan)
rank = MPI.COMM_WORLD.Get_rank()
assert plan.world_size == MPI.COMM_WORLD.Get_size(), (plan.world_size, MPI.COMM_WORLD.Get_size())
name = plan.rank_island(rank).name
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={plan.island(name).devices_per_process}"
isl = cluster.start(island=name, platform="cpu", timeout=120)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hethub_jax.parallel.runtime import PipelineRuntime  # noqa: E402
from hethub_jax.reference import ReferenceTrainer  # noqa: E402
from test_runtime_equivalence import OPTIM, assert_rel, batches, model_config  # noqa: E402

world = isl.world
data = batches(plan.global_batch_size)
ref_tr = ReferenceTrainer(model_config(tied), OPTIM, seed=7, device=jax.local_devices()[0])
ref_loss0, ref_grads = ref_tr.gradients(data[0])
ref_losses = [ref_tr.train_step(b)[0] for b in data[:3]]
ref_params = ref_tr.flat_params()

rt = PipelineRuntime(plan, model_config(tied), OPTIM, seed=7, comm=world, rank=rank, debug_nan=True)
(key,) = rt.local_keys
assert len(rt.stages[key].mesh.devices.flat) == plan.stage(*key).dp * plan.stage(*key).tp
loss0, grads = rt.gradients(data[0])
assert_rel(loss0, ref_loss0, "loss of batch 0")
assert grads, "no gradients on this rank"
for n, g in grads.items():
    assert_rel(g, ref_grads[n], f"rank {rank}: gradient {n}")
for step, b in enumerate(data[:3]):
    res = rt.train_step(b)
    assert_rel(res.loss, ref_losses[step], f"rank {rank}: loss at step {step}")
    assert res.num_tokens == int(b["loss_mask"].sum()), (res.num_tokens, b["loss_mask"].sum())
params = rt.params()
for n, p in params.items():
    assert_rel(p, ref_params[n], f"rank {rank}: parameter {n} after 3 steps")
if tied:  # the copies of the tied embedding on the two islands are bitwise equal
    emb = world.broadcast(params["embed_tokens"] if rank == 0 else np.zeros_like(ref_params["embed_tokens"]),
                          root=0)
    np.testing.assert_array_equal(emb, params["embed_tokens"])
world.barrier(timeout=120)
print(f"OK rank {rank} island {name} stage {key} processes {isl.size}", flush=True)
if isl.size > 1:
    jax.distributed.shutdown()
