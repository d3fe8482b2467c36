"""Resuming under MPI: ``checkpoint.restore_latest`` makes every rank take the same path (same step
list, same outcome of each step tried) and raise the same error naming the ranks that found each
fault, so that ``train`` prints it once (``cluster.agree_errors``) and no rank waits in a collective
its peers left. The multi-rank runs of ``python -m hethub_jax.train`` are in ``test_bad_inputs.py``
(``checkpoint_*`` cases under mpiexec); here the agreement is checked in one process against a scripted
peer (a two-rank communicator whose rank 1 answers from a list), on hand-made checkpoint directories.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hethub_jax import checkpoint as ckpt

N_LAYERS = 2


def _step(root: Path, step: int, global_batch_size: int = 4) -> None:
    """A step that looks complete (unit directories, CRC files, meta.json); its arrays are never read
    here (``_read_step`` is scripted)."""
    d = root / f"step_{step}"
    for u in ckpt.model_units(N_LAYERS):
        (d / u).mkdir(parents=True)
        (d / f"{u}.crc.json").write_text("{}")
    (d / "meta.json").write_text(json.dumps({"format": 2, "step": step, "config": {"model": {}, "data": {}},
                                             "data": {"global_batch_size": global_batch_size}}))


class ScriptedPeer:
    """Rank 0 of a 2-rank communicator; rank 1's record at each allgather comes from ``script`` (its
    text, or None: nothing to say), encoded as ``checkpoint._gather_text`` encodes one."""

    rank, size = 0, 2

    def __init__(self, script):
        self.script, self.calls = list(script), 0

    def allgather(self, rec):
        peer = np.zeros_like(rec)
        text = self.script[self.calls]
        self.calls += 1
        if text is not None:
            raw = text.encode()
            peer[0], peer[1:1 + len(raw)] = 1, np.frombuffer(raw, np.uint8)
        return np.stack([rec, peer])


def _rt(comm):
    return SimpleNamespace(comm=comm, config=SimpleNamespace(num_hidden_layers=N_LAYERS), stages={})


def _read_step_failing(bad_steps):
    def read(rt, root, step):
        if step in bad_steps:
            raise ckpt.CheckpointCorrupt(f"{root}/step_{step}/embed: cannot be read (scripted)")
        return {}
    return read


def test_by_ranks_groups_each_text_once_after_its_ranks():
    assert ckpt.by_ranks({0: "A", 1: "A"}, 2) == "A"             # every rank, one text: the text
    assert ckpt.by_ranks({0: "A"}, 1) == "A"                     # one process
    assert ckpt.by_ranks({1: "A"}, 2) == "rank 1: A"
    assert ckpt.by_ranks({0: "A", 1: "B", 2: "B", 3: "B", 5: "A"}, 6) == "ranks 0, 5: A; ranks 1-3: B"


def test_a_peer_s_corrupt_newest_step_makes_every_rank_fall_back_together(tmp_path, monkeypatch):
    _step(tmp_path, 2)
    _step(tmp_path, 4)
    monkeypatch.setattr(ckpt, "_read_step", _read_step_failing(set()))  # this rank reads both steps
    comm = ScriptedPeer(["4, 2", "Cstep_4/layers.1: cannot be read (on the peer)", None])
    warnings = []
    step, meta = ckpt.restore_latest(_rt(comm), tmp_path, {"model": {}, "data": {}}, 4, warn=warnings.append)
    assert (step, meta["step"], comm.calls) == (2, 2, 3)
    assert len(warnings) == 1 and "step 4" in warnings[0] and "rank 1: step_4/layers.1" in warnings[0]


def test_every_step_corrupt_names_the_ranks_that_found_each_fault(tmp_path, monkeypatch):
    _step(tmp_path, 2)
    _step(tmp_path, 4)
    monkeypatch.setattr(ckpt, "_read_step", _read_step_failing({4}))   # this rank: step 4 only
    comm = ScriptedPeer(["4, 2", "Cpeer fault 4", "Cpeer fault 2"])
    with pytest.raises(ckpt.CheckpointCorrupt) as e:
        ckpt.restore_latest(_rt(comm), tmp_path, {"model": {}, "data": {}}, 4, warn=lambda m: None)
    msg = str(e.value)
    assert msg.startswith(f"every complete checkpoint in {tmp_path} is corrupt: ")
    assert f"rank 0: {tmp_path}/step_4/embed: cannot be read (scripted); rank 1: peer fault 4 | " in msg
    assert msg.endswith(" | rank 1: peer fault 2") and comm.calls == 3


def test_a_mismatch_found_by_one_rank_stops_every_rank(tmp_path, monkeypatch):
    _step(tmp_path, 2)
    monkeypatch.setattr(ckpt, "_read_step", _read_step_failing(set()))
    comm = ScriptedPeer(["2", "Mcheckpoint x was written for another set-up: model.hidden_size is 48 there"])
    with pytest.raises(ckpt.CheckpointMismatch, match=r"^rank 1: checkpoint x was written for another set-up"):
        ckpt.restore_latest(_rt(comm), tmp_path, {"model": {}, "data": {}}, 4)


def test_ranks_seeing_different_steps_stop_before_reading_any(tmp_path, monkeypatch):
    _step(tmp_path, 2)
    _step(tmp_path, 4)
    monkeypatch.setattr(ckpt, "_read_step", lambda *a: pytest.fail("no step may be read"))
    comm = ScriptedPeer(["none"])
    with pytest.raises(ckpt.CheckpointError, match=r"different complete checkpoint steps in .*: rank 0: steps 4, 2; "
                                                   r"rank 1: no complete step \(the ranks need one"):
        ckpt.restore_latest(_rt(comm), tmp_path, {"model": {}, "data": {}}, 4)
    assert comm.calls == 1


def test_one_process_restores_without_a_communicator(tmp_path, monkeypatch):
    _step(tmp_path, 2)
    _step(tmp_path, 4, global_batch_size=8)
    monkeypatch.setattr(ckpt, "_read_step", _read_step_failing(set()))
    with pytest.raises(ckpt.CheckpointMismatch, match=r"^checkpoint .*step_4 was written for another set-up: "
                                                      r"train\.global_batch_size is 8 there, 4 here"):
        ckpt.restore_latest(_rt(None), tmp_path, {"model": {}, "data": {}}, 4)
