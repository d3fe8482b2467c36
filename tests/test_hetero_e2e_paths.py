"""benchmarks/hetero_e2e.py, session 17: the headline figures on the gradient all-reduce path training's
``train.grad_bucket_mb: auto`` keeps (decided by training's own warm-up code, ``train.warm_up_grad_allreduce``,
on real in-process runtimes with a stubbed timer), the PREDICTED step on that path (against an independent
``predict`` call), both paths' rows and figures; the island profile's chunked-last-microbatch sizes; and the
per-phase memory and seconds (``profile.PhaseLog``, checked against a process that allocates a known amount)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hethub_jax.parallel.runtime import PipelineRuntime  # noqa: E402
from hethub_jax.planner.costs import DeviceCosts  # noqa: E402
from hethub_jax.planner.predictor import predict  # noqa: E402
from test_grad_buckets import PathClock  # noqa: E402
from test_hetero_dp import dp_plan  # noqa: E402
from test_predictor import fixed_profile  # noqa: E402
from test_runtime_equivalence import OPTIM, batches, model_config  # noqa: E402

REPO = os.path.join(os.path.dirname(__file__), "..")


def _bridge():
    from benchmarks.hetero_e2e import cluster
    from hethub_jax.planner import cluster_from_dict
    from hethub_jax.planner.search import bridge_for
    return bridge_for(cluster_from_dict(cluster(1.0)), [("fast", "slow")])


def _setup(bucket_mb, monkeypatch, costs_s=None):
    """A hetero-DP plan (shares 9/1, 1F1B, microbatch 1: replica 0 chunks its last microbatch) as the planner's
    plan, its runtime set as the benchmark sets it, PREDICTED as the benchmark's ``plans`` does; with
    ``costs_s`` = (bucketed s, unbucketed s) the runtimes' warm-up timer is a stub returning those seconds."""
    from benchmarks.hetero_e2e import runtime_grad_buckets
    cfg = model_config(False)
    plan = dp_plan(shares=[9, 1])
    prof = fixed_profile(0.01, 0.02)
    prof["fits"]["chunked_last"] = {"points": [[1, 1.3]]}  # the bucketed path costs more PREDICTED
    c = DeviceCosts.from_profile(prof)
    costs = {"i0": c, "i1": c}
    if costs_s is not None:
        orig = PipelineRuntime.choose_grad_buckets

        def with_clock(self, batch, steps=3, timer=None):
            return orig(self, batch, steps, timer=PathClock(self, *costs_s))
        monkeypatch.setattr(PipelineRuntime, "choose_grad_buckets", with_clock)
    pred = predict(cfg, plan, costs, seq_len=8, bridge=_bridge(), grad_bucket_mb=runtime_grad_buckets(bucket_mb))
    args = SimpleNamespace(bucket_mb=bucket_mb, slowdown=1.0, bridge_link=None, seq=8, planned_prediction=pred)
    rt = PipelineRuntime(plan, cfg, OPTIM, seed=7)
    rt.set_grad_buckets(runtime_grad_buckets(bucket_mb))
    return cfg, plan, costs, args, {"planned": rt}, {"planned": (plan, pred.step_time_s)}, pred


