"""Checkpoints of islands of several processes (issue 15 part 3, issue 16 part 1).

The 4-rank job: island ``a`` = 2 processes x 2 CPU devices runs stage 0 (layer 0 and the embedding)
on DP 2 x TP 2 (DP across the processes), island ``b`` = 2 processes x 1 device runs stage 1 (layers
1-2, norm, head) on DP 2; every process of an island saves the units of its stage together (orbax
multi-process save). Its uninterrupted run (4 steps, a checkpoint every 2) is the reference:

- resume from its step-2 checkpoint under the same plan (4 ranks): losses of steps 3-4 bitwise equal;
- resume from it on one process per island (1+1, in this process) and on a single device: equal
  within float32 tolerance;
- a checkpoint written by the 1+1 plan resumes on the 4-rank plan: equal to the 1+1 run's losses
  within float32 tolerance;
- a process of a 2-process island SIGKILLed in the middle of a save (``tests/mpi/checkpoint_crash.py``)
  leaves that step incomplete and the previous one loadable, bitwise.

Same tiny model and config as ``tests/test_checkpoint_resume.py``. The 4-rank runs go through
``mpiexec -n 4 python -m hethub_jax.train`` (each 1-2 minutes on 2 cores, up to 9 minutes under a load
average of 15, mostly start-up and compilation; the module took 11-18 minutes on the shared machine).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_checkpoint_resume import CONFIG, LAYERS, _losses, _train
from test_comm_contract import run_mpi

from hethub_jax import checkpoint as ckpt

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def _plan(path: Path, islands: list[tuple[str, int, int]], stages: list[tuple[str, int, int, int, int]]) -> Path:
    """islands: (name, processes, devices per process); stages: (island, first, last, dp, tp)."""
    path.write_text(json.dumps({
        "islands": [{"name": n, "platform": "cpu", "num_processes": p, "devices_per_process": d}
                    for n, p, d in islands],
        "stages": [{"island": i, "first_layer": f, "last_layer": la, "dp": dp, "tp": tp}
                   for i, f, la, dp, tp in stages],
        "global_batch_size": 8, "microbatch_size": 2, "schedule": "1f1b", "recompute": "none"}))
    return path


def _plan_22(path: Path) -> Path:
    return _plan(path, [("a", 2, 2), ("b", 2, 1)], [("a", 0, 0, 2, 2), ("b", 1, 2, 2, 1)])


def _plan_11(path: Path) -> Path:
    return _plan(path, [("a", 1, 1), ("b", 1, 2)], [("a", 0, 0, 1, 1), ("b", 1, 2, 1, 2)])


def _train_4_ranks(d: Path, plan: Path, *extra: str) -> None:
    cfg = d / "c.yaml"
    cfg.write_text(CONFIG)
    res = run_mpi(["-m", "hethub_jax.train", "--config", str(cfg), "--plan", str(plan), "--metrics-file",
                   str(d / "m.jsonl"), "--checkpoint-dir", str(d / "ckpt"), "--no-progress", *extra],
                  n=4, timeout=900)
    out = res.stdout + "\n" + "\n".join(line for line in res.stderr.splitlines() if "[Gloo]" not in line)
    assert res.returncode == 0, f"4-rank run failed (exit {res.returncode}):\n{out[-5000:]}"


def _copy_step2(src: Path, d: Path) -> None:
    shutil.copytree(src / "ckpt" / "step_2", d / "ckpt" / "step_2")


@pytest.fixture(scope="module")
def straight_22(tmp_path_factory):
    """The uninterrupted 4-rank run (2 islands of 2 processes)."""
    d = tmp_path_factory.mktemp("straight22")
    plan = _plan_22(d / "plan.json")
    _train_4_ranks(d, plan)
    assert ckpt.complete_steps(d / "ckpt", LAYERS) == [4, 2]
    return {"dir": d, "plan": plan, "losses": _losses(d / "m.jsonl")}


def test_every_process_of_an_island_writes_its_part(straight_22):
    # orbax's multi-process save: each process of the island writes the shards it holds
    # (ocdbt.process_{i}); the island's process 0 commits the unit and writes its CRC file
    step = straight_22["dir"] / "ckpt" / "step_2"
    for unit in ckpt.model_units(LAYERS):
        for proc in (0, 1):
            files = [p for p in (step / unit / f"ocdbt.process_{proc}").rglob("*") if p.is_file()]
            assert files, f"{unit}: nothing written by process {proc} of its island"
        crc = json.loads((step / f"{unit}.crc.json").read_text())
        assert crc and all(len(v) == 3 for v in crc.values())
    meta = ckpt.read_meta(straight_22["dir"] / "ckpt", 2)
    assert [i["num_processes"] for i in meta["plan"]["islands"]] == [2, 2]
    assert meta["data"]["next_step"] == 3 and meta["world_size"] == 4


def test_resume_4_rank_job_same_plan_is_bitwise_equal(straight_22, tmp_path):
    _copy_step2(straight_22["dir"], tmp_path)
    _train_4_ranks(tmp_path, straight_22["plan"], "--resume")
    recs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r for r in recs if r["kind"] == "run"][-1]["resumed_from"]["step"] == 2
    got = _losses(tmp_path / "m.jsonl")
    assert sorted(got) == [3, 4]
    for s in (3, 4):
        assert got[s] == straight_22["losses"][s], (s, got[s], straight_22["losses"][s])


@pytest.mark.parametrize("layout", ["one_process_per_island", "single_device"])
def test_resume_4_rank_checkpoint_on_another_plan(straight_22, tmp_path, layout):
    _copy_step2(straight_22["dir"], tmp_path)
    args = ["--plan", str(_plan_11(tmp_path / "p.json"))] if layout == "one_process_per_island" else []
    rc, err = _train(tmp_path, "--resume", *args)  # all islands in this process
    assert rc == 0, err
    got = _losses(tmp_path / "m.jsonl")
    for s in (3, 4):
        np.testing.assert_allclose(got[s], straight_22["losses"][s], rtol=2e-5)


def test_checkpoint_of_one_process_per_island_resumes_on_4_ranks(tmp_path):
    src = tmp_path / "straight11"
    src.mkdir()
    rc, err = _train(src, "--plan", str(_plan_11(src / "p.json")))
    assert rc == 0, err
    want = _losses(src / "m.jsonl")
    d = tmp_path / "resumed"
    _copy_step2(src, d)
    _train_4_ranks(d, _plan_22(d / "p.json"), "--resume")
    got = _losses(d / "m.jsonl")
    assert sorted(got) == [3, 4]
    for s in (3, 4):
        np.testing.assert_allclose(got[s], want[s], rtol=2e-5)


def test_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """tests/mpi/checkpoint_crash.py: a 2-process island saves step 1, then one of its processes is
    SIGKILLed while step 2 is being written; step 1 must be the newest complete step and load
    bitwise (parameters dumped by the job after saving step 1) into a single-device runtime."""
    from test_comm_contract import HERE
    from test_runtime_equivalence import LAYERS as N, OPTIM, model_config

    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.runtime import PipelineRuntime

    res = run_mpi([str(HERE / "mpi" / "checkpoint_crash.py"), str(tmp_path)], n=2, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "UNEXPECTED" not in out, out[-3000:]
    assert (tmp_path / "step_2").is_dir(), "step 2 was never started"
    assert ckpt.complete_steps(tmp_path, N) == [1], sorted(p.name for p in (tmp_path / "step_2").iterdir())
    plan = Plan.from_dict({"islands": [{"name": "main", "platform": "cpu"}],
                           "stages": [{"island": "main", "first_layer": 0, "last_layer": N - 1}],
                           "global_batch_size": 8, "microbatch_size": 2})
    rt = PipelineRuntime(plan, model_config(False), OPTIM, seed=1)
    step, _ = ckpt.restore_latest(rt, tmp_path, {"model": {}, "data": {}}, 8)
    ref = np.load(tmp_path / "step1_params.npz")
    assert step == 1 and sorted(ref.files) == sorted(rt.params())
    for n, v in rt.params().items():
        np.testing.assert_array_equal(v, ref[n], err_msg=n)
