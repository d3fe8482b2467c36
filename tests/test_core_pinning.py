"""Disjoint cores for the CPU islands of plan-less training (hethub_jax.core_pinning, issue 17)."""
import os
import subprocess
import sys

import pytest

from hethub_jax.core_pinning import island_cores, local_rank_and_size
from hethub_jax.train_predict import cores_note

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_local_rank_from_each_launcher():
    assert local_rank_and_size({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}) == (1, 2)  # MPICH / Hydra
    assert local_rank_and_size({"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == (0, 4)
    assert local_rank_and_size({"PMIX_LOCAL_RANK": "2", "PMIX_LOCAL_SIZE": "3"}) == (2, 3)
    assert local_rank_and_size({}) is None
    assert local_rank_and_size({"MPI_LOCALRANKID": "1"}) is None  # half a pair
    assert local_rank_and_size({"MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"}) is None  # rank out of range


def test_island_cores_hand_cases():
    assert island_cores(0, 2, [0, 1]) == (0,)
    assert island_cores(1, 2, [1, 0]) == (1,)
    assert island_cores(1, 2, [0, 1, 2, 3]) == (2, 3)
    assert island_cores(2, 3, range(7)) == (4, 5)  # 2 each, core 6 unused: every island the same share
    assert island_cores(0, 2, [5, 9]) == (5,)  # the ids this process may use, not 0..n-1
    assert island_cores(0, 3, [0, 1]) is None  # more ranks than cores: no disjoint share
    assert island_cores(0, 1, [0, 1]) is None  # one rank: nothing to share
    with pytest.raises(ValueError, match="local rank 2"):
        island_cores(2, 2, [0, 1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and 2 usable cores")
def test_pin_local_rank_pins_this_process_and_its_children():
    """A real process with Hydra's variables of local rank 1 of 2 ends up on the second usable core, and
    a child it starts afterwards (as rank 0's profiler is started) inherits that core."""
    cpus = sorted(os.sched_getaffinity(0))
    code = ("import os, subprocess, sys\n"
            "from hethub_jax.core_pinning import pin_local_rank\n"
            "print(pin_local_rank())\n"
            "print(sorted(os.sched_getaffinity(0)))\n"
            "print(subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
            " capture_output=True, text=True).stdout.strip())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "MPI_", "PMIX_"))}
    env.update(MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    line, own, child = out.strip().splitlines()
    expect = cpus[len(cpus) // 2:2 * (len(cpus) // 2)]
    assert own == str(expect) and child == str(expect)
    assert line.startswith("local rank 1: pinned to core")


def test_pin_local_rank_without_launcher_does_nothing():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "MPI_", "PMIX_"))}
    env["PYTHONPATH"] = ROOT
    code = "import os; from hethub_jax.core_pinning import pin_local_rank; b = os.sched_getaffinity(0); " \
           "print(pin_local_rank(), os.sched_getaffinity(0) == b)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", "True"]


def test_cores_note_names_a_profile_of_other_cores():
    assert cores_note({"platform": "cpu", "host_cpus": 2}, cores=2) is None
    note = cores_note({"platform": "cpu", "host_cpus": 2}, cores=1)
    assert "measured on 2 cores" in note and "runs on 1" in note
    assert cores_note({"platform": "cuda", "host_cpus": 2}, cores=1) is None
    assert cores_note({"platform": "cpu"}, cores=1) is None  # an older profile that does not say


def test_profile_cores_hand_cases():
    from hethub_jax.core_pinning import profile_cores
    assert profile_cores([0, 1]) == (0, 1)
    assert profile_cores([7, 3, 5]) == (3, 5)  # the first two usable ids, sorted: island processes 0 and 1
    with pytest.raises(ValueError, match="2 usable cores"):
        profile_cores([4])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and 2 usable cores")
def test_pin_threads_pins_threads_started_before_and_after():
    """A thread already running when ``pin_threads`` is called (as a BLAS or MPI pool) ends up on the
    core too, not just the calling thread, and so does one started afterwards (as XLA's pool)."""
    cpus = sorted(os.sched_getaffinity(0))
    code = ("import os, threading\n"
            "from hethub_jax.core_pinning import pin_threads\n"
            "ev = threading.Event(); ids = {}\n"
            "def run(k):\n"
            "    ids[k] = threading.get_native_id(); ev.wait()\n"
            "a = threading.Thread(target=run, args=('before',)); a.start()\n"
            "while 'before' not in ids: pass\n"
            f"pin_threads([{cpus[1]}])\n"
            "b = threading.Thread(target=run, args=('after',)); b.start()\n"
            "while 'after' not in ids: pass\n"
            "print(sorted(os.sched_getaffinity(ids['before'])), sorted(os.sched_getaffinity(ids['after'])),"
            " sorted(os.sched_getaffinity(0)))\n"
            "ev.set(); a.join(); b.join()\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == " ".join([str([cpus[1]])] * 3)
