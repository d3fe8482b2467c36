"""Spike for issue 15 parts 1-2 (tests/mpi/multiprocess_island_probe.py): two CPU islands, each one
``jax.distributed`` runtime over its processes (2 CPU devices each), a 2-stage pipeline with DP
across processes and TP inside them, per-process batch feeding and matching-process exchange of
activations and their gradients. Loss and gradients are checked against float64 numpy on the
unsplit batch inside the probe; here every rank must report it and the job end cleanly."""

import pytest

from test_cluster import XLA2, _mpmd
from test_comm_contract import HERE


@pytest.mark.mpi
@pytest.mark.parametrize("n_a,n_b", [(2, 2), (2, 1), (1, 2)])
def test_multiprocess_islands_pipeline_matches_numpy(n_a, n_b):
    seg = [str(HERE / "mpi" / "multiprocess_island_probe.py")]
    proc = _mpmd([(n_a, {"HETHUB_ISLAND": "a"}), (n_b, {"HETHUB_ISLAND": "b"})], seg, extra=XLA2,
                 timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for r in range(n_a + n_b):
        name, size = ("a", n_a) if r < n_a else ("b", n_b)
        assert f"PROBE OK rank {r} island {name} processes {size} devices {2 * size}" in proc.stdout, \
            out[-3000:]