@pytest.mark.parametrize("bucketed_s,unbucketed_s", [(0.3, 0.5), (0.5, 0.3)])
def test_auto_headline_is_the_path_the_warm_up_kept(bucketed_s, unbucketed_s, monkeypatch, capsys):
    """``--bucket-mb auto``: training's warm-up (stubbed timer: its MEASURED seconds are the stub's) keeps
    the faster path (40% apart, beyond the 2% rule); the planner's plan's runtime is on it, a second runtime of
    the same plan on the other path; the PREDICTED steps are those of independent ``predict`` calls on each
    path; the warm-up's record holds both timings; training's own lines were printed."""
    from benchmarks.hetero_e2e import grad_allreduce_paths
    cfg, plan, costs, args, runtimes, contenders, pred = _setup("auto", monkeypatch, (bucketed_s, unbucketed_s))
    made = []
    paths = grad_allreduce_paths(args, cfg, costs, runtimes, contenders, batches(10)[0], 0,
                                 lambda p: made.append(PipelineRuntime(p, cfg, OPTIM, seed=7)) or made[-1])
    kept = "bucketed" if bucketed_s < unbucketed_s else "unbucketed"
    other = {"bucketed": "unbucketed", "unbucketed": "bucketed"}[kept]
    assert args.grad_mode == "auto" and paths["planned"]["path"] == kept
    w = paths["planned"]["warm_up"]
    assert w["path"] == kept and (w["bucketed_s"], w["unbucketed_s"]) == (pytest.approx(bucketed_s),
                                                                           pytest.approx(unbucketed_s))
    assert (runtimes["planned"].grad_bucket_bytes is not None) == (kept == "bucketed")
    assert set(runtimes) == {"planned", f"planned_{other}"} and made == [runtimes[f"planned_{other}"]]
    assert paths[f"planned_{other}"]["path"] == other and paths[f"planned_{other}"]["warm_up"] is None
    want = {x: predict(cfg, plan, costs, seq_len=8, bridge=_bridge(),
                       grad_bucket_mb=25.0 if x == "bucketed" else None).step_time_s for x in ("bucketed", "unbucketed")}
    assert contenders["planned"] == (plan, pytest.approx(want[kept]))
    assert contenders[f"planned_{other}"] == (plan, pytest.approx(want[other]))
    assert args.planned_prediction.grad_allreduce == kept
    out = capsys.readouterr().out
    assert "MEASURED step forward/backward + all-reduce" in out and "keeps the" in out


def test_forced_and_off_time_nothing(monkeypatch):
    """``--bucket-mb 25``: every runtime bucketed, nothing timed, the plan's unbucketed row beside it, the
    PREDICTED step the bucketed one (as before session 17); ``--bucket-mb 0``: unbucketed, no second row."""
    from benchmarks.hetero_e2e import grad_allreduce_paths
    monkeypatch.setattr(PipelineRuntime, "choose_grad_buckets", lambda *a, **k: pytest.fail("nothing to time"))
    cfg, plan, costs, args, runtimes, contenders, pred = _setup(25.0, monkeypatch)
    paths = grad_allreduce_paths(args, cfg, costs, runtimes, contenders, batches(10)[0], 0,
                                 lambda p: PipelineRuntime(p, cfg, OPTIM, seed=7))
    assert args.grad_mode == "forced" and paths["planned"] == {"path": "bucketed", "bucket_mb": 25.0,
                                                                "off_reason": None, "warm_up": None}
    assert paths["planned_unbucketed"]["path"] == "unbucketed"
    assert args.planned_prediction is pred and contenders["planned"][1] == pred.step_time_bucketed_s
    assert contenders["planned_unbucketed"][1] == pred.step_time_unbucketed_s
    cfg, plan, costs, args, runtimes, contenders, pred = _setup(0.0, monkeypatch)
    paths = grad_allreduce_paths(args, cfg, costs, runtimes, contenders, batches(10)[0], 0,
                                 lambda p: pytest.fail("no second runtime"))
    assert args.grad_mode == "off" and set(paths) == {"planned"} and paths["planned"]["path"] == "unbucketed"


