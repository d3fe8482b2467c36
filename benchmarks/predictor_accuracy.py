"""Accuracy of the performance predictor: predicted against measured step times (issue 13).

    PYTHONPATH=. python benchmarks/predictor_accuracy.py --json predictor_accuracy.json [--quick]

1. Profiles the smallest setting only: one island, one stage at a time (``hethub_jax.profile``: the
   tiny model's first / middle / last stages at a few microbatch sizes on ``(1, tp)`` and ``(dp, 1)``
   meshes; the co-run slowdown of a computation while a second island of the process computes; the
   runtime's own seconds per action; the in-process bridge, ``LocalCommunicator``), at the microbatch
   sizes of ``--profile-mbs`` and every size the configurations run (:func:`profile_sizes`: the
   predictor interpolates between profiled sizes, and the seconds per token are not constant here), and the
   whole model as one stage (``--profile-stage-shapes whole``, the default since session 19: the one-island,
   one-stage setting, which every heterogeneous-DP replica here runs; the pipelines' stages are PREDICTED from
   the fitted parts).
   ``--profile-processes N`` (N > 1): N profiles, each a fresh ``python -m hethub_jax.profile`` process at
   ``--repeats`` calls per figure, INTERLEAVED with the rounds (profile process ``j`` runs just before round
   ``j * R // N``: with N = R = 3, profile, round, profile, round, profile, round), merged into one profile whose
   every figure is the median of the N (``hethub_jax.planner.profile_merge``). ``--later-profiles compute`` (the
   default): the profiles after the first measure only the figures in absolute seconds (stage calls, updates,
   copies, all-reduces; :data:`COMPUTE_ONLY_OPTIONS`), the drift-sensitive ones; the ratios measured within one
   short window (co-run factors, in-flight factors) and the runtime's records are the first profile's. Why (session 16,
   ``benchmarks/process_luck.py``): the machine's speed moves in time (minutes) more than one process differs from
   another, and one profile made in the first minutes is one draw of it, against rounds spread over the rest of
   the run; ``figures.profile_drift`` holds each profile's canary over their median. Predictions are made after
   the rounds, from the merged profile. N = 1 (the default): one profile in this process before the rounds.
2. Predicts (``hethub_jax.planner.predictor.predict`` with that profile for every island) and measures
   at least 10 larger configurations on this machine: 2-4 pipeline stages over 2 islands, 2-8
   microbatches, fake-device DP and TP, an EMULATED slowdown, recompute on and off, GPipe and 1F1B,
   heterogeneous DP, with the real ``PipelineRuntime``; a step's time is the slowest island's.
   ``--islands processes`` (the default since session 14): each island is a PROCESS of its own, as
   ``hethub_jax.train`` runs islands under mpiexec: one ``mpiexec -n 2`` job per round
   (:func:`measure_round_processes`, :func:`measure_steps_mpi`), 4 fake CPU devices and the runtime's
   steady host allocator (one glibc arena) per process, the islands joined by the MPI host bridge
   (``MPIHostBridge``, its waits sleeping after ``--bridge-spin-s`` seconds of polling, default 0: unpinned
   on 2 cores a spinning wait takes the core the other island computes on), pinned (``--pin``, the default
   since session 20; ``--no-pin``: unpinned): island process i on core i, as ``hethub_jax.train`` pins CPU
   islands, and the profile pinned the same way (``hethub_jax.profile --pin``, :func:`profile_pinned`).
   Predicted as islands on one shared host (``DeviceCosts.on_shared_host``: the profile's measured co-run
   slowdown by the pair's size ratio; each process launches its own multi-device computations), the bridge being the MPI bridge's line
   measured between the two processes with the same spin and pinning (:func:`measure_bridge_fit`, as the
   profiler's ``fits.bridge``). The profile then measures its co-run factor beside a neighbour PROCESS
   (``python -m hethub_jax.profile --corun-neighbour process``), not a thread of its own process. Why
   processes (measured nearly quiet, docs/benchmarks.md issue 13 session 13): as threads of ONE process the islands share its one arena's lock, which slowed the first stage's
   calls 1.35-1.5x against two processes; real islands never share it, and the one-island profile does not
   see it. ``--islands threads``: one thread per island in this process joined by ``LocalCommunicator``
   (the benchmark before session 14), predicted as islands in one process (``DeviceCosts.in_process``: the
   profile's measured serial launcher of multi-device computations, ``fits.launch``, and its in-process
   bridge, ``fits.bridge_local``).
3. **Rounds against VM drift** (``--rounds R``, default 3): the same configurations measured on this VM
   a few minutes apart differ by 7-57% (docs/benchmarks.md), more than the goal. So every
   configuration is measured once per round, in ``R`` rounds whose order is rotated
   (``hethub_jax.planner.accuracy.round_orders``): a fresh runtime per configuration and round
   (``--trials`` of them), ``--warmup`` untimed steps after the compiling one, then ``--steps`` timed
   ones, their ``--statistic`` (min or median) being that round's figure. A configuration's measured
   figure is the MEDIAN over its rounds; each row records the rounds' figures and their min / median /
   max, ``spread`` (max / min: this machine's noise on it), ``within_spread`` (the prediction lies
   inside [min, max]) and ``ape_beyond_spread`` (how far outside); ``figures`` has ``mape`` (against the
   medians), ``mape_min`` (against the minima), ``max_spread``, ``median_spread``, ``within_spread``
   (how many rows), ``mape_beyond_spread``, and per round ``round_mape`` and ``round_scale`` (the
   geometric mean of measured / predicted over the configurations: a machine that drifts moves every
   configuration of a round together, a model error moves one configuration in every round).
   ``drift``: a fixed pair of calls (:func:`canary`) timed before and after the profile and at the start
   of every round, round / profile: the machine's own change of speed between the profile and each
   round (the rounds cannot show that one; a ``drift`` of 1.3 with every row 30% low is the machine).
   The figures are NOT scaled by it (the canary's own spread on a quiet machine is as large as the drift, session
   15); ``drift_scaled_mape`` (:func:`drift_scaled_mape`) is the mape had they been, printed beside.
   ``--breakdown`` lays each configuration's measured step (of its median round) beside its predicted
   timeline per island, stage and action kind (``hethub_jax.planner.accuracy.action_breakdown``).
   Each row also records the host's minor page faults per timed step (``faults_per_step``, from
   ``getrusage``: a count, not a time, so the same on a loaded machine).
4. ``figures`` also holds ``max_ape`` and the same for a BASELINE in the same run: the catalog's ``cpu``
   entry at its stated efficiency instead of the profile.
   ``without_cold_mape`` (and per row ``without_cold_ape``): the same profile's prediction without its
   measured cold-call extras (``fits.cold``, the model before session 10), for a before/after in the
   same run; ``without_action_costs_mape`` (``without_action_costs_ape``): without its measured SEND /
   RECV / fused-B records, gaps and emulated-wait lateness (``fits.actions``, ``fits.emulated_wait``,
   the model before session 11). ``fitted_lines_mape`` / ``without_update_pair_mape`` (per row
   ``fitted_lines_ape``, ``without_update_pair_ape``): without session 12's terms, one at a time (the
   fitted lines between profiled microbatch sizes instead of the measured calls, ``DeviceCosts.token_parts``;
   the tail's co-run at the stage-call factor instead of the measured update pair); the pipelines' OTHER
   co-run model than the one in use (``hethub_jax.planner.costs.CORUN_BY_SIZE_DEFAULT`` decides per island
   kind): the model in use is the one measured factor ``fits.corun.factor`` for both island kinds (the
   measured slowdown by the pair's size ratio, ``fits.corun.relation``, was the processes' default for part
   of session 15 and lost two quiet runs of two) and ``size_ratio_corun_mape`` (``size_ratio_corun_ape``)
   is the relation; where the table makes the relation the model, ``one_factor_corun_mape`` is the factor.
   ``without_in_flight_mape`` (``without_in_flight_ape``): without session 13's measured factor of a
   call with microbatches in flight (``fits.in_flight``, ``DeviceCosts.in_flight_factor``).
   ``ping_pong_bridge_mape`` (``ping_pong_bridge_ape``; islands as processes): the bridge's latency from the
   ping-pong line instead of a waiting receiver's measured wake-up (:func:`bridge_link`, session 14).
   ``ring_bridge_allreduce_mape`` (``ring_bridge_allreduce_ape``; islands as processes): the islands' sum of the
   shared gradients by the ring formula over the bridge's point-to-point line instead of the bridge's all-reduce
   measured as the runtime calls it (:func:`bridge_allreduce_samples`, ``DeviceCosts.bridge_allreduce_fit``;
   session 15). ``parts_with_shapes_mape`` (``parts_with_shapes_ape``; profiles with ``--profile-stage-shapes``):
   the parts of a stage (base, layer, embedding, LM head) fitted by least squares over the four profiled stage
   kinds AND the measured whole stages instead of solved exactly from the four kinds
   (``planner.costs._token_parts(with_shapes=True)``, session 20).

The host allocator (``--host-allocator``, default ``steady``, ``hethub_jax.host_allocator``): glibc
settings under which XLA:CPU's large buffers are not mmapped and unmapped on every call, in ONE arena; the
runtime sets them for CPU islands, and the profile is made under the same settings; each island process
has its own. With ``--islands threads`` one arena makes the islands wait on its lock, which islands in
processes of their own never share; ``steady-arenas`` (:func:`arenas_per_thread`, threads only): the same
settings with glibc's own arena count: no shared lock, but the threads' own arenas fault their large blocks in
again (up to 37,000 minor faults per step at microbatch 4). ``default`` leaves glibc's own (for A/B runs).

Duration (measured, session 9, with ``--statistic min --profile-tp 1,2 --profile-mbs 1,4 --steps 3
--rounds 3``): 322 s at load 0.7-2.6 (profile 91 s, 11 configurations x 3 rounds 231 s, about 7 s per
configuration and round, compilation included), 532 s at load 2.4-4.5; the default ``--profile-mbs
1,2,4`` profiles one more microbatch size (about a third more profile time).

XLA runs one compute thread per computation (``--xla_cpu_multi_thread_eigen=false``) so that two
islands on two cores do not fight over one thread pool; 8 fake CPU devices, 4 per island.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import resource
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_cpu_multi_thread_eigen" not in _flags:
    _flags += " --xla_cpu_multi_thread_eigen=false"
os.environ["XLA_FLAGS"] = _flags.strip()
# the steady host allocator (one arena: M_ARENA_MAX takes effect for threads that have not allocated yet)
# before numpy and JAX start their threads; ``--host-allocator default`` puts glibc's settings back in main()
from hethub_jax import host_allocator as _host_allocator  # noqa: E402  (ctypes only)
_host_allocator.steady_host_allocator()

from benchmarks.common import command_line, loadavg, machine, median, write_json  # noqa: E402
from hethub_jax.planner.accuracy import (action_breakdown, format_breakdown, round_orders,  # noqa: E402
                                        spread_summary)
from hethub_jax.profile import cpu_snapshot, others_share  # noqa: E402

DEVICES_PER_ISLAND = 4


def islands(slow_b: float = 1.0) -> list:
    return [{"name": "a", "platform": "cpu", "devices_per_process": DEVICES_PER_ISLAND},
            {"name": "b", "platform": "cpu", "devices_per_process": DEVICES_PER_ISLAND, "slowdown": slow_b}]


def st(island, lo, hi, dp=1, tp=1):
    return {"island": island, "first_layer": lo, "last_layer": hi, "dp": dp, "tp": tp}


def configs() -> dict:
    """name -> plan dict (tiny model: 6 layers)."""
    pp2 = [st("a", 0, 2), st("b", 3, 5)]
    return {
        "pp2_1f1b_m4": {"islands": islands(), "stages": pp2, "global_batch_size": 4, "microbatch_size": 1},
        "pp2_slow2_1f1b_m4": {"islands": islands(2.0), "stages": pp2, "global_batch_size": 4, "microbatch_size": 1},
        "hetero_dp_slow2": {"islands": islands(2.0), "replicas": [
            {"stages": [st("a", 0, 5)], "throughput": 2.0}, {"stages": [st("b", 0, 5)], "throughput": 1.0}],
            "global_batch_size": 6, "microbatch_size": 1},
        "pp2_gpipe_m4": {"islands": islands(), "stages": pp2, "global_batch_size": 4, "microbatch_size": 1,
                         "schedule": "gpipe"},
        "pp2_recompute_1f1b_m4": {"islands": islands(), "stages": pp2, "global_batch_size": 4,
                                  "microbatch_size": 1, "recompute": "full"},
        "pp2_1f1b_m8_mb2": {"islands": islands(), "stages": pp2, "global_batch_size": 16, "microbatch_size": 2},
        "pp4_2islands_1f1b_m4": {"islands": islands(), "stages": [st("a", 0, 1), st("a", 2, 2), st("b", 3, 4),
                                                                  st("b", 5, 5)],
                                 "global_batch_size": 4, "microbatch_size": 1},
        "pp3_gpipe_m2_recompute": {"islands": islands(), "stages": [st("a", 0, 1), st("a", 2, 3), st("b", 4, 5)],
                                   "global_batch_size": 2, "microbatch_size": 1, "schedule": "gpipe",
                                   "recompute": "full"},
        "pp2_dp2_1f1b_m4": {"islands": islands(), "stages": [st("a", 0, 2, dp=2), st("b", 3, 5, dp=2)],
                            "global_batch_size": 8, "microbatch_size": 2},
        "pp2_tp2_1f1b_m4": {"islands": islands(), "stages": [st("a", 0, 2, tp=2), st("b", 3, 5, tp=2)],
                            "global_batch_size": 4, "microbatch_size": 1},
        "pp2_1f1b_m2_mb4": {"islands": islands(), "stages": pp2, "global_batch_size": 8, "microbatch_size": 4},
    }


def plan_and_batch(name: str, cfg, seq: int) -> tuple:
    """``(plan, batch)`` for configuration ``name`` of :func:`configs` on model ``cfg``: the validated
    ``Plan`` and a seeded random global batch (``tokens``/``targets`` ``[global_batch, seq]`` int32,
    ``loss_mask`` float32 ones), as the diagnostics ``action_split.py`` and ``tail_split.py`` run it."""
    import numpy as np

    from hethub_jax.parallel.plan import Plan
    plan = Plan.from_dict(configs()[name]).validate(cfg)
    gbs, rng = plan.global_batch_size, np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab_size, (gbs, seq), dtype=np.int32),
             "targets": rng.integers(0, cfg.vocab_size, (gbs, seq), dtype=np.int32),
             "loss_mask": np.ones((gbs, seq), np.float32)}
    return plan, batch


def measure(plan, cfg, seq: int, steps: int, warmup: int, statistic: str = "median") -> float:
    """Median (or minimum) over timed steps of the slowest island's step time (seconds), one thread
    per island."""
    return measure_steps(plan, cfg, seq, steps, warmup, statistic)["statistic_s"]


def measure_steps(plan, cfg, seq: int, steps: int, warmup: int, statistic: str = "median") -> dict:
    """One trial: a fresh ``PipelineRuntime`` per island (one thread each), ``warmup`` untimed steps
    after the compiling one, then ``steps`` timed ones. Returns ``{"statistic_s"`` (median or minimum
    over the timed steps of the slowest island's step time), ``"steps_s"`` (every timed step's
    slowest island, seconds), ``"records"`` (the measured ``ActionRecord``s of the step that gave
    ``statistic_s``, or of the median step), ``"t0"`` (that step's start, ``perf_counter`` seconds),
    ``"islands"`` (that step's ``(start, seconds)`` per island name), ``"faults_per_step"`` (the
    process's minor page faults over the timed steps / steps, ``getrusage``)}``."""
    import jax
    import numpy as np

    from hethub_jax.comm import LocalCommunicator
    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel.runtime import PipelineRuntime
    n = len(plan.islands)
    comms = LocalCommunicator.create(n, timeout=600)
    rng = np.random.default_rng(0)
    gbs = plan.global_batch_size
    batch = {"tokens": rng.integers(0, cfg.vocab_size, (gbs, seq), dtype=np.int32),
             "targets": rng.integers(0, cfg.vocab_size, (gbs, seq), dtype=np.int32),
             "loss_mask": np.ones((gbs, seq), np.float32)}
    devs = jax.devices()
    barrier = threading.Barrier(n)
    runs = [[None] * n for _ in range(1 + warmup + steps)]  # (start, step seconds, records) per island
    errors = []

    def body(rank, count_faults):
        try:
            rt = PipelineRuntime(plan, cfg, OptimConfig(), seed=0, comm=comms[rank], rank=rank,
                                 devices=devs[rank * DEVICES_PER_ISLAND:(rank + 1) * DEVICES_PER_ISLAND])
            for i in range(len(runs)):
                barrier.wait()
                count_faults(i)
                t0 = time.perf_counter()
                res = rt.train_step(batch)
                runs[i][rank] = (t0, res.step_time_s, res.records)
        except BaseException as e:  # noqa: BLE001 -- reported after the join
            errors.append(e)
            barrier.abort()
    faults = {}  # minor page faults of the whole process when the first island starts steps (index)

    def count_faults(i):
        faults.setdefault(i, resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    threads = [threading.Thread(target=body, args=(r, count_faults)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    count_faults(len(runs))
    timed = runs[1 + warmup:]
    steps_s = [max(x[1] for x in row) for row in timed]
    order = sorted(range(len(timed)), key=steps_s.__getitem__)
    pick = order[0] if statistic == "min" else order[(len(order) - 1) // 2]
    return {"statistic_s": min(steps_s) if statistic == "min" else median(steps_s), "steps_s": steps_s,
            "faults_per_step": (faults[len(runs)] - faults[1 + warmup]) / max(1, steps),
            "records": [r for x in timed[pick] for r in x[2]], "t0": min(x[0] for x in timed[pick]),
            "islands": {plan.islands[i].name: (x[0], x[1]) for i, x in enumerate(timed[pick])}}


def _rusage() -> tuple:
    """``(CPU seconds user + system, minor page faults, voluntary context switches)`` of this process."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt, r.ru_nvcsw


def _sleeping_barrier(world) -> None:
    """A barrier of the MPI communicator ``world`` whose wait sleeps between tests (``MPI_Ibarrier`` polled with
    ``poll_until(spin_s=0)``: back-off 10 us to 1 ms): MPICH's blocking ``MPI_Barrier`` polls without sleeping, which
    on 2 shared cores would take a core from the island still finishing its step. Then a blocking ``MPI_Barrier``:
    the ranks arrive at it within one back-off sleep (at most 1 ms) of each other, so it spins at most that long and
    releases them together (the sleeping barrier alone releases them up to 1 ms apart, which the later starter's
    neighbour would count in its step)."""
    from hethub_jax.comm.base import poll_until
    req = world.Ibarrier()
    poll_until(req.Test, time.monotonic() + 600, lambda: "barrier between steps", spin_s=0.0)
    world.Barrier()


def measure_steps_mpi(plan, cfg, seq: int, steps: int, warmup: int, statistic: str = "median",
                      spin_s: float = 0.05, all_records: bool = False) -> dict | None:
    """:func:`measure_steps` with the islands as PROCESSES: run under ``mpiexec -n len(plan.islands)``, this
    rank runs island ``rank`` (a fresh ``PipelineRuntime`` on this process's first 4 devices), the islands
    joined by the MPI host bridge (``MPIHostBridge`` over a duplicate of ``MPI.COMM_WORLD``, its waits polling
    without sleeping for ``spin_s`` seconds, then sleeping: ``hethub_jax.comm.base.poll_until``), as
    ``hethub_jax.train`` runs islands. Every step starts after a barrier that sleeps while it waits
    (:func:`_sleeping_barrier`). Returns, on rank 0, :func:`measure_steps`'s dict (every island's records
    gathered; ``perf_counter`` is the system's monotonic clock, shared by the processes of one host) plus
    ``"cpu_s_per_step"``, ``"faults_per_step"`` and ``"voluntary_switches_per_step"`` summed over the island
    processes (``getrusage``: counts, comparable on a loaded machine) and ``"others_cpu_share"`` (CPU used by
    processes outside the job meanwhile, :func:`hethub_jax.profile.others_share` with the ranks' ids), with
    ``all_records`` also ``"steps_records"`` (every timed step's records, all islands); None on the other ranks.

    Raises:
      SystemExit: if the job's size is not the plan's island count.
    """
    import jax
    import numpy as np
    from mpi4py import MPI

    from hethub_jax.comm.mpi import MPIHostBridge
    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel.runtime import PipelineRuntime
    world = MPI.COMM_WORLD
    n, rank = len(plan.islands), world.Get_rank()
    if world.Get_size() != n:
        raise SystemExit(f"islands as processes: {n} islands need mpiexec -n {n}, not {world.Get_size()}")
    pids = world.allgather(os.getpid())
    rng = np.random.default_rng(0)
    gbs = plan.global_batch_size
    batch = {"tokens": rng.integers(0, cfg.vocab_size, (gbs, seq), dtype=np.int32),
             "targets": rng.integers(0, cfg.vocab_size, (gbs, seq), dtype=np.int32),
             "loss_mask": np.ones((gbs, seq), np.float32)}
    bridge = MPIHostBridge(world.Dup(), timeout=600).with_spin(spin_s)
    rt = PipelineRuntime(plan, cfg, OptimConfig(), seed=0, comm=bridge, rank=rank,
                         devices=jax.devices()[:DEVICES_PER_ISLAND])
    mine, snap = [], None
    for i in range(1 + warmup + steps):
        _sleeping_barrier(world)
        if i == 1 + warmup:
            c0, snap = _rusage(), cpu_snapshot(pids)
        t0 = time.perf_counter()
        res = rt.train_step(batch)
        mine.append((t0, res.step_time_s, res.records))
    _sleeping_barrier(world)
    c1, snap1 = _rusage(), cpu_snapshot(pids)
    both = world.gather((mine[1 + warmup:], [b - a for a, b in zip(c0, c1)]), root=0)
    if rank != 0:
        return None
    timed = [list(x) for x in zip(*(b[0] for b in both))]  # per timed step: (start, seconds, records) per island
    steps_s = [max(x[1] for x in row) for row in timed]
    order = sorted(range(len(timed)), key=steps_s.__getitem__)
    pick = order[0] if statistic == "min" else order[(len(order) - 1) // 2]
    cpu, faults, vcsw = (sum(b[1][j] for b in both) / max(1, steps) for j in range(3))
    return {"statistic_s": min(steps_s) if statistic == "min" else median(steps_s), "steps_s": steps_s,
            "faults_per_step": faults, "cpu_s_per_step": cpu, "voluntary_switches_per_step": vcsw,
            "others_cpu_share": others_share(snap, snap1),
            "records": [r for x in timed[pick] for r in x[2]], "t0": min(x[0] for x in timed[pick]),
            "islands": {plan.islands[i].name: (x[0], x[1]) for i, x in enumerate(timed[pick])},
            **({"steps_records": [[r for x in row for r in x[2]] for row in timed]} if all_records else {})}


#: where a child job (``--child SPEC``, under mpiexec) finds its islands' settings
CHILD_SPEC_KEYS = ("names", "seq", "steps", "warmup", "statistic", "trials", "spin_s", "pin", "out")


def _child_spec_and_rank(spec_path: str) -> tuple:
    """A child of ``mpiexec -n 2``: ``(spec, rank)``, the JSON spec at ``spec_path`` and this process's MPI rank
    (``PMI_RANK``); pins this rank to core ``rank`` (mod the usable cores) when the spec's ``pin`` is set, before
    JAX starts."""
    with open(spec_path) as f:
        spec = json.load(f)
    rank = int(os.environ.get("PMI_RANK", "0"))
    if spec["pin"] and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    return spec, rank


def child_main(spec_path: str) -> None:
    """One round of the islands as processes (run by :func:`measure_round_processes` under ``mpiexec -n 2``):
    reads the JSON spec (:data:`CHILD_SPEC_KEYS`), pins this rank to core ``rank`` if ``pin`` (before JAX
    starts), measures every configuration of ``names`` in that order, ``trials`` fresh runtimes each
    (:func:`measure_steps_mpi`, the one with the smallest statistic kept), and rank 0 pickles
    ``{name: dict}`` to ``out``."""
    import pickle
    spec, rank = _child_spec_and_rank(spec_path)
    from hethub_jax.models.config import get_preset
    cfg = get_preset("tiny")
    out = {}
    for name in spec["names"]:
        plan, _ = plan_and_batch(name, cfg, spec["seq"])
        trials = [measure_steps_mpi(plan, cfg, spec["seq"], spec["steps"], spec["warmup"], spec["statistic"],
                                    spec["spin_s"]) for _ in range(spec["trials"])]
        if trials[0] is not None:
            best = dict(min(trials, key=lambda t: t["statistic_s"]))
            best.update(trials_statistic_s=[t["statistic_s"] for t in trials], loadavg=loadavg())
            out[name] = best
    if rank == 0:
        with open(spec["out"], "wb") as f:
            pickle.dump(out, f)


#: message sizes of the bridge's fit (bytes): the profiler's (1 KiB, 64 KiB, 1 MiB) and 8 MiB (the tiny model's tied
#: embedding gradient sum between islands is 8 MB)
BRIDGE_SIZES = (1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def bridge_child_main(spec_path: str) -> None:
    """Under ``mpiexec -n 2``: the MPI host bridge's round trips between the two processes
    (``hethub_jax.profile.measure_bridge`` at :data:`BRIDGE_SIZES`, the spec's ``spin_s`` and ``repeats``, pinned
    as the islands when ``pin``); rank 0 writes the samples (JSON list) to the spec's ``out``."""
    spec, rank = _child_spec_and_rank(spec_path)
    from hethub_jax import profile
    samples = profile.measure_bridge(list(BRIDGE_SIZES), spec["repeats"], spec["spin_s"])
    wake = bridge_wake_lateness(spec["spin_s"], max(spec["repeats"], 15))
    allreduce = bridge_allreduce_samples(spec["spin_s"], max(spec["repeats"], 7))
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump({"samples": samples, "wake_s": wake, "allreduce_samples": allreduce}, f)


#: float32 bytes of the bridge's all-reduce fit (:func:`bridge_allreduce_samples`): 64 KiB, 1 MiB and the tiny
#: model's tied embedding (32000 x 64 float32 = 8,192,000 bytes), which the islands sum over the bridge every step
ALLREDUCE_SIZES = (64 * 1024, 1024 * 1024, 8_192_000)


def bridge_allreduce_samples(spin_s: float, repeats: int) -> list | None:
    """Under ``mpiexec -n 2``: the MPI host bridge's all-reduce as the runtime calls it for the shared gradients
    (``PipelineRuntime._reduce_shared``: ``allreduce_tree`` of a dict of float32 host arrays, op sum) at
    :data:`ALLREDUCE_SIZES`, both ranks entering together (after a blocking barrier), the bridge's waits polling
    without sleeping for ``spin_s``; per size the median over ``repeats`` (one untimed first) of the slower rank's
    seconds. Returns ``[{"kind": "bridge_allreduce", "bytes", "seconds"}, ...]`` on rank 0, None on rank 1. Why
    (docs/benchmarks.md, issue 13, session 15): the predictor's ring formula over the ping-pong line
    (``2 alpha + bytes / bandwidth`` for two islands) is about 1.7 ms at 8.2 MB, while the all-reduce took 6.6x one
    transfer of the same bytes on this bridge."""
    from mpi4py import MPI

    from hethub_jax.profile import measure_bridge_allreduce  # the profiler's measurement (fits.bridge_allreduce)
    out = measure_bridge_allreduce(ALLREDUCE_SIZES, repeats, spin_s)
    return out if MPI.COMM_WORLD.Get_rank() == 0 else None


#: seconds the receiver has been waiting when the message is sent (:func:`bridge_wake_lateness`): longer than the
#: sleeping wait's back-off ramp (10 us doubling to 1 ms: about 2 ms, ``hethub_jax.comm.base.poll_until``), as a
#: pipeline stage waits for its neighbour's activations or gradients
WAKE_WAIT_S = 0.005


def bridge_wake_lateness(spin_s: float, repeats: int) -> float | None:
    """Under ``mpiexec -n 2``: median seconds from rank 1's send of a 1 KiB message over ``MPIHostBridge`` (waits
    polling without sleeping for ``spin_s``) to rank 0 holding it, rank 0 having waited :data:`WAKE_WAIT_S` for it
    as the runtime's pipeline waits for a message from another process (``PipelineRuntime``'s ``_StepExecutor``:
    the receive posted with ``irecv``, its handle's ``test()`` between sleeps of :data:`RUNTIME_IDLE_SLEEP_S` while no
    stage can advance, then ``wait()``); rank 1 sleeps that long after a barrier, then stamps and sends; both read
    ``time.perf_counter``, the host's one monotonic clock. Why: a ping-pong (``fits.bridge``) times receivers that wait
    about one message time, but in a pipeline the receiver on the critical path has waited a whole computation and
    notices the message only at its next test. None on rank 1."""
    import numpy as np
    from mpi4py import MPI

    from hethub_jax.comm.mpi import MPIHostBridge
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    br = MPIHostBridge(world.Dup(), timeout=120).with_spin(spin_s)
    buf, late = np.zeros(256, np.float32), []
    for _ in range(repeats + 1):  # the first is untimed
        world.Barrier()
        if rank == 1:
            time.sleep(WAKE_WAIT_S)
            t = time.perf_counter()
            br.send(buf, 0, 3)
            world.send(t, 0, 4)
        else:
            h = br.irecv(1, 3, out=buf)
            while not h.test():
                time.sleep(RUNTIME_IDLE_SLEEP_S)
            h.wait()
            t1 = time.perf_counter()
            late.append(t1 - world.recv(source=1, tag=4))
    return median(late[1:]) if rank == 0 else None


#: seconds the runtime's pipeline sleeps between tests of its receives while no stage can advance
#: (``hethub_jax.parallel.runtime._StepExecutor._wait``: ``time.sleep(0.0002)``)
RUNTIME_IDLE_SLEEP_S = 0.0002


def _run_child(flag: str, spec: dict, what: str) -> None:
    """``mpiexec -n 2 python predictor_accuracy.py FLAG SPEC`` with ``spec`` written as JSON beside ``spec["out"]``
    (4 fake CPU devices per process, the repository on PYTHONPATH).

    Raises:
      SystemExit: if no mpiexec is found.
      RuntimeError: if the job fails (its exit status; its output is on this process's stdout / stderr).
    """
    import shutil
    import subprocess
    exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = exe if os.path.exists(exe) else shutil.which("mpiexec")
    if exe is None:
        raise SystemExit("islands as processes need mpiexec (next to the Python executable or on PATH)")
    path = os.path.join(os.path.dirname(spec["out"]), "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS=" ".join([f for f in os.environ.get("XLA_FLAGS", "").split()
                                   if "xla_force_host_platform_device_count" not in f]
                                  + [f"--xla_force_host_platform_device_count={DEVICES_PER_ISLAND}"]))
    rc = subprocess.call([exe, "-n", "2", sys.executable, os.path.abspath(__file__), flag, path], env=env)
    if rc != 0:
        raise RuntimeError(f"{what} (mpiexec -n 2) exited with {rc}")


def measure_bridge_fit(args) -> dict:
    """The MPI host bridge between two island processes, measured (:func:`bridge_child_main`) and fitted as the
    profiler fits ``fits.bridge`` (``hethub_jax.profile.fit_line``: ``c0 + c1 x bytes``). Returns
    ``{"fit": {"c0", "c1"}, "samples": [...], "wake_s", "spin_s", "pin", "allreduce_fit": {"c0", "c1"},
    "allreduce_samples": [...]}`` (the all-reduce: :func:`bridge_allreduce_samples`, fitted the same way)."""
    import shutil

    from hethub_jax.profile import fit_line
    d = tempfile.mkdtemp(prefix="hethub-acc-bridge-")
    out = os.path.join(d, "bridge.json")
    _run_child("--child-bridge", {"repeats": args.repeats, "spin_s": args.bridge_spin_s, "pin": args.pin,
                                  "out": out}, "the bridge's measurement")
    with open(out) as f:
        got = json.load(f)
    shutil.rmtree(d, ignore_errors=True)
    samples, ar = got["samples"], got.get("allreduce_samples") or []
    return {"fit": fit_line([s["bytes"] for s in samples], [s["seconds"] for s in samples]), "samples": samples,
            "wake_s": got["wake_s"], "spin_s": args.bridge_spin_s, "pin": args.pin,
            # the all-reduce of the shared gradients as the runtime calls it (DeviceCosts.bridge_allreduce_fit)
            "allreduce_fit": fit_line([s["bytes"] for s in ar], [s["seconds"] for s in ar]) if len(ar) > 1 else None,
            "allreduce_samples": ar}


def bridge_link(fit: dict, wake: bool = True):
    """The pipeline's bridge between island processes from :func:`measure_bridge_fit`'s dict: ``LinkModel(alpha,
    1 / c1)`` of the ping-pong line ``c0 + c1 x bytes``, with ``alpha`` the measured wake-up lateness of a receiver
    that waited (``wake_s``, :func:`bridge_wake_lateness`) where ``wake`` and it was measured, else ``c0`` (both at
    least 0). Why: the transfers that lengthen a step are those a waiting stage receives."""
    from hethub_jax.planner.costs import LinkModel
    c0, c1 = fit["fit"]["c0"], fit["fit"]["c1"]
    alpha = fit["wake_s"] if wake and fit.get("wake_s") is not None else c0
    return LinkModel(max(0.0, alpha), 1.0 / max(c1, 1e-15))


def measure_round_processes(names: list, args) -> dict:
    """One round of the configurations ``names`` (in that order) with the islands as processes: one job
    ``mpiexec -n 2 python predictor_accuracy.py --child SPEC`` (:func:`child_main`; 4 fake CPU devices per
    process, one XLA compute thread per computation, the steady host allocator of one arena per process as
    the runtime sets it), ``--trials`` fresh runtimes per configuration. Returns ``{name: dict}``
    (:func:`measure_steps_mpi`'s, plus ``"trials_statistic_s"`` and ``"loadavg"``).

    Raises:
      RuntimeError: if the job fails.
    """
    import pickle
    import shutil
    d = tempfile.mkdtemp(prefix="hethub-acc-round-")
    spec = {"names": list(names), "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "statistic": args.statistic, "trials": args.trials, "spin_s": args.bridge_spin_s,
            "pin": args.pin, "out": os.path.join(d, "round.pkl")}
    _run_child("--child", spec, f"the islands' job (configurations {', '.join(names)})")
    with open(spec["out"], "rb") as f:
        out = pickle.load(f)
    shutil.rmtree(d, ignore_errors=True)
    return out


def arenas_per_thread() -> dict:
    """Sets glibc's ``M_ARENA_MAX`` back to its own default (8 per core) after the steady settings, so that this
    process's threads (the islands' and XLA's) allocate from arenas of their own again, as islands that are
    processes of their own do. Why (measured nearly quiet, docs/benchmarks.md issue 13, session 13): with one
    arena for the whole process the first stage's calls of the two-island pipeline took 1.35-1.5x their time
    with 16 arenas or with the islands as two processes, with 1.6-1.7x the voluntary context switches per step
    (the arena's lock); the cost: minor page faults come back on some rows (up to ~5,500 per step).
    Returns ``{"allocator": "steady-arenas", "arena_max": n}``, or ``{"arena_max": None}`` where ``mallopt``
    is not available or refused."""
    from hethub_jax import host_allocator
    lib = host_allocator._libc()
    n = host_allocator._default_arena_max()
    if lib is None or lib.mallopt(host_allocator.M_ARENA_MAX, n) != 1:
        return {"arena_max": None}
    return {"allocator": "steady-arenas", "arena_max": n}


_CANARY = {}


def canary(cfg, args) -> float:
    """Seconds of two fixed stage calls on one fake device, alone (``hethub_jax.profile.measure_stage``:
    a first stage's (layer 0) B and a last stage's (last layer) fused F+B, one sample, ``--repeats``
    calls each, the ``--statistic``), summed: a yardstick of the machine's speed, timed before and after
    the profile and at the start of every round. Its ratio round / profile (``figures.drift``) says how
    much faster or slower the machine ran the same calls when a round was measured than when the
    profile was made: VM drift between the two, which the rounds' spread alone cannot show."""
    import jax

    from hethub_jax import profile
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    profile.STATISTIC["name"] = args.statistic
    if not _CANARY:
        tx, L, dev = make_optimizer(OptimConfig()), cfg.num_hidden_layers, jax.devices()[0]
        _CANARY["stages"] = [PipelineStage(cfg, a, a, [dev], 1, 1, seed=0, recompute=False, optimizer=tx)
                             for a in (0, L - 1)]
    first, last = _CANARY["stages"]
    return (profile.measure_stage(first, cfg, 1, args.seq, args.repeats)["B"]
            + profile.measure_stage(last, cfg, 1, args.seq, args.repeats)["B_recompute"])


def profile_sizes(names, given: str) -> tuple:
    """``(microbatch sizes, DP microbatch sizes per rank)`` to profile, comma-separated: ``given``
    (``--profile-mbs``) and every size the configurations ``names`` run, per DP rank (a stage on a
    ``(dp, 1)`` mesh runs ``microbatch_size / dp`` per rank, profiled on that mesh). Why: between two
    profiled sizes the predictor interpolates the profile's measured calls linearly
    (``DeviceCosts.token_parts``), and on this CPU the seconds per token are not constant (microbatch 2
    measured about 0.9x the straight line between 1 and 4; docs/benchmarks.md, issue 13, session 12)."""
    base = {int(x) for x in given.split(",") if x.strip()}
    mbs, dp_mbs = set(base), set(base)
    for n in names:
        d = configs()[n]
        stages = d.get("stages") or [s for r in d["replicas"] for s in r["stages"]]
        for s in stages:
            (dp_mbs if s.get("dp", 1) > 1 else mbs).add(d["microbatch_size"] // s.get("dp", 1))
    fmt = lambda xs: ",".join(str(x) for x in sorted(xs))
    return fmt(mbs), fmt(dp_mbs)


def stage_shapes_arg(spec: str, num_layers: int) -> str:
    """``hethub_jax.profile --stage-shapes`` of ``--profile-stage-shapes spec``: ``"whole"`` -> ``"0-{L-1}"`` (the
    whole model of ``num_layers`` layers), ``"none"`` or ``""`` -> ``""`` (fitted lines only), else ``spec`` as
    given (validated by the profiler).

    Why the whole model by default (session 19, docs/benchmarks.md issue 13): a one-stage replica's fused forward +
    backward PREDICTED from the fitted parts (embedding + layers + LM head, each measured in a stage of its own) was
    33.9 ms at microbatch 1 against 28-29 ms measured alone as one call (``benchmarks/corun_cores.py`` on the tiny
    model): the tied embedding's one gradient buffer and the fusion across parts of one call, which stages of one
    part each do not have. The whole model is the "one island, one stage" setting the issue profiles; the pipelines'
    stages are still predicted from the parts."""
    if spec in ("none", ""):
        return ""
    return f"0-{num_layers - 1}" if spec == "whole" else spec


def profile_argv(args, names, path: str) -> list:
    """The ``hethub_jax.profile`` arguments of this run's profile, written to ``path`` (with ``--stage-shapes``
    when ``--profile-stage-shapes`` asks for any, :func:`stage_shapes_arg`)."""
    from hethub_jax.models.config import get_preset
    mbs, dp_mbs = profile_sizes(names or list(configs()), args.profile_mbs)
    shapes = stage_shapes_arg(getattr(args, "profile_stage_shapes", "whole"), get_preset("tiny").num_hidden_layers)
    if mbs != ",".join(str(x) for x in sorted(int(v) for v in args.profile_mbs.split(","))):
        print(f"profile: microbatch sizes {mbs} (--profile-mbs {args.profile_mbs} and the configurations' own), "
              f"per DP rank on (dp, 1) meshes {dp_mbs}", flush=True)
    # islands as processes: the co-run neighbour is a process of its own too (fits.corun.neighbour_kind)
    return ["--out", path, "--seq-len", str(args.seq), "--tp", args.profile_tp,
            "--microbatch-sizes", mbs, "--dp-microbatch-sizes", dp_mbs, "--dp", args.profile_dp,
            "--repeats", str(args.repeats), "--statistic", args.statistic,
            "--corun-neighbour", "process" if getattr(args, "islands", "threads") == "processes" else "thread",
            *(("--stage-shapes", shapes) if shapes else ()), *(("--pin",) if profile_pinned(args) else ())]


def profile_pinned(args) -> bool:
    """Whether this run's profile is pinned (``hethub_jax.profile --pin``): with ``--pin`` and islands as processes,
    whose rounds pin island process ``i`` to core ``i``, the profile times every call on one core too and measures
    the co-run of two pinned cores. Why (session 19, docs/benchmarks.md issue 13): an UNPINNED call alone used
    ~1.5 cores (29.1 ms wall, 41.4 ms CPU), so the unpinned profile's alone seconds and its co-run factor (1.72-1.84,
    a call losing the second core) were not what a pinned island sees (x1.11 beside a pinned neighbour)."""
    return bool(getattr(args, "pin", False) and getattr(args, "islands", "threads") == "processes")


def run_profile(args, names=None) -> str:
    from hethub_jax import profile
    path = args.profile or os.path.join(tempfile.mkdtemp(prefix="hethub-profile-"), "cpu.json")
    if not (args.profile and os.path.exists(args.profile)):
        if profile_pinned(args):  # in a process of its own: pinning this one would pin the rounds' launcher too
            return run_profile_process(args, names, path)
        profile.main(profile_argv(args, names, path))
    return path


#: the profiler's options of a profile process after the first with ``--later-profiles compute``: no co-run
#: measurements, no runtime measurements (its ratios and per-action records come from the first profile)
COMPUTE_ONLY_OPTIONS = ("--corun", "off", "--no-runtime")


def run_profile_process(args, names, path: str, compute_only: bool = False) -> str:
    """One profile in a fresh process (``python -m hethub_jax.profile``, this process's environment: the XLA
    flags and host allocator setting set at import), written to ``path``; ``compute_only``: with
    :data:`COMPUTE_ONLY_OPTIONS` (the stage calls, updates, copies and all-reduces only). Each compiles its own
    executables, as the rounds' processes do: NOT from JAX's persistent compilation cache, although about 90% of a
    profile's CPU seconds are compilation, because calls of executables loaded from that cache ran 5-10% faster in
    CPU seconds than the same calls compiled in the process, 8 rounds of 8 (``benchmarks/process_luck.py
    --cache-dir``, docs/benchmarks.md issue 13 session 16): a profile made so would not be the rounds' speed.

    Raises:
      RuntimeError: if the profiler fails."""
    import subprocess
    cmd = [sys.executable, "-m", "hethub_jax.profile", *profile_argv(args, names, path), "--no-progress",
           *(COMPUTE_ONLY_OPTIONS if compute_only else ())]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if subprocess.run(cmd, cwd=ROOT, env=env).returncode:
        raise RuntimeError(f"profile process failed: {' '.join(cmd)}")
    return path


def profile_slots(processes: int, rounds: int) -> list:
    """For each round, the profile processes (0-based) run just before it: process ``j`` before round
    ``j * rounds // processes`` (spread evenly over the rounds; with ``processes == rounds`` one before each)."""
    slots = [[] for _ in range(rounds)]
    for j in range(processes):
        slots[j * rounds // processes].append(j)
    return slots


def predict_row(name: str, cfg, costs, base, bridge, args, ping_pong_bridge=None) -> tuple:
    """(plan, prediction with the profile, prediction with the catalog baseline, prediction with the
    profile without its cold-call extras: the model before session 10, prediction with the profile
    without its measured action records and emulated-wait lateness (``fits.actions``,
    ``fits.emulated_wait``: the model before session 11)) of configuration ``name``."""
    from dataclasses import replace

    from hethub_jax.parallel.plan import Plan
    from hethub_jax.planner.costs import _corun_relation
    from hethub_jax.planner.predictor import predict
    plan = Plan.from_dict(configs()[name]).validate(cfg)
    pred = predict(cfg, plan, {i.name: costs for i in plan.islands}, seq_len=args.seq, bridge=bridge)
    pred_base = predict(cfg, plan, {i.name: base for i in plan.islands}, seq_len=args.seq, bridge=bridge)
    warm = replace(costs, cold_extra={})
    pred_warm = predict(cfg, plan, {i.name: warm for i in plan.islands}, seq_len=args.seq, bridge=bridge)
    plain = replace(costs, action_costs={}, emulated_wait_fit=None)
    pred_plain = predict(cfg, plan, {i.name: plain for i in plan.islands}, seq_len=args.seq, bridge=bridge)
    # session 12's terms, each left out alone: the measured calls between profiled microbatch sizes
    # (the straight fitted lines instead) and the update-pair factor of the tail (the stage-call factor)
    lines = replace(costs, token_parts={})
    pred_lines = predict(cfg, plan, {i.name: lines for i in plan.islands}, seq_len=args.seq, bridge=bridge)
    nopair = replace(costs, corun_update_factor=0.0)
    pred_nopair = predict(cfg, plan, {i.name: nopair for i in plan.islands}, seq_len=args.seq, bridge=bridge)
    # the pipelines' OTHER co-run model (planner.costs.CORUN_BY_SIZE_DEFAULT decides the one in use): with the
    # relation in use the comparison is the one measured factor ("one_factor_corun"), with the one factor in use
    # (both island kinds today) it is the relation by the pair's size ratio ("size_ratio_corun")
    if costs.corun_relation:
        other_name, other = "one_factor_corun", replace(costs, corun_relation=())
    else:
        other_name = "size_ratio_corun"
        other = replace(costs, corun_relation=_corun_relation((costs.profile or {}).get("fits", {}).get("corun")))
    pred_other = predict(cfg, plan, {i.name: other for i in plan.islands}, seq_len=args.seq, bridge=bridge)
    flat = replace(costs, in_flight={})  # session 13: without the measured in-flight factors
    pred_flat = predict(cfg, plan, {i.name: flat for i in plan.islands}, seq_len=args.seq, bridge=bridge)
    variants = {"fitted_lines": pred_lines, "without_update_pair": pred_nopair, other_name: pred_other,
                "without_in_flight": pred_flat}
    if costs.bridge_allreduce_fit is not None:  # session 15: the shared sums by the ring formula over the p2p line
        ring = replace(costs, bridge_allreduce_fit=None)
        variants["ring_bridge_allreduce"] = predict(cfg, plan, {i.name: ring for i in plan.islands}, seq_len=args.seq,
                                                    bridge=bridge)
    samples = (costs.profile or {}).get("samples") or ()
    if any(isinstance(x, dict) and x.get("kind") == "stage_shape" for x in samples):
        # session 20: the parts fitted over the measured whole stages too (least squares), not from the four kinds
        from hethub_jax.planner.costs import _token_parts
        shaped = replace(costs, token_parts=_token_parts(samples, with_shapes=True))
        variants["parts_with_shapes"] = predict(cfg, plan, {i.name: shaped for i in plan.islands}, seq_len=args.seq,
                                                bridge=bridge)
    if ping_pong_bridge is not None:  # session 14: the bridge at the ping-pong's latency, not a waiting receiver's
        variants["ping_pong_bridge"] = predict(cfg, plan, {i.name: costs for i in plan.islands}, seq_len=args.seq,
                                               bridge=ping_pong_bridge)
    return plan, pred, pred_base, pred_warm, pred_plain, variants


def measure_round(plan, cfg, args) -> dict:
    """One round of one configuration: ``--trials`` fresh runtimes (:func:`measure_steps`); the round's
    figure is the minimum of their statistics. Returns that trial's dict plus ``"trials_statistic_s"``,
    ``"others_cpu_share"`` (CPU used by other processes meanwhile) and ``"loadavg"``."""
    snap = cpu_snapshot()
    trials = [measure_steps(plan, cfg, args.seq, args.steps, args.warmup, args.statistic)
              for _ in range(args.trials)]
    best = dict(min(trials, key=lambda t: t["statistic_s"]))
    best.update(trials_statistic_s=[t["statistic_s"] for t in trials], loadavg=loadavg(),
                others_cpu_share=others_share(snap, cpu_snapshot()))
    return best


def finish_row(name: str, pred, pred_base, rounds: list, args, pred_warm=None, pred_plain=None,
               variants=None) -> dict:
    """The configuration's row over its rounds (``rounds``: :func:`measure_round` dicts in round
    order): predicted, the rounds' figures and their spread (:func:`spread_summary`), the catalog
    baseline, and with ``--breakdown`` the breakdown of the median round's step. Prints its line."""
    figs = [r["statistic_s"] for r in rounds]
    sp = spread_summary(pred.step_time_s, figs)
    meas = sp["median_s"]
    shares = [r["others_cpu_share"] for r in rounds if r["others_cpu_share"] is not None]
    row = {"config": name, "predicted_step_s": pred.step_time_s, "measured_step_s": meas, **sp,
           "baseline_catalog_step_s": pred_base.step_time_s,
           "baseline_ape": abs(pred_base.step_time_s - meas) / meas, "critical_path": pred.critical_path,
           # the same profile without its measured cold-call extras (the model before session 10)
           "without_cold_step_s": None if pred_warm is None else pred_warm.step_time_s,
           "without_cold_ape": None if pred_warm is None else abs(pred_warm.step_time_s - meas) / meas,
           # the same profile without its measured action records and wait lateness (before session 11)
           "without_action_costs_step_s": None if pred_plain is None else pred_plain.step_time_s,
           "without_action_costs_ape": None if pred_plain is None else abs(pred_plain.step_time_s - meas) / meas,
           # session 12's terms left out one at a time: "fitted_lines" (no interpolation of the measured calls
           # between profiled microbatch sizes), "without_update_pair" (the tail at the stage-call co-run factor),
           # the pipelines' other co-run model: "one_factor_corun" (islands as processes, session 15) or
           # "size_ratio_corun" (islands as threads);
           # session 13's "without_in_flight" (no factor for microbatches in flight, fits.in_flight)
           **{f"{k}_step_s": v.step_time_s for k, v in (variants or {}).items()},
           **{f"{k}_ape": abs(v.step_time_s - meas) / meas for k, v in (variants or {}).items()},
           "rounds_steps_s": [r["steps_s"] for r in rounds],
           "rounds_trials_statistic_s": [r["trials_statistic_s"] for r in rounds],
           "faults_per_step": median([r["faults_per_step"] for r in rounds]),
           # islands as processes: CPU seconds of the island processes per timed step, voluntary context switches
           "cpu_s_per_step": (median([r["cpu_s_per_step"] for r in rounds])
                              if all("cpu_s_per_step" in r for r in rounds) else None),
           "voluntary_switches_per_step": (median([r["voluntary_switches_per_step"] for r in rounds])
                                           if all("voluntary_switches_per_step" in r for r in rounds) else None),
           "loadavg": [r["loadavg"] for r in rounds],
           "others_cpu_share": sum(shares) / len(shares) if shares else None}
    outside = "" if sp["within_spread"] else f" (outside the spread by {100 * sp['ape_beyond_spread']:.1f}%)"
    print(f"{name:24s} predicted {pred.step_time_s:7.4f} s  measured min/median/max {sp['min_s']:7.4f} / "
          f"{meas:7.4f} / {sp['max_s']:7.4f} s (spread {sp['spread']:.2f}x)  APE {100 * sp['ape']:5.1f}%{outside}"
          f"  catalog {100 * row['baseline_ape']:5.1f}%"
          + ("" if pred_warm is None else f"  without cold calls {100 * row['without_cold_ape']:5.1f}%")
          + ("" if pred_plain is None else f"  without action costs {100 * row['without_action_costs_ape']:5.1f}%")
          + f"  faults/step {row['faults_per_step']:.0f}"
          + ("" if row["cpu_s_per_step"] is None else f"  CPU/step {1e3 * row['cpu_s_per_step']:.1f} ms")
          + ("" if row["others_cpu_share"] is None else f"  others {100 * row['others_cpu_share']:.0f}% CPU"),
          flush=True)
    if args.breakdown:
        pick = min(rounds, key=lambda r: abs(r["statistic_s"] - meas))  # the median round
        row["breakdown"] = action_breakdown(pred, pick["records"], pick["t0"], pick["islands"])
        print(format_breakdown(row["breakdown"]))
    return row


def drift_scaled_mape(rows: list, drift) -> "float | None":
    """The mape had each round's measured step times been divided by that round's ``drift`` (its canary calls
    over the profile's, :func:`canary`), i.e. the predictions scaled by the machine's measured change of speed;
    None without a drift (a ``--profile`` given). A COMPARISON figure only, never the result: in session 14's
    quiet run (/work/bench/s14/predictor_accuracy.json: drift 0.90, 0.73, 0.99 while measured / predicted was
    1.10, 1.13, 1.17 per round) it gave 15.5% against 7.6% (size-ratio co-run) and 18.9% against 11.9% (one
    factor): the canary's own spread (17.5 then 12.0 ms around one quiet profile) is larger than the drift it
    would correct (docs/benchmarks.md, issue 13, session 15). ``rows[i]["rounds_s"]`` are in round order."""
    if not drift:
        return None
    apes = []
    for r in rows:
        scaled = median([m / d for m, d in zip(r["rounds_s"], drift)])
        apes.append(abs(r["predicted_step_s"] - scaled) / scaled)
    return sum(apes) / len(apes)


def summary(rows: list, names_by_round: list) -> dict:
    """The run's ``figures`` over the rows (see the module docstring, point 3)."""
    import math
    n = len(rows)
    by = {r["config"]: r for r in rows}
    round_mape, round_scale = [], []
    for i in range(len(names_by_round)):
        ratios = [by[c]["rounds_s"][i] / by[c]["predicted_step_s"] for c in names_by_round[i]]
        round_mape.append(sum(abs(1 / x - 1) for x in ratios) / len(ratios))
        round_scale.append(math.exp(sum(math.log(x) for x in ratios) / len(ratios)))
    spreads = sorted(r["spread"] for r in rows)
    return {"mape": sum(r["ape"] for r in rows) / n, "max_ape": max(r["ape"] for r in rows),
            "mape_min": sum(r["ape_min"] for r in rows) / n,
            "baseline_catalog_mape": sum(r["baseline_ape"] for r in rows) / n,
            "without_cold_mape": (sum(r["without_cold_ape"] for r in rows) / n
                                  if all(r.get("without_cold_ape") is not None for r in rows) else None),
            **{f"{k}_mape": sum(r[f"{k}_ape"] for r in rows) / n for k in ("fitted_lines", "without_update_pair",
                                                                         "size_ratio_corun", "one_factor_corun",
                                                                         "without_in_flight", "ring_bridge_allreduce",
                                                                         "ping_pong_bridge", "parts_with_shapes")
               if all(f"{k}_ape" in r for r in rows)},
            "without_action_costs_mape": (sum(r["without_action_costs_ape"] for r in rows) / n
                                          if all(r.get("without_action_costs_ape") is not None for r in rows)
                                          else None),
            "configurations": n, "goal_mape": 0.05, "rounds": len(names_by_round),
            "max_spread": spreads[-1], "median_spread": spreads[(n - 1) // 2],
            "within_spread": sum(bool(r["within_spread"]) for r in rows),
            "mape_beyond_spread": sum(r["ape_beyond_spread"] for r in rows) / n,
            "round_mape": round_mape, "round_scale": round_scale}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("--child", "--child-bridge"):  # a rank of a job started by this script
        (child_main if sys.argv[1] == "--child" else bridge_child_main)(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="output path")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sample")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the compiling one")
    ap.add_argument("--repeats", type=int, default=7, help="profiler repeats per figure")
    ap.add_argument("--profile-tp", default="1,2", help="TP degrees to profile")
    ap.add_argument("--profile-mbs", default="1,2,4",
                    help="microbatch sizes to profile (the configurations' own sizes are always added: the predictor "
                         "interpolates between profiled sizes)")
    ap.add_argument("--profile-dp", default="1,2", help="DP degrees to profile ((dp, 1) stage meshes)")
    ap.add_argument("--profile-stage-shapes", default="whole",
                    help="layer ranges the profile also measures as whole stages (hethub_jax.profile --stage-shapes): "
                         "'whole' (the default: the whole model, the one-stage setting the issue profiles, which every "
                         "heterogeneous-DP replica here runs), 'none', or ranges such as 0-5 (see stage_shapes_arg)")
    ap.add_argument("--profile", default=None, help="existing profile JSON to use (else one is made)")
    ap.add_argument("--profile-processes", type=int, default=1,
                    help="profiles made, each in a fresh process, interleaved with the rounds and merged (the median "
                         "per figure, hethub_jax.planner.profile_merge); 1: one profile in this process before the "
                         "rounds")
    ap.add_argument("--later-profiles", choices=("full", "compute"), default="compute",
                    help="with --profile-processes > 1: the profile processes after the first measure everything "
                         "(full) or only what is in absolute seconds, the stage calls, updates, copies and all-reduces "
                         "(compute: --corun off --no-runtime; the co-run ratios and the runtime's per-action records "
                         "are then the first profile's): about 0.6 of a full profile's CPU seconds")
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    ap.add_argument("--quick", action="store_true", help="3 configurations (a validation run)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds: every configuration is measured once per round, the rounds' order rotated; "
                         "its figure is the median over rounds and the spread is recorded (VM drift)")
    ap.add_argument("--trials", type=int, default=1,
                    help="fresh runtimes per configuration and round (the minimum of their statistics is the "
                         "round's figure)")
    ap.add_argument("--breakdown", action="store_true",
                    help="print (and record in each row) measured against predicted seconds per island, stage "
                         "and action kind (F, B, SEND, RECV), idle time and the tail after the pipeline")
    ap.add_argument("--statistic", choices=("median", "min"), default="median",
                    help="statistic of the profile's calls and of each round's timed steps (min: on a machine "
                         "shared with other jobs; the issue's figure is the median)")
    ap.add_argument("--host-allocator", choices=("steady", "steady-arenas", "default"), default="steady",
                    help="glibc allocator settings of this process (hethub_jax.host_allocator; the runtime "
                         "sets steady for CPU islands unless default is asked for here); steady-arenas: the steady "
                         "settings with glibc's own arena count instead of one arena (islands as threads then do not "
                         "share one arena lock, as islands in processes of their own do not)")
    ap.add_argument("--islands", choices=("processes", "threads"), default="processes",
                    help="processes (default): each configuration's islands run as two processes under mpiexec -n 2 "
                         "joined by the MPI host bridge, as hethub_jax.train runs islands, predicted as islands on one "
                         "shared host (DeviceCosts.on_shared_host) with the bridge's measured line; threads: one thread "
                         "per island in this process joined by LocalCommunicator (the benchmark before session 14), "
                         "predicted as islands in one process (DeviceCosts.in_process)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="with --islands processes (default on since session 20): pin island process i to core i, as "
                         "hethub_jax.train pins CPU islands (and hetero_dp.py / hetero_e2e.py), and profile pinned too "
                         "(hethub_jax.profile --pin: calls on one core, the co-run of two pinned cores); --no-pin: both "
                         "processes and the profile may use both cores (the benchmark before session 20)")
    ap.add_argument("--bridge-spin-s", type=float, default=0.0,
                    help="with --islands processes: seconds the MPI bridge's waits poll without sleeping before they "
                         "back off (MPIHostBridge.with_spin; the bridge's own default 0.05). Default 0: unpinned on 2 "
                         "cores, a spinning wait takes the core the other island computes on")
    args = ap.parse_args()
    from hethub_jax import host_allocator
    from hethub_jax.models.config import get_preset
    from hethub_jax.planner.costs import DeviceCosts, LinkModel
    if args.trials < 1 or args.steps < 1 or args.rounds < 1 or args.profile_processes < 1:
        raise SystemExit("--trials, --steps, --rounds and --profile-processes must be >= 1")
    if args.islands == "processes" and args.host_allocator == "steady-arenas":
        raise SystemExit("--host-allocator steady-arenas applies to --islands threads (each island process has its "
                         "own arena already)")
    if args.bridge_spin_s < 0:
        raise SystemExit("--bridge-spin-s must be >= 0")
    if args.host_allocator == "default":
        os.environ[host_allocator.ENV] = "default"
    alloc = host_allocator.steady_host_allocator()
    if args.host_allocator == "steady-arenas":  # before the JAX backend starts its threads (main() starts it later)
        alloc = dict(alloc, **arenas_per_thread())
    cfg = get_preset("tiny")
    load_before, t_start, snap0 = loadavg(), time.time(), cpu_snapshot(children=True)
    profiled = not (args.profile and os.path.exists(args.profile))
    names = list(configs())
    names = args.only.split(",") if args.only else names[:3] if args.quick else names
    orders = round_orders(names, args.rounds)
    interleaved = profiled and args.profile_processes > 1
    slots = profile_slots(args.profile_processes, len(orders)) if interleaved else [[] for _ in orders]
    canary_profile = [canary(cfg, args)] if profiled and not interleaved else []
    prof_path = None if interleaved else run_profile(args, names)
    canary_profile += [canary(cfg, args)] if profiled and not interleaved else []
    share_profile = (others_share(snap0, cpu_snapshot(children=True))  # while this run profiled
                     if profiled and not interleaved else None)
    t_profile = time.time() - t_start if not interleaved else 0.0
    prof_dir = tempfile.mkdtemp(prefix="hethub-profile-") if interleaved else None
    prof_paths, shares_profile = [], []
    bridge_fit = None
    if args.islands == "processes":
        # islands as processes of one host: they share its cores; between them the MPI host bridge, measured here
        # between two processes with the run's spin and pinning (the profiler's own fits.bridge needs mpiexec -n 2)
        bridge_fit = measure_bridge_fit(args)
    measured = {n: [] for n in names}
    canary_rounds = []
    plans = {n: plan_and_batch(n, cfg, args.seq)[0] for n in names}
    for i, order in enumerate(orders):
        for j in slots[i]:  # this round's profile processes (--profile-processes > 1)
            t0, snap = time.time(), cpu_snapshot(children=True)
            prof_paths.append(run_profile_process(args, names, os.path.join(prof_dir, f"cpu_{j}.json"),
                                                  compute_only=j > 0 and args.later_profiles == "compute"))
            canary_profile.append(canary(cfg, args))
            shares_profile.append(others_share(snap, cpu_snapshot(children=True)))
            t_profile += time.time() - t0
            print(f"profile process {j + 1}/{args.profile_processes} done ({time.time() - t_start:.0f} s)", flush=True)
        canary_rounds.append(canary(cfg, args))
        if args.islands == "processes":
            res = measure_round_processes(order, args)
            for n in order:
                measured[n].append(res[n])
        else:
            for n in order:
                measured[n].append(measure_round(plans[n], cfg, args))
        print(f"round {i + 1}/{len(orders)} done ({time.time() - t_start:.0f} s): "
              + ", ".join(f"{n} {measured[n][-1]['statistic_s']:.4f}" for n in order), flush=True)
    profile_merge = None
    if interleaved:
        from hethub_jax.planner.profile_merge import merge_profiles
        merged = merge_profiles(prof_paths)
        prof_path = os.path.join(prof_dir, "cpu.json")
        with open(prof_path, "w") as fh:
            json.dump(merged, fh, indent=1)
        share_profile = sum(shares_profile) / len(shares_profile)
        profile_merge = {"paths": prof_paths, "differing": merged["merged"]["differing"],
                         "others_cpu_share": shares_profile,
                         "slots": slots, "later_profiles": args.later_profiles}
        print(f"merged {len(prof_paths)} profiles (median per figure) into {prof_path}", flush=True)
    if args.islands == "processes":
        # the profile's measured co-run (planner.costs.CORUN_BY_SIZE_DEFAULT decides the model), each process
        # launches its own multi-device computations
        costs = DeviceCosts.from_profile(prof_path).on_shared_host("this host")
        bridge = bridge_link(bridge_fit)
        # the shared gradients' sum over the bridge: its all-reduce measured as the runtime calls it (session 15)
        costs = costs.with_bridge_allreduce(bridge_fit["allreduce_fit"])
        ar = bridge_fit["allreduce_fit"]
        print(f"MPI bridge between the island processes: {1e6 * bridge.alpha_s:.1f} us (a waiting receiver's wake-up; "
              f"ping-pong {1e6 * bridge_fit['fit']['c0']:.1f} us) + bytes / {bridge.bandwidth / 1e9:.2f} GB/s (spin "
              f"{args.bridge_spin_s:g} s, {'pinned' if args.pin else 'unpinned'})"
              + ("" if ar is None else f"; its all-reduce {1e6 * ar['c0']:.1f} us + bytes / {1e-9 / ar['c1']:.2f} GB/s"
                 f" ({1e3 * (ar['c0'] + ar['c1'] * ALLREDUCE_SIZES[-1]):.2f} ms at {ALLREDUCE_SIZES[-1]} bytes, the "
                 f"ring formula over the ping-pong line "
                 f"{1e3 * (2 * bridge.alpha_s + ALLREDUCE_SIZES[-1] / bridge.bandwidth):.2f} ms)"), flush=True)
    else:
        # the islands are threads of this process: they share its cores (the profile's measured co-run factor)
        # and its launcher of multi-device computations (DP / TP stages; the profile's measured fits.launch)
        costs = DeviceCosts.from_profile(prof_path).in_process("this process")
        # in one process the bridge is LocalCommunicator: the profile's measured 2-thread all-reduce
        # (older profiles: its host-copy line)
        bridge = costs.local_bridge_link or costs.host_link or LinkModel(0.0, 1e12)
    base = DeviceCosts.from_catalog("cpu")
    ping_pong = bridge_link(bridge_fit, wake=False) if bridge_fit else None
    preds = {n: predict_row(n, cfg, costs, base, bridge, args, ping_pong) for n in names}
    rows = [finish_row(n, preds[n][1], preds[n][2], measured[n], args, preds[n][3], preds[n][4], preds[n][5])
            for n in names]
    figures = summary(rows, orders)
    figures.update(statistic=args.statistic, trials=args.trials, host_allocator=alloc["allocator"],
                   islands=args.islands, pinned=bool(args.pin and args.islands == "processes"),
                   bridge_spin_s=args.bridge_spin_s if args.islands == "processes" else None, bridge_fit=bridge_fit,
                   # CPU used by other processes during the whole run (profile included): ~0 on a quiet machine
                   others_cpu_share=others_share(snap0, cpu_snapshot(children=True)), others_cpu_share_profile=share_profile,
                   profile_s=t_profile, wall_s=time.time() - t_start,
                   # the yardstick (canary) before/after the profile and per round; drift = round / profile
                   canary_profile_s=canary_profile, canary_rounds_s=canary_rounds,
                   drift=[c / median(canary_profile) for c in canary_rounds] if canary_profile else None,
                   # --profile-processes > 1: each profile process's canary (just after it) over their median
                   profile_processes=args.profile_processes if profiled else 0, profile_merge=profile_merge,
                   profile_drift=[c / median(canary_profile) for c in canary_profile] if interleaved else None)
    figures["drift_scaled_mape"] = drift_scaled_mape(rows, figures["drift"])
    print(f"MAPE {100 * figures['mape']:.1f}% against the median of {args.rounds} rounds (max "
          f"{100 * figures['max_ape']:.1f}%; against the rounds' minima {100 * figures['mape_min']:.1f}%) over "
          f"{len(rows)} configurations; {figures['within_spread']}/{len(rows)} predictions inside their rounds' "
          f"spread (median spread {figures['median_spread']:.2f}x, max {figures['max_spread']:.2f}x; beyond the "
          f"spread {100 * figures['mape_beyond_spread']:.1f}%); per round MAPE "
          + ", ".join(f"{100 * x:.1f}%" for x in figures["round_mape"]) + ", measured/predicted "
          + ", ".join(f"{x:.3f}" for x in figures["round_scale"])
          + f"; catalog baseline {100 * figures['baseline_catalog_mape']:.1f}%"
          + ("" if figures["without_cold_mape"] is None else
             f"; without the cold-call extras {100 * figures['without_cold_mape']:.1f}%")
          + ("" if figures["without_action_costs_mape"] is None else
             f"; without the action records and wait lateness {100 * figures['without_action_costs_mape']:.1f}%")
          + ("" if "fitted_lines_mape" not in figures else
             f"; with the fitted lines between profiled microbatch sizes {100 * figures['fitted_lines_mape']:.1f}%")
          + ("" if "without_update_pair_mape" not in figures else
             f"; without the update-pair factor {100 * figures['without_update_pair_mape']:.1f}%")
          + ("" if "size_ratio_corun_mape" not in figures else
             f"; with the co-run by the pair's size ratio {100 * figures['size_ratio_corun_mape']:.1f}%")
          + ("" if "one_factor_corun_mape" not in figures else
             f"; with the co-run at the one measured factor {100 * figures['one_factor_corun_mape']:.1f}%")
          + ("" if "without_in_flight_mape" not in figures else
             f"; without the in-flight factors {100 * figures['without_in_flight_mape']:.1f}%")
          + ("" if "ring_bridge_allreduce_mape" not in figures else
             f"; the shared sums by the ring formula over the bridge's ping-pong line "
             f"{100 * figures['ring_bridge_allreduce_mape']:.1f}%")
          + ("" if "ping_pong_bridge_mape" not in figures else
             f"; with the bridge at the ping-pong's latency {100 * figures['ping_pong_bridge_mape']:.1f}%")
          + ("" if "parts_with_shapes_mape" not in figures else
             f"; with the parts fitted over the measured whole stages too {100 * figures['parts_with_shapes_mape']:.1f}%")
          + ("" if figures["others_cpu_share"] is None else
             f"; other processes used {100 * figures['others_cpu_share']:.0f}% of the CPUs during the run")
          + ("" if share_profile is None else f" ({100 * share_profile:.0f}% while profiling)")
          + f"; {figures['wall_s']:.0f} s (profile {t_profile:.0f} s); host allocator {alloc['allocator']}"
          + ("" if not figures["drift"] else "; machine speed drift (canary calls, round / profile) "
             + ", ".join(f"{x:.3f}" for x in figures["drift"])
             + f" (canary around the profile {', '.join(f'{1e3 * x:.2f}' for x in canary_profile)} ms; the "
             f"mape with each round's measured steps divided by its drift {100 * figures['drift_scaled_mape']:.1f}%,"
             " a comparison only)"))
    for r in rows:
        for k in ("records", "islands"):
            r.pop(k, None)
    write_json(args.json, {"benchmark": "predictor_accuracy", "command": command_line(), "figures": figures,
                           "rows": rows, "profile": prof_path, "machine": machine(),
                           "loadavg_before": load_before, "loadavg_after": loadavg(),
                           "wall_s": time.time() - t_start, "host_allocator": alloc,
                           "note": "emulated slowdowns are EMULATED (sleeps); predictions are PREDICTED"})


if __name__ == "__main__":
    main()
