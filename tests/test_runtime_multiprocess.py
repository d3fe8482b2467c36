"""Islands of several processes in the pipeline runtime (issue 15 parts 1-2).

MPI cases launch `mpiexec -n K python tests/mpi/runtime_multiprocess.py CASE` under a timeout: every
rank checks loss, gradients and parameters after 3 steps against the unsplit single-device reference
(see that script). The kill test runs `tests/mpi/kill_rank.py` under `hethub_jax.rank_guard`.
"""

import re
import signal
import subprocess
import sys
import time

import pytest
from test_comm_contract import HERE, run_mpi

from hethub_jax import rank_guard
from hethub_jax.comm.local import LocalCommunicator
from hethub_jax.parallel.plan import Plan
from hethub_jax.parallel.runtime import PipelineRuntime
from test_runtime_equivalence import OPTIM, model_config

SCRIPT = str(HERE / "mpi" / "runtime_multiprocess.py")


def _run(case: str, n: int) -> None:
    res = run_mpi([SCRIPT, case], n=n, timeout=600)
    out = res.stdout + "\n" + "\n".join(line for line in res.stderr.splitlines() if "[Gloo]" not in line)
    assert res.returncode == 0, f"{case} failed (exit {res.returncode}):\n{out[-5000:]}"
    for r in range(n):
        assert re.search(rf"OK rank {r} island [\w.]+ stage", res.stdout), out[-3000:]


@pytest.mark.mpi
def test_two_islands_of_two_processes_dp2_per_stage_equal_unsplit():
    # island a: 2 processes x 2 devices, stage 0 dp 2 x tp 2; island b: 2 processes x 1 device, dp 2
    _run("mp22", 4)


@pytest.mark.mpi
def test_island_of_two_processes_facing_one_process_tied_embeddings():
    _run("mp21", 3)  # DP 2 -> 1 re-slicing; the tied embedding's two copies stay bitwise equal


@pytest.mark.mpi
def test_two_stages_on_one_island_of_four_processes_run_split_one_island_per_stage():
    # the plan the runtime refuses (island a: 4 processes, 2 stages) split by parallel.split.split_islands
    _run("split", 4)


@pytest.mark.mpi
def test_killed_rank_ends_every_rank_within_30_s_naming_it():
    t0 = time.time()
    res = run_mpi(["-m", "hethub_jax.rank_guard", sys.executable, str(HERE / "mpi" / "kill_rank.py"), "2"],
                  n=4, timeout=120)
    t_end = time.time()
    out = res.stdout + res.stderr
    m = re.search(r"KILLING rank 2 AT ([0-9.]+)", out)
    assert m, out[-3000:]
    assert res.returncode != 0, out[-3000:]
    assert t_end - float(m.group(1)) < 30, f"job ended {t_end - float(m.group(1)):.1f} s after the kill"
    assert re.search(r"\[hethub rank_guard\] rank 2 \(pid \d+ on .*\) was killed by signal SIGKILL", out), out[-3000:]
    assert "was not ended" not in out and t_end - t0 < 120


def test_rank_guard_names_the_rank_and_passes_exit_codes(monkeypatch, capsys):
    monkeypatch.setenv("PMI_RANK", "5")
    code = rank_guard.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert code == 128 + signal.SIGKILL
    assert "rank 5 (pid" in capsys.readouterr().err
    assert rank_guard.run([sys.executable, "-c", "raise SystemExit(3)"]) == 3
    with pytest.raises(ValueError):
        rank_guard.run([])
    res = subprocess.run([sys.executable, "-m", "hethub_jax.rank_guard"], capture_output=True, text=True)
    assert res.returncode == 2 and "usage" in res.stderr


def _plan(stages):
    return Plan.from_dict({
        "islands": [{"name": "a", "platform": "cpu", "num_processes": 2, "devices_per_process": 2},
                    {"name": "b", "platform": "cpu"}],
        "stages": stages, "global_batch_size": 8, "microbatch_size": 2})


@pytest.mark.parametrize("stages, match", [
    ([{"island": "a", "first_layer": 0, "last_layer": 3}, {"island": "a", "first_layer": 4, "last_layer": 7},
      {"island": "b", "first_layer": 8, "last_layer": 10}], "runs one stage on an island of several processes"),
    ([{"island": "a", "first_layer": 0, "last_layer": 5, "dp": 1, "tp": 2, "devices": [1, 2]},
      {"island": "b", "first_layer": 6, "last_layer": 10}], "TP must fit inside one process"),
])
def test_multiprocess_layouts_the_runtime_cannot_run_are_refused(stages, match):
    comms = LocalCommunicator.create(3)
    with pytest.raises(ValueError, match=match):
        PipelineRuntime(_plan(stages), model_config(False), OPTIM, comm=comms[0], rank=0)



@pytest.mark.parametrize("stage0, refused", [
    ({"dp": 1, "tp": 2}, True),                        # devices 0-1: process 0 of island a only
    ({"dp": 2, "tp": 1}, True),                        # devices 0, 1: both on process 0
    ({"dp": 2, "tp": 1, "devices": [0, 2]}, False),    # one device on each process
    ({"dp": 2, "tp": 2}, False),                       # every device of the island
])
def test_checkpoints_need_a_multiprocess_islands_stage_on_every_process(stage0, refused):
    # train.py calls checkpoint.check_supported(plan) during set-up when train.checkpoint_dir is set:
    # orbax (0.12) cannot save a stage that runs on only some processes of a jax.distributed runtime
    from hethub_jax import checkpoint
    plan = _plan([{"island": "a", "first_layer": 0, "last_layer": 5, **stage0},
                  {"island": "b", "first_layer": 6, "last_layer": 10}])
    if refused:
        with pytest.raises(ValueError, match=r"train\.checkpoint_dir: stage 0 of replica 0 runs on processes "
                                             r"\[0\] of the 2 processes of island 'a'"):
            checkpoint.check_supported(plan)
    else:
        checkpoint.check_supported(plan)