@pytest.mark.parametrize("kept", ["bucketed", "unbucketed"])
def test_bucket_figures_put_the_kept_path_in_the_headline_and_both_paths_beside(kept):
    """``_bucket_figures`` with hand-made rows: each path's fraction is its row's tokens/s over the bound (the
    kept path's row is "planned"), its error its PREDICTED step against its measured one."""
    from benchmarks.hetero_e2e import _bucket_figures, grad_allreduce_summary
    other = {"bucketed": "unbucketed", "unbucketed": "bucketed"}[kept]
    p = SimpleNamespace(grad_allreduce=kept, step_time_bucketed_s=2.0, step_time_unbucketed_s=2.2,
                        buckets={"faster": "bucketed", "auto_keeps": "bucketed", "ratio": {"(0, 0)": 1.1},
                                 "ratio_source": {"(0, 0)": "profile"}})
    w = {"path": kept, "bucketed_s": 1.0, "unbucketed_s": 1.5, "bucket_mb": 25.0, "steps": 3, "reason": None}
    args = SimpleNamespace(planned_prediction=p, planned_prediction_before_warm_up=p, grad_mode="auto",
                           bucket_mb="auto", planned_search_step_s=2.0,
                           grad_paths={"planned": {"path": kept, "bucket_mb": 25.0 if kept == "bucketed" else None,
                                                   "off_reason": None, "warm_up": w}})
    measured = {"bucketed": (1000.0, 2.1), "unbucketed": (900.0, 2.3)}  # (tokens/s, step s)
    rows = {"planned": measured[kept], f"planned_{other}": measured[other]}
    f = _bucket_figures(args, rows, 1250.0)
    assert f["grad_allreduce_kept"] == kept and f["grad_allreduce_warm_up"] is w and "MEASURED" in f[
        "grad_allreduce_decided_by"]
    for x, (tok, step) in measured.items():
        assert f[f"fraction_of_upper_bound_{x}"] == pytest.approx(tok / 1250.0, abs=1e-4)
        assert f[f"measured_step_s_planned_{x}"] == step
        pred_x = {"bucketed": 2.0, "unbucketed": 2.2}[x]
        assert f[f"prediction_error_{x}"] == pytest.approx(abs(pred_x - step) / step, abs=1e-4)
    assert f["planned_bucketed_over_unbucketed"] == pytest.approx(1000 / 900, abs=1e-4)
    line = grad_allreduce_summary(f)
    assert f"KEPT {kept}" in line and "warm-up MEASURED bucketed 1.000 s, unbucketed 1.500 s" in line
    one = _bucket_figures(args, {"planned": measured[kept]}, 1250.0)  # the other path not run: no per-path figures
    assert "fraction_of_upper_bound_bucketed" not in one and "fraction_of_upper_bound_unbucketed" not in one


def test_island_profile_measures_the_chunked_ratio_at_the_planners_ends(monkeypatch):
    """``--chunked-mbs auto``: at global batch 64 the planner's sizes are the divisors 1..64 and the profile
    measures the chunked ratio at the smallest and the largest up to 16 (1 and 16), as plan-less training's
    profile; ``profiled`` gives the profiler's own auto (every profiled size up to 16); the island profile is
    asked for exactly those."""
    from benchmarks import hetero_e2e
    from hethub_jax import profile
    divisors = [d for d in range(1, 65) if 64 % d == 0]
    assert hetero_e2e.chunked_sizes("auto", 64) == f"{min(divisors)},{max(d for d in divisors if d <= 16)}" == "1,16"
    assert hetero_e2e.chunked_sizes("auto", 6) == "1,6"  # every divisor of 6 is under 16
    assert hetero_e2e.chunked_sizes("profiled", 64) == "auto" and hetero_e2e.chunked_sizes("none", 64) == "none"
    assert hetero_e2e.chunked_sizes("4,8", 64) == "4,8"
    asked = []
    monkeypatch.setattr(profile, "main", lambda argv: asked.append(argv) or {})
    args = hetero_e2e.parser().parse_args(["--json", "x.json"])
    args.profile_mbs, args.chunked_mbs_profile = "1,2,4", hetero_e2e.chunked_sizes(args.chunked_mbs, args.batch)
    hetero_e2e._profile_island(args, 0, [4242])
    argv = asked[0]
    assert argv[argv.index("--chunked-mbs") + 1] == "1,16" and argv[argv.index("--job-pids") + 1] == "4242"


