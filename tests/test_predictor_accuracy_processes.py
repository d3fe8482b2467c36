"""``benchmarks/predictor_accuracy.py`` with its islands as PROCESSES (``--islands processes``, the default since
session 14): one tiny row (``pp2_1f1b_m4``, one timed step) measured as two processes under ``mpiexec -n 2`` over
the MPI host bridge, checked against the same row measured as threads of one process (``LocalCommunicator``,
the benchmark before session 14) as the reference: the same actions on the same islands and stages, and the
records of both processes on one clock (``time.perf_counter``, the host's monotonic clock) inside the step.
Run in a fresh process (the benchmark sets its XLA flags before JAX starts); about 30 s (two JAX start-ups and
compilations), so marked ``slow`` and ``mpi``."""
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

CODE = r"""
import argparse, json
import benchmarks.predictor_accuracy as pa
from hethub_jax.models.config import get_preset
cfg = get_preset("tiny")
args = argparse.Namespace(seq=16, steps=1, warmup=0, statistic="min", trials=1, bridge_spin_s=0.0, pin=False)
proc = pa.measure_round_processes(["pp2_1f1b_m4"], args)["pp2_1f1b_m4"]
plan, _ = pa.plan_and_batch("pp2_1f1b_m4", cfg, args.seq)
thr = pa.measure_steps(plan, cfg, args.seq, 1, 0, "min")
key = lambda recs: sorted({(r.island, r.stage, r.action) for r in recs})
print(json.dumps({"proc_actions": key(proc["records"]), "thread_actions": key(thr["records"]),
                  "steps_s": proc["steps_s"], "islands": proc["islands"], "t0": proc["t0"],
                  "span": [min(r.start_s for r in proc["records"]), max(r.end_s for r in proc["records"])],
                  "cpu_s_per_step": proc["cpu_s_per_step"], "faults_per_step": proc["faults_per_step"]}))
"""


def _mpiexec():
    exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return exe if os.path.exists(exe) else shutil.which("mpiexec")


@pytest.mark.slow
@pytest.mark.mpi
def test_islands_as_processes_match_the_threads_run():
    pytest.importorskip("mpi4py")
    if _mpiexec() is None:
        pytest.skip("no mpiexec")
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    # the reference: the threads run executes the same actions of the same plan on the same islands and stages
    assert got["proc_actions"] == got["thread_actions"]
    assert {a[0] for a in got["proc_actions"]} == {"a", "b"}
    # a step is its slowest island's
    assert got["steps_s"] == [pytest.approx(max(s for _, s in got["islands"].values()))]
    # both processes' records on the host's one monotonic clock, inside the step (1 ms of slack for the record's
    # own bookkeeping after the island's clock stops)
    start, end = got["span"]
    assert got["t0"] <= start + 1e-3
    assert end <= max(t + s for t, s in got["islands"].values()) + 1e-3
    assert got["cpu_s_per_step"] > 0 and got["faults_per_step"] >= 0


BRIDGE_CODE = r"""
import json
import benchmarks.predictor_accuracy as pa
fit = {"fit": {"c0": 1e-4, "c1": 1e-10}, "wake_s": 5e-4}
out = {}
for name, f, wake in (("wake", fit, True), ("ping_pong", fit, False), ("unmeasured", dict(fit, wake_s=None), True),
                      ("negative", {"fit": {"c0": -2e-5, "c1": 1e-10}, "wake_s": None}, True)):
    link = pa.bridge_link(f, wake)
    out[name] = [link.alpha_s, link.bandwidth, link.time_s(1e6)]
print(json.dumps(out))
"""


def test_bridge_link_by_hand():
    """``bridge_link``: alpha is the waiting receiver's measured wake-up where asked for and measured, else the
    ping-pong line's intercept (never below 0); bandwidth 1 / slope. By hand: slope 1e-10 s/byte = 10 GB/s, so
    1 MB takes alpha + 100 us. A fresh process: importing the benchmark sets process-wide allocator settings."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", BRIDGE_CODE], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["wake"] == pytest.approx([5e-4, 1e10, 5e-4 + 1e-4])
    assert got["ping_pong"] == pytest.approx([1e-4, 1e10, 2e-4])
    assert got["unmeasured"] == pytest.approx([1e-4, 1e10, 2e-4])
    assert got["negative"] == pytest.approx([0.0, 1e10, 1e-4])


def test_cpu_snapshot_counts_finished_children_when_asked():
    """``cpu_snapshot(children=True)``: a waited-for child's CPU seconds count as this process's (the profile's
    co-run neighbour process, the benchmark's island jobs), so ``others_share`` does not count them as other
    processes; without it they are not added. By hand: a child that spins for 0.3 s of CPU."""
    from hethub_jax.profile import cpu_snapshot
    before_with, before_without = cpu_snapshot(children=True)[2], cpu_snapshot()[2]
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"],
                   check=True, timeout=60)
    grew_with = cpu_snapshot(children=True)[2] - before_with
    grew_without = cpu_snapshot()[2] - before_without
    assert grew_with >= 0.29
    assert grew_without < 0.2


DRIFT_CODE = r"""
import json
import benchmarks.predictor_accuracy as pa
rows = [{"predicted_step_s": 1.0, "rounds_s": [0.9, 1.2, 1.5]}, {"predicted_step_s": 2.0, "rounds_s": [2.0, 2.0, 2.0]}]
print(json.dumps([pa.drift_scaled_mape(rows, [0.9, 1.2, 1.5]), pa.drift_scaled_mape(rows, [1.0, 1.0, 1.0]),
                  pa.drift_scaled_mape(rows, None)]))
"""


def test_drift_scaled_mape_by_hand():
    """``drift_scaled_mape``: each round's measured step divided by that round's drift, the median over rounds
    against the prediction. By hand: row 1, measured in proportion to the drift, scales to 1.0 in every round
    (APE 0); row 2 scales to 2.22, 1.67, 1.33 (median 2 / 1.2, APE (2 - 2/1.2) / (2/1.2) = 0.2): mape 0.1. Drift 1
    everywhere is the plain mape: row 1's median 1.2, APE 1/6; row 2's 0: 1/12. No drift (a given profile): None."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", DRIFT_CODE], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    scaled, plain, none = json.loads(p.stdout.strip().splitlines()[-1])
    assert scaled == pytest.approx((0.0 + (2.0 - 2.0 / 1.2) / (2.0 / 1.2)) / 2)
    assert plain == pytest.approx((1 / 6 + 0.0) / 2)
    assert none is None


SLOTS_CODE = r"""
import json
import benchmarks.predictor_accuracy as pa
print(json.dumps([pa.profile_slots(3, 3), pa.profile_slots(2, 3), pa.profile_slots(1, 3), pa.profile_slots(4, 2)]))
"""


def test_profile_slots_spread_the_profile_processes_over_the_rounds():
    """``--profile-processes N``: profile process ``j`` runs before round ``j * R // N``. By hand: 3 over 3 rounds,
    one before each; 2 over 3: before rounds 0 and 1 (2 * 3 // 2 = 3 is out, 1 * 3 // 2 = 1); 1: before round 0
    (today's order, profile then rounds); 4 over 2: two before each."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", SLOTS_CODE], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    three, two, one, four = json.loads(p.stdout.strip().splitlines()[-1])
    assert three == [[0], [1], [2]]
    assert two == [[0], [1], []]
    assert one == [[0], [], []]
    assert four == [[0, 1], [2, 3]]
