"""Islands, start-up handshake and failure propagation (hethub_jax.cluster)."""

from __future__ import annotations

import threading
import time

import pytest
from test_comm_contract import HERE, run_mpi

from hethub_jax import cluster
from hethub_jax.comm import LocalCommunicator

XLA2 = ["-genv", "XLA_FLAGS", "--xla_force_host_platform_device_count=2"]


# ---- pure functions --------------------------------------------------------------------------
def test_island_from_flag_then_environment():
    assert cluster.island_from_args(["--island", "a", "x"], {}) == "a"
    assert cluster.island_from_args(["--island=b"], {"HETHUB_ISLAND": "z"}) == "b"
    assert cluster.island_from_args([], {"HETHUB_ISLAND": "z"}) == "z"
    with pytest.raises(ValueError, match="--island"):
        cluster.island_from_args([], {})
    with pytest.raises(ValueError, match="64 bytes"):
        cluster.island_from_args(["--island", "x" * 65], {})


def test_platform_lookup_order():
    assert cluster.platform_for("a", "cuda", ["--platform", "rocm"], {}) == "cuda"
    assert cluster.platform_for("a", None, ["--platform", "rocm"], {"HETHUB_PLATFORM": "x"}) == "rocm"
    assert cluster.platform_for("a", None, [], {"HETHUB_PLATFORM": "cpu"}) == "cpu"
    assert cluster.platform_for("cpu", None, [], {}) == "cpu"
    with pytest.raises(ValueError, match="no JAX platform"):
        cluster.platform_for("a", None, [], {})


def test_set_jax_platform_refuses_a_different_platform_after_import():
    import jax

    jax.devices()  # backends initialised with the test platform (cpu)
    env = {}
    cluster.set_jax_platform("cpu", env)
    assert env == {"JAX_PLATFORMS": "cpu"}
    with pytest.raises(RuntimeError, match="cuda"):
        cluster.set_jax_platform("cuda", {})


def _rec(h="h", island="a", platform="cpu", devices=2, jax_version="0.10.2"):
    return cluster.handshake_record(h, island, platform, devices,
                                    {"jax": jax_version, "hethub-jax": "0.1.0"})


def test_compare_records_names_field_and_ranks():
    ok = [_rec(), _rec(), _rec(island="b", platform="cuda", devices=8, jax_version="0.10.3")]
    assert cluster.compare_records(ok) == []  # versions/platform may differ between islands
    bad = cluster.compare_records([_rec(), _rec(h="other"), _rec()])
    assert len(bad) == 1 and "config/plan hash" in bad[0] and "ranks [1]" in bad[0], bad
    bad = cluster.compare_records([_rec(), _rec(devices=4), _rec(island="b")])
    assert len(bad) == 1 and "local_device_count" in bad[0] and "'a'" in bad[0], bad
    bad = cluster.compare_records([_rec(), _rec(platform="rocm")])
    assert "platform differs within island 'a'" in bad[0]
    bad = cluster.compare_records([_rec(), _rec(jax_version="0.9")])
    assert "versions differ" in bad[0]


def test_launcher_rank_from_the_environment_of_mpich_open_mpi_pmix_or_slurm():
    assert cluster.launcher_rank({}) is None
    assert cluster.launcher_rank({"PMI_RANK": "3"}) == 3
    assert cluster.launcher_rank({"OMPI_COMM_WORLD_RANK": "5"}) == 5
    assert cluster.launcher_rank({"PMIX_RANK": "1"}) == 1
    assert cluster.launcher_rank({"SLURM_PROCID": "7"}) == 7


_WATCHED = """
import time
from hethub_jax import cluster
with cluster.start_watchdog():
    {body}
time.sleep(2.5)  # longer than the timeout: the watchdog must be gone
print("alive after the watchdog")
"""


def _watched(body: str, timeout_s: str):
    import os
    import subprocess
    import sys

    from test_comm_contract import ROOT
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_"))}
    env.update(PYTHONPATH=str(ROOT), HETHUB_MPI_INIT_TIMEOUT_S=timeout_s)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", _WATCHED.format(body=body)], env=env, capture_output=True,
                         text=True, timeout=120)
    return res, time.monotonic() - t0


def test_start_watchdog_ends_a_process_stuck_in_c_code_holding_the_gil_with_one_line():
    # sum(range(...)) runs in C without releasing the interpreter lock, as mpi4py's MPI_Init does:
    # no Python thread or signal handler could act; the watchdog's child process does
    res, dt = _watched("sum(range(10 ** 13))", "1")
    assert res.returncode == -15, (res.returncode, res.stderr)  # SIGTERM
    assert res.stderr.strip().splitlines() == [
        "python -m hethub_jax.train: error: this rank: MPI did not start within 1 s ($HETHUB_MPI_INIT_TIMEOUT_S): "
        "another rank of the job ended before starting MPI (see its output: a Python error, a wrong command "
        "or path in its part of the mpiexec line) or never started; ending this rank"], res.stderr
    assert "alive" not in res.stdout and dt < 60


