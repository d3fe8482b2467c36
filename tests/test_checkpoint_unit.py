"""Small pieces of issue 16 without training: the output-directory lock is not left stuck by a dead
holder; the handshake names the first config field that differs between ranks; the unit of every
parameter name; the probe of an unwritable directory, and that a killed probe leaves no file."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hethub_jax import checkpoint as ckpt
from hethub_jax.cluster import compare_records, handshake_record

ROOT = Path(__file__).resolve().parents[1]


def test_lock_of_a_live_holder_is_refused_and_of_a_killed_one_is_taken(tmp_path):
    lock = tmp_path / "ckpt" / ".lock"
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from hethub_jax.checkpoint import DirLock; "
            f"held = DirLock({str(lock)!r}); print('locked', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(ckpt.CheckpointError, match=rf"in use by another run \(pid {proc.pid} on host"):
            ckpt.DirLock(lock)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ckpt.DirLock(lock).release()  # the dead holder's lock is gone with it


def test_handshake_names_the_first_differing_field():
    recs = [handshake_record(h, "a", "cpu", 1, versions={}, config={"config": {"train": {"steps": s, "seed": 0}}})
            for h, s in (("x", 5), ("y", 6))]
    (problem,) = compare_records(recs)
    assert problem == "ranks run different configs/plans: config.train.steps: ranks [0] have 5; ranks [1] have 6"


def test_units_of_parameter_names():
    assert [ckpt.unit_of(n) for n in ("embed_tokens", "layers.12.mlp.up_proj", "norm", "lm_head")] == \
        ["embed", "layers.12", "head", "head"]
    assert ckpt.model_units(2) == ["embed", "layers.0", "layers.1", "head"]


def test_probe_of_an_unwritable_directory_names_it(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError, match=r"f/ckpt is not writable"):
        ckpt.probe_writable(tmp_path / "f" / "ckpt")
    ckpt.probe_writable(tmp_path / "ok")
    assert list((tmp_path / "ok").iterdir()) == []


def test_probe_killed_while_writing_leaves_no_file(tmp_path):
    """A rank killed while it writes the probe (here: the process ends inside the fsync, as an MPI abort
    by a peer's failed check would end it, so no ``finally`` runs) leaves nothing in the directory."""
    code = ("import os, sys; from hethub_jax import checkpoint as c\n"
            "os.fsync = lambda fd: os._exit(7)\n"
            "c.probe_writable(sys.argv[1])\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt")], capture_output=True, text=True)
    assert r.returncode == 7, r.stderr
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_probe_removes_stale_probe_files_only(tmp_path):
    old, fresh, other = tmp_path / ".probe.4242", tmp_path / ".probe.4343", tmp_path / "probe.keep"
    for p in (old, fresh, other):
        p.write_bytes(b"\0" * 16)
    past = time.time() - 2 * ckpt.STALE_PROBE_S
    os.utime(old, (past, past))
    os.utime(other, (past, past))
    ckpt.probe_writable(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".probe.4343", "probe.keep"]


def test_lock_file_is_deleted_on_release_and_a_stale_one_is_taken_over(tmp_path):
    """A clean exit leaves no lock file; a file left by a killed run (no flock held) does not block."""
    lock = tmp_path / "ckpt" / ".lock"
    held = ckpt.DirLock(lock)
    assert lock.read_text().startswith(f"pid {os.getpid()} on host ")
    with pytest.raises(ckpt.CheckpointError, match=rf"in use by another run .*lock file {lock}\)"):
        ckpt.DirLock(lock)  # a second holder in this process: flock is per open file
    held.release()
    held.release()  # idempotent
    assert not lock.exists()
    lock.write_text("pid 1 on host gone since 2026-01-01T00:00:00Z\n")  # a crashed run's leftover
    again = ckpt.DirLock(lock)
    assert lock.read_text().startswith(f"pid {os.getpid()} ")
    again.release()
    assert not lock.exists()


def test_lock_taken_while_its_holder_deletes_it_is_retaken(tmp_path, monkeypatch):
    """The lock of a file its releasing holder deleted (between our open and flock) excludes nobody:
    DirLock notices that the path names another file and locks the new one."""
    import fcntl
    lock = tmp_path / ".lock"
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        calls.append(op)
        if len(calls) == 1:  # a holder releases right now: deletes the file we opened
            lock.unlink()
        return real_flock(fd, op)
    monkeypatch.setattr(fcntl, "flock", flock)
    held = ckpt.DirLock(lock)
    assert len(calls) == 2 and lock.exists() and os.fstat(held._f.fileno()).st_ino == os.stat(lock).st_ino
    monkeypatch.setattr(fcntl, "flock", real_flock)
    held.release()
