"""Start-up handshake over islands (MPMD): each rank's island comes from $HETHUB_ISLAND and its
config from $TEST_CONFIG (default "base"); local device count from $TEST_DEVICES (default 1).

Prints "HANDSHAKE OK rank R" when all agree; otherwise every rank raises HandshakeError and the
abort hook ends the job.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from hethub_jax import cluster  # noqa: E402

cluster.install_abort_on_exception()
isl = cluster.start(platform="cpu", timeout=60, initialize_distributed=False)
assert "jax" not in sys.modules
digest = cluster.config_hash({"model": os.environ.get("TEST_CONFIG", "base")}, {"plan": [1, 2]})
rec = cluster.handshake_record(digest, isl.name, isl.platform,
                               int(os.environ.get("TEST_DEVICES", "1")))
cluster.handshake(isl.world, rec, timeout=60)
print(f"HANDSHAKE OK rank {isl.world.rank}", flush=True)