_ALLOC = """
import json, sys
import numpy as np
from hethub_jax.profile import PhaseLog, memory_status
log = PhaseLog()
with log.phase("alloc"):
    a = np.ones(300 * 2**20 // 8)  # 300 MiB, every page touched
with log.phase("free"):
    del a
with log.phase("idle"):
    pass
print(json.dumps({"phases": log.phases, "now": memory_status()}))
"""


def test_phase_log_sees_a_known_allocation():
    """A fresh process allocates and touches 300 MiB in one phase: that phase raises the peak by about 300 MiB
    and its resident set by as much; freeing it lowers the resident set and leaves the peak; an empty phase
    raises nothing. Seconds are non-negative; the peak never falls."""
    p = subprocess.run([sys.executable, "-c", _ALLOC], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    alloc, free, idle = got["phases"]
    mib = 2**20
    assert [x["phase"] for x in got["phases"]] == ["alloc", "free", "idle"]
    assert 280 * mib <= alloc["peak_rss_rise_bytes"] <= 330 * mib
    assert 280 * mib <= alloc["rss_bytes"] - alloc["rss_bytes_before"] <= 330 * mib
    assert free["rss_bytes"] <= alloc["rss_bytes"] - 280 * mib and free["peak_rss_rise_bytes"] == 0
    assert idle["peak_rss_rise_bytes"] == 0 and free["peak_rss_bytes"] == alloc["peak_rss_bytes"]
    assert all(x["seconds"] >= 0 for x in got["phases"])
    # a raw VmHWM reading may be a few pages under an earlier one (the kernel syncs RSS counters lazily)
    assert got["now"]["peak_rss_bytes"] >= alloc["peak_rss_bytes"] - mib


def test_phase_line_says_seconds_peak_rise_and_resident():
    from hethub_jax.profile import phase_line
    rec = {"phase": "stage_shapes", "seconds": 12.34, "peak_rss_bytes": 3 * 2**30, "peak_rss_rise_bytes": 2**29,
           "rss_bytes": 2**30}
    assert phase_line(rec) == ("phase stage_shapes: 12.3 s, peak RSS 3.00 GiB (+0.50 GiB in this phase), "
                               "resident 1.00 GiB")
    assert "peak RSS ? GiB" in phase_line(dict(rec, peak_rss_bytes=None, peak_rss_rise_bytes=None))


@pytest.mark.slow
def test_profile_writes_its_phases_and_progress_lines(tmp_path):
    """``python -m hethub_jax.profile`` (the tiny model, one size, one repeat, the whole model as a stage
    shape, the chunked measurement at size 1): the JSON's ``phases`` name the phases run, in order, each
    with seconds and the process's peak and resident memory (the peak never falls and each rise is the
    difference of consecutive peaks); the chunked sizes are recorded; a progress line per phase on stderr."""
    out = tmp_path / "cpu.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", "hethub_jax.profile", "--out", str(out), "--seq-len", "16",
                        "--microbatch-sizes", "1", "--repeats", "1", "--corun", "off", "--no-runtime",
                        "--no-bridge", "--stage-shapes", "0-5", "--chunked-mbs", "1"],
                       env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    prof = json.loads(out.read_text())
    ph = prof["phases"]
    assert [x["phase"] for x in ph] == ["compute", "stage_shapes", "launch", "chunked_last",
                                        "host_copy_allreduce_shared_sum", "release_host_memory"]
    assert prof["chunked_microbatch_sizes"] == [1] and prof["fits"]["chunked_last"] is not None
    peaks = [x["peak_rss_bytes"] for x in ph]
    assert all(b >= a for a, b in zip(peaks, peaks[1:])) and all(x["seconds"] >= 0 for x in ph)
    # a phase raises the peak by at most what it rose since the last phase's end (code between phases may too)
    assert all(0 <= x["peak_rss_rise_bytes"] <= b - a for x, a, b in zip(ph[1:], peaks, peaks[1:]))
    assert all(0 < x["rss_bytes"] <= x["peak_rss_bytes"] for x in ph) and "VmHWM" in prof["phases_note"]
    for x in ph:
        assert f"profile: phase {x['phase']}: " in p.stderr
