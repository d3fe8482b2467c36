"""A rank killed (SIGKILL) in a job of two islands of two processes: ``mpiexec -n 4 python kill_rank.py R``.

Ranks 0-1 are island a, 2-3 island b, each island one ``jax.distributed`` runtime (gloo CPU
collectives, 1 fake CPU device per process). Every island runs one jitted all-reduce over its mesh
(so the gloo contexts exist); then rank R prints ``KILLING rank R AT <unix time>`` and sends itself
SIGKILL (no exception hook, no MPI abort: the way a node loss or the OOM killer ends a process).
The other process of its island enters the next all-reduce (gloo has no deadline of its own), the
other island waits in a receive from the killed rank (deadline 600 s). Only the launcher's reaction
to the lost rank can end the job quickly; the test (tests/test_runtime_multiprocess.py) asserts it
ends within 30 s of the kill, non-zero, naming rank R.
"""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

from mpi4py import MPI  # noqa: E402

from hethub_jax import cluster  # noqa: E402

bad = int(sys.argv[1])
rank = MPI.COMM_WORLD.Get_rank()
cluster.install_abort_on_exception()
isl = cluster.start(island="a" if rank < 2 else "b", platform="cpu", timeout=120)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)), ("dp",))
rows = NamedSharding(mesh, P("dp"))
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
x = jax.make_array_from_callback((2,), rows, lambda i: np.arange(2, dtype=np.float32)[i])
assert float(np.asarray(total(x).addressable_data(0))) == 1.0
isl.world.barrier(timeout=120)
if rank == bad:
    print(f"KILLING rank {rank} AT {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if bad in isl.world_ranks:  # island-mate: a collective that never completes
    float(np.asarray(total(x).addressable_data(0)))
isl.world.recv(bad, tag=5, timeout=600)
print(f"rank {rank} was not ended", flush=True)
