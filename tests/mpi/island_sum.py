"""Multi-island start-up: `mpiexec -n 2 -env HETHUB_ISLAND a ... : -n 1 -env HETHUB_ISLAND b ...`.

Island "a" (2 processes x 2 CPU devices, XLA_FLAGS set by the launcher) sums an array laid out over
its 4-device mesh; island "b" (1 process) receives that sum over the world bridge. Each rank checks
against numpy and prints "OK rank R". Expects exactly one island with 2 processes.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from hethub_jax import cluster  # noqa: E402  (must not import jax before start)

cluster.install_abort_on_exception()
assert "jax" not in sys.modules, "jax imported before the island's platform was set"
isl = cluster.start(platform="cpu", timeout=120)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

assert os.environ["JAX_PLATFORMS"] == "cpu"
rec = cluster.handshake_record(cluster.config_hash({"model": "tiny"}), isl.name, isl.platform,
                               jax.local_device_count())
cluster.handshake(isl.world, rec, timeout=60)

full = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4 * 6, 5) / 7.0
expected = full.astype(np.float64).sum()
if isl.size == 2:
    assert jax.process_count() == 2 and jax.process_index() == isl.rank, (jax.process_count(),)
    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    sharding = NamedSharding(mesh, P("dp"))
    x = jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])
    assert len(x.addressable_shards) == 2
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    got = float(np.asarray(total.addressable_data(0)))
    assert abs(got - expected) <= 1e-4 * abs(expected), (got, expected)
    if isl.rank == 0:
        other = [r for r in range(isl.world.size) if r not in isl.world_ranks][0]
        isl.world.send(np.asarray(total.addressable_data(0)), other, tag=3)
else:
    assert jax.process_count() == 1 and len(jax.devices()) == 2
    src = [r for r in range(isl.world.size) if r != isl.world.rank][0]
    got = isl.world.recv(src, tag=3, timeout=60)
    assert got.dtype == np.float32 and got.shape == ()
    assert abs(float(got) - expected) <= 1e-4 * abs(expected), (got, expected)
isl.world.barrier(timeout=60)
print(f"OK rank {isl.world.rank} island {isl.name} size {isl.size} names {isl.names}", flush=True)
if isl.size > 1:
    jax.distributed.shutdown()
