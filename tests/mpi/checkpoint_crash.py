"""A process of an island dies in the middle of a checkpoint save (issue 16: atomic checkpoints).

``mpiexec -n 2 python checkpoint_crash.py ROOT``: one island of 2 processes x 1 CPU device runs the
whole model as one stage on DP 2 (one ``jax.distributed`` runtime). After a training step both
processes save step 1 (``checkpoint.AsyncSaver``, orbax multi-process save) and wait; rank 0 writes
its parameters to ``ROOT/step1_params.npz`` (the reference). After a second step both start saving
step 2 and rank 1 is SIGKILLed as soon as its ``save`` returns, while its shards are written in the
background (a crash in the middle of the island's save): orbax's commit of a unit needs every
process of the island at its barrier, so the units still in flight are never committed (the first
units of step 2 may be: the save of each unit starts as soon as it is handed over), step 2 stays
incomplete (``checkpoint.complete_steps``) and step 1 is the one that loads. The job ends non-zero (the launcher ends rank 0); the test checks
the directory.
"""
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..")]

from mpi4py import MPI  # noqa: E402

from hethub_jax import cluster  # noqa: E402
from hethub_jax.parallel.plan import Plan  # noqa: E402  (JAX-free)

PLAN = {"islands": [{"name": "a", "platform": "cpu", "num_processes": 2, "devices_per_process": 1}],
        "stages": [{"island": "a", "first_layer": 0, "last_layer": 10, "dp": 2, "tp": 1}],
        "global_batch_size": 8, "microbatch_size": 2, "schedule": "1f1b", "recompute": "none"}

root = sys.argv[1]
plan = Plan.from_dict(PLAN)
rank = MPI.COMM_WORLD.Get_rank()
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
isl = cluster.start(island="a", platform="cpu", timeout=120)

import numpy as np  # noqa: E402

from hethub_jax import checkpoint as ckpt  # noqa: E402
from hethub_jax.parallel.runtime import PipelineRuntime  # noqa: E402
from test_runtime_equivalence import LAYERS, OPTIM, batches, model_config  # noqa: E402

assert LAYERS == 11, LAYERS
rt = PipelineRuntime(plan, model_config(False), OPTIM, seed=7, comm=isl.world, rank=rank)
data = batches(plan.global_batch_size)
meta = {"config": {"model": {}, "data": {}}, "data": {"global_batch_size": plan.global_batch_size}}
saver = ckpt.AsyncSaver(root, LAYERS, keep=None)
rt.train_step(data[0])
saver.save(1, ckpt.runtime_units(rt), meta if rank == 0 else None, arrays=ckpt.runtime_arrays(rt))
saver.wait()
if rank == 0:
    np.savez(os.path.join(root, "step1_params.npz"), **rt.params())
isl.world.barrier(timeout=120)
rt.train_step(data[1])
saver.save(2, ckpt.runtime_units(rt), meta if rank == 0 else None, arrays=ckpt.runtime_arrays(rt))
if rank == 1:  # its shards are being written in the background: killed in the middle of the save
    os.kill(os.getpid(), signal.SIGKILL)
print("rank 0 started saving step 2", flush=True)
saver.wait()  # never returns normally: the island's other process is gone before orbax's commit
print("UNEXPECTED: step 2 saved without rank 1", flush=True)
