"""Faults of a running MPI job (issue 16 part 2), on a 2-island plan of the tiny model (rank 0 = island
`b`, the last stage; rank 1 = island `a`, the first):

- a rank SIGKILLed mid-step: every rank is gone within 30 s, non-zero, and the output names the rank;
- a rank SIGSTOPped mid-step: its peer fails within ``train.message_timeout_s`` (+ start-up slack),
  naming the peer rank and island;
- a rank that fails before MPI starts (a config error on that rank only): it reports at the start-up
  gate and the job ends with its named error; a rank that dies before it can start MPI: its peer's
  start-up watchdog ends it after ``$HETHUB_MPI_INIT_TIMEOUT_S`` with one named line;
- a non-finite loss: with ``on_nonfinite_loss: stop`` the run ends with status 1 and writes no
  checkpoint of that step; with ``skip`` the update is not applied (parameters stay finite).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
model: {preset: tiny, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
        num_attention_heads: 2, num_key_value_heads: 1}
data: {seq_len: 16}
train: {steps: 100000, global_batch_size: 4, microbatch_size: 2, eval_every: 100000, eval_at_start: false,
        eval_batches: 1, log_every: 0, checkpoint_dir: null}
"""
PLAN = {"islands": [{"name": "b", "platform": "cpu", "num_processes": 1, "devices_per_process": 1},
                    {"name": "a", "platform": "cpu", "num_processes": 1, "devices_per_process": 1}],
        "stages": [{"island": "a", "first_layer": 0, "last_layer": 0, "dp": 1, "tp": 1},
                   {"island": "b", "first_layer": 1, "last_layer": 1, "dp": 1, "tp": 1}],
        "global_batch_size": 4, "microbatch_size": 2, "schedule": "1f1b", "recompute": "none"}


def _launch(tmp: Path, segments: list[list[str]], env: dict | None = None) -> subprocess.Popen:
    from test_comm_contract import mpiexec
    (tmp / "c.yaml").write_text(CONFIG)
    (tmp / "p.json").write_text(json.dumps(PLAN))
    cmd = [mpiexec()]
    for i, extra in enumerate(segments):
        cmd += ([":"] if i else []) + ["-n", "1", sys.executable, "-m", "hethub_jax.train", "--config",
                                       str(tmp / "c.yaml"), "--plan", str(tmp / "p.json"), "--metrics-file",
                                       str(tmp / "m.jsonl"), "--no-progress", *extra]
    full = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **(env or {}))
    full.pop("XLA_FLAGS", None)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full,
                            cwd=ROOT, start_new_session=True)


def _rank_pid(tag: Path, rank: int) -> int:
    """The pid of the training process of MPI rank ``rank`` whose command line names ``tag``."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().decode(errors="replace")
            envs = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(tag) in cmd and "hethub_jax.train" in cmd and f"PMI_RANK={rank}".encode() in envs:
            return int(p.name)
    raise AssertionError(f"rank {rank} process not found")


def _wait_for_steps(tmp: Path, proc: subprocess.Popen, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        m = tmp / "m.jsonl"
        if m.exists() and sum('"kind": "step"' in line for line in m.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    out = proc.communicate()[0] if proc.poll() is not None else ""
    raise AssertionError(f"training did not reach step {n}: {out[-3000:]}")


def _finish(proc: subprocess.Popen, within: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        out = proc.communicate(timeout=within)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        raise AssertionError(f"job still running {within} s after the fault:\n{out[-3000:]}")
    return proc.returncode, out, time.monotonic() - t0


pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_sigkill_of_a_rank_ends_the_job_naming_it(tmp_path):
    proc = _launch(tmp_path, [[], []])
    _wait_for_steps(tmp_path, proc, 2)
    pid = _rank_pid(tmp_path, 1)
    os.kill(pid, signal.SIGKILL)
    rc, out, dt = _finish(proc, 30)
    assert rc != 0 and dt < 30
    # each rank's start-up line maps pids to ranks and islands (mpiexec's "BAD TERMINATION ... PID P"
    # may name a rank it killed in its clean-up; hethub_jax.rank_guard names the dead rank reliably)
    assert f"rank 1 (island a): pid {pid} on host" in out and "BAD TERMINATION" in out, out[-3000:]


def test_sigstopped_peer_is_reported_within_the_message_timeout(tmp_path):
    proc = _launch(tmp_path, [["--set", "train.message_timeout_s=5"]] * 2)
    _wait_for_steps(tmp_path, proc, 2)
    pid = _rank_pid(tmp_path, 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        rc, out, dt = _finish(proc, 60)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert rc != 0, out[-3000:]
    assert "rank 1 (island a)" in out and "train.message_timeout_s" in out, out[-3000:]


def test_rank_failing_before_mpi_start_ends_the_job_at_the_start_up_gate(tmp_path):
    # the watchdog is far away: what ends the job is the failing rank reporting at the start-up gate
    t0 = time.monotonic()
    proc = _launch(tmp_path, [[], ["--steps", "0"]], env={"HETHUB_MPI_INIT_TIMEOUT_S": "600"})
    rc, out, _ = _finish(proc, 120)
    assert rc == 2, out[-3000:]
    assert "error: rank 1 (island a): train.steps must be an integer >= 1, got 0" in out, out[-3000:]
    assert "rank 0: stopping: rank 1 failed before MPI started" in out, out[-3000:]
    assert "MPI did not start" not in out and "Timeout (" not in out, out[-3000:]
    assert time.monotonic() - t0 < 60, out[-3000:]  # start-up of two ranks on a loaded 2-core machine
    assert not (tmp_path / "m.jsonl").exists()


def test_rank_dying_before_it_can_start_mpi_ends_its_peers_after_the_watchdog(tmp_path):
    # a part of the mpiexec line that never reaches hethub_jax (a wrong module, a Python error): the
    # healthy rank's MPI_Init would wait forever; the start-up watchdog ends it, with one named line
    from test_comm_contract import mpiexec
    (tmp_path / "c.yaml").write_text(CONFIG)
    (tmp_path / "p.json").write_text(json.dumps(PLAN))
    cmd = [mpiexec(), "-n", "1", sys.executable, "-m", "hethub_jax.train", "--config", str(tmp_path / "c.yaml"),
           "--plan", str(tmp_path / "p.json"), "--metrics-file", str(tmp_path / "m.jsonl"), "--no-progress",
           ":", "-n", "1", sys.executable, "-c", "raise SystemExit('dies before MPI')"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HETHUB_MPI_INIT_TIMEOUT_S="5")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    rc, out, _ = _finish(proc, 120)
    assert rc != 0 and "dies before MPI" in out, out[-3000:]
    assert ("error: rank 0: MPI did not start within 5 s ($HETHUB_MPI_INIT_TIMEOUT_S): another rank of "
            "the job ended before starting MPI") in out, out[-3000:]
    assert "Timeout (" not in out and "Traceback" not in out, out[-3000:]  # one line, no stack dump
    assert time.monotonic() - t0 < 5 + 45, out[-3000:]
    assert not (tmp_path / "m.jsonl").exists()
