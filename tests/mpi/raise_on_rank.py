"""Failure propagation: `mpiexec -n 4 python raise_on_rank.py R`.

Rank R raises after a barrier; every other rank waits in a receive that nothing will satisfy
(deadline 600 s). With install_abort_on_exception the whole job must end at once, non-zero.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from hethub_jax import cluster  # noqa: E402
from hethub_jax.comm.mpi import MPIHostBridge  # noqa: E402

cluster.install_abort_on_exception(island="test")
comm = MPIHostBridge(timeout=600)
bad = int(sys.argv[1])
comm.barrier(timeout=60)
if comm.rank == bad:
    raise RuntimeError(f"deliberate failure on rank {bad}")
comm.recv((comm.rank + 1) % comm.size, tag=1)  # never satisfied: only the abort ends this
print(f"rank {comm.rank} was not aborted", flush=True)