def test_start_watchdog_leaves_a_process_alone_once_the_context_ends():
    res, _ = _watched("pass", "1")
    assert res.returncode == 0 and "alive after the watchdog" in res.stdout and res.stderr == "", res.stderr


def test_config_hash_is_order_independent_and_sensitive():
    assert cluster.config_hash({"a": 1, "b": [1, 2]}) == cluster.config_hash({"b": [1, 2], "a": 1})
    assert cluster.config_hash({"a": 1}) != cluster.config_hash({"a": 2})


def _handshake_all(records):
    comms = LocalCommunicator.create(len(records), timeout=10)
    out: dict[int, object] = {}

    def body(c):
        try:
            out[c.rank] = cluster.handshake(c, records[c.rank])
        except Exception as e:  # noqa: BLE001
            out[c.rank] = e

    ts = [threading.Thread(target=body, args=(c,)) for c in comms]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    return out


def test_handshake_in_process_agrees_or_fails_everywhere():
    recs = [_rec(), _rec(), _rec(island="b", devices=1)]
    out = _handshake_all(recs)
    assert all(out[r] == recs for r in range(3))
    out = _handshake_all([_rec(), _rec(), _rec(h="x", island="b")])
    msgs = {str(e) for e in out.values()}
    assert all(isinstance(e, cluster.HandshakeError) for e in out.values())
    assert len(msgs) == 1 and "config/plan hash differs" in msgs.pop()


# ---- multi-rank (mpiexec) ----------------------------------------------------------------------
def failed_within_30_s(launch) -> str:
    """Runs ``launch()`` (a job expected to fail); asserts it ended non-zero within 30 s; its output."""
    t0 = time.monotonic()
    proc = launch()
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert elapsed < 30, f"job took {elapsed:.1f} s to end"
    return out


@pytest.mark.mpi
def test_exception_on_one_rank_ends_every_rank_quickly():
    out = failed_within_30_s(lambda: run_mpi([str(HERE / "mpi" / "raise_on_rank.py"), "2"], 4, timeout=60))
    assert "[rank 2, island test]" in out and "deliberate failure on rank 2" in out, out[-2000:]
    assert "was not aborted" not in out


@pytest.mark.mpi
def test_handshake_mismatch_ends_job_with_one_message():
    seg = [str(HERE / "mpi" / "handshake_mismatch.py")]
    # ranks 0,1: island a; rank 2: island b with a different config
    out = failed_within_30_s(lambda: _mpmd(
        [(2, {"HETHUB_ISLAND": "a"}), (1, {"HETHUB_ISLAND": "b", "TEST_CONFIG": "x"})], seg))
    assert "config/plan hash differs" in out and "ranks [2]" in out, out[-2000:]
    assert "HANDSHAKE OK" not in out


@pytest.mark.mpi
def test_handshake_agreement_across_islands():
    seg = [str(HERE / "mpi" / "handshake_mismatch.py")]
    proc = _mpmd([(2, {"HETHUB_ISLAND": "a"}), (1, {"HETHUB_ISLAND": "b", "TEST_DEVICES": "3"})],
                 seg)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    assert sorted(proc.stdout.count(f"HANDSHAKE OK rank {r}") for r in range(3)) == [1, 1, 1]


@pytest.mark.mpi
def test_two_process_cpu_island_sums_over_its_four_device_mesh():
    seg = [str(HERE / "mpi" / "island_sum.py")]
    proc = _mpmd([(2, {"HETHUB_ISLAND": "a"}), (1, {"HETHUB_ISLAND": "b"})], seg, extra=XLA2,
                 timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for r, name, size in [(0, "a", 2), (1, "a", 2), (2, "b", 1)]:
        assert f"OK rank {r} island {name} size {size} names ('a', 'b')" in proc.stdout, out[-3000:]


def _mpmd(segments, script_args, extra=None, timeout=60):
    """mpiexec [extra] -n N1 -env K V python script : -n N2 ... (hydra MPMD with per-segment env)."""
    import os
    import sys

    from test_comm_contract import ROOT, mpiexec, run_group

    cmd = [mpiexec(), *(extra or [])]
    for i, (n, env) in enumerate(segments):
        if i:
            cmd.append(":")
        cmd += ["-n", str(n)]
        for k, v in env.items():
            cmd += ["-env", k, v]
        cmd += [sys.executable, *script_args]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return run_group(cmd, timeout, env)
