"""One contract suite (tests/mpi/comm_checks.py) against both backends.

- ``local``: LocalCommunicator.create(4), one thread per logical rank, in this process.
- ``mpi``: MPIHostBridge with 1 MiB chunks, `mpiexec -n 4 python tests/mpi/run_contract.py` launched
  once per session; each check's verdict is read from its output lines. Where
  ``HETHUB_EXPECT_HOTPATH=1`` (CI sets it: its install builds the C hot path,
  ``python -m hethub_jax.comm.build_hotpath``) the hot path (``hethub_jax/comm/_hotpath.c``) must be
  built and in use; elsewhere (a site MPI, no compiler) the checks pass either way.
- ``mpi_python``: the same with ``HETHUB_COMM_HOTPATH=0``: the bridge's pure-Python paths.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "mpi"))

import comm_checks  # noqa: E402

from hethub_jax.comm import LocalCommunicator  # noqa: E402
from hethub_jax.comm.base import CommTimeoutError, Header, reduce_arrays  # noqa: E402

CHECKS = sorted(comm_checks.CHECKS)


def mpiexec() -> str:
    exe = Path(sys.executable).parent / "mpiexec"
    found = str(exe) if exe.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found next to the Python executable nor on PATH")
    return found


def run_mpi(args: list[str], n: int, timeout: float, env: dict | None = None,
            mpiexec_args: list[str] | None = None) -> subprocess.CompletedProcess:
    """`mpiexec -n n python args...` with the repository on PYTHONPATH, under ``timeout`` seconds."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    cmd = [mpiexec(), *(mpiexec_args or []), "-n", str(n), sys.executable, *args]
    return run_group(cmd, timeout, full_env)


def run_group(cmd: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (mpiexec and ranks)
    and fail the test with the output so far."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} still running after {timeout} s (killed):\n"
                    f"{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_local(check, n=comm_checks.SIZE, timeout=60.0):
    comms = LocalCommunicator.create(n, timeout=30)
    errors: dict[int, BaseException] = {}

    def body(c):
        try:
            check(c)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[c.rank] = e

    threads = [threading.Thread(target=body, args=(c,), daemon=True) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a logical rank is still running (hang)"
    if errors:
        rank, err = sorted(errors.items())[0]
        raise AssertionError(f"rank {rank} failed: {type(err).__name__}: {err}") from err


MPI_BACKENDS = {"mpi": "1", "mpi_python": "0"}  # backend -> HETHUB_COMM_HOTPATH


@pytest.fixture(scope="module", params=list(MPI_BACKENDS))
def mpi_results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("contract")
    proc = run_mpi([str(HERE / "mpi" / "run_contract.py")], comm_checks.SIZE, timeout=240,
                   env={"RESULTS_DIR": str(out), "HETHUB_COMM_HOTPATH": MPI_BACKENDS[request.param]})
    results: dict[str, dict[int, str]] = {}
    for f in out.glob("rank*.txt"):
        for line in f.read_text().splitlines():
            _, name, rank, verdict = (line.split(" ", 3) + [""])[:4]
            results.setdefault(name, {})[int(rank)] = verdict
    return request.param, proc, results


@pytest.mark.parametrize("name", CHECKS)
def test_contract_local(name):
    run_local(comm_checks.CHECKS[name])


@pytest.mark.parametrize("name", CHECKS)
def test_contract_mpi(mpi_results, name):
    _, proc, results = mpi_results
    got = results.get(name, {})
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:])
    assert set(got) == set(range(comm_checks.SIZE)), f"missing ranks for {name}:\n{tail}"
    bad = {r: v for r, v in got.items() if v != "PASS"}
    assert not bad, f"{name} failed: {bad}"


@pytest.mark.mpi
def test_mpi_only_checks_and_clean_exit(mpi_results):
    backend, proc, results = mpi_results
    tail = proc.stdout[-3000:] + "\n" + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    for name in ("chunking_mpi", "fast_path_timeouts_mpi", "fast_paths_taken_mpi", "allreduce_rank_order_3_mpi",
                 "allreduce_exchange_timeout_mpi"):
        assert results.get(name) == {r: "PASS" for r in range(comm_checks.SIZE)}, (name, tail)
    assert "pending" not in proc.stderr, proc.stderr[-2000:]  # no request left behind
    # HETHUB_COMM_HOTPATH=0 turns the C hot path off; otherwise it is used wherever it was built
    # for mpi4py's MPI, which an install that expects it (CI) must have done
    got = results.get("hotpath", {})
    if backend == "mpi_python" or hotpath_expected():
        want = "ON" if backend == "mpi" else "OFF"
        assert got == {r: want for r in range(comm_checks.SIZE)}, tail
    else:
        assert set(got) == set(range(comm_checks.SIZE)) and len(set(got.values())) == 1, tail


def hotpath_expected() -> bool:
    """True where the environment says the C hot path was built (``HETHUB_EXPECT_HOTPATH=1``)."""
    return os.environ.get("HETHUB_EXPECT_HOTPATH", "").strip() == "1"


# ---- pieces that need no second rank --------------------------------------------------------
def test_header_roundtrip_and_rejects_garbage():
    import ml_dtypes

    a = np.zeros((2, 0, 5), ml_dtypes.float8_e5m2)
    h = Header.for_array(a, tag=42, chunk_bytes=7, part=1, parts=3)
    buf = h.encode() + b"\0" * 100
    assert Header.decode(buf) == h
    from hethub_jax.comm.base import CommError

    with pytest.raises(CommError, match="magic"):
        Header.decode(b"XXXX" + buf[4:])
    with pytest.raises(CommError):
        Header.decode(buf[:10])


def test_reference_reduction_rounds_once():
    import ml_dtypes

    parts = [np.array([1.0, 2**-8], ml_dtypes.bfloat16)] * 3
    want = (np.array([1.0, 2**-8], np.float32) * 3).astype(ml_dtypes.bfloat16)
    assert np.array_equal(reduce_arrays(parts, "sum").view(np.uint16), want.view(np.uint16))


def test_local_timeout_names_peer_and_tag_and_withdraws():
    a, b = LocalCommunicator.create(2, timeout=5)
    with pytest.raises(CommTimeoutError, match=r"rank 0 \(tag 3\)"):
        b.recv(0, tag=3, timeout=0.05)
    a.send(np.arange(3), 1, tag=3)  # goes to the next receive, not the abandoned one
    assert np.array_equal(b.recv(0, tag=3, timeout=1), np.arange(3))


def test_local_send_is_buffered_copy():
    a, b = LocalCommunicator.create(2)
    x = np.arange(4)
    a.send(x, 1)
    x[:] = -1
    assert np.array_equal(b.recv(0), np.arange(4))


def test_local_allreduce_rank_order_3_ranks():
    """The in-process backend on 3 ranks: numpy's rank-ordered reduction, the same bits on every rank
    (the MPI bridge's 3-rank case is ``allreduce_rank_order_3_mpi``)."""
    run_local(lambda c: comm_checks.assert_rank_order_allreduce(c, "3 local ranks"), n=3)
