"""The profiler measures the MPI bridge's all-reduce and writes ``fits.bridge_allreduce`` (issue 13, session 16),
which ``DeviceCosts.from_profile`` reads and the predictor uses for the cross-island sum of shared gradients
in place of the ring formula over the ping-pong line.

References: the fit against hand-made samples (exact lines, a noisy intercept below zero); the profiler run as
two MPI ranks at the smallest sizes (its figures are measured: only their presence, signs and the sizes are
checked), then the predictor's all-reduce moved by exactly the measured line minus the ring formula (by hand).
"""
from __future__ import annotations

import json

import pytest

from hethub_jax.planner.costs import DeviceCosts, LinkModel
from hethub_jax.planner.predictor import predict
from hethub_jax.profile import BRIDGE_ALLREDUCE_SIZES, fit_bridge_allreduce
from tests.test_predictor import Cfg, chain_plan, fixed_profile


def samples(pairs):
    return [{"kind": "bridge_allreduce", "bytes": b, "seconds": s} for b, s in pairs]


def test_fit_is_the_line_through_exact_samples():
    fit = fit_bridge_allreduce(samples([(4096, 1e-4 + 2e-9 * 4096), (2**20, 1e-4 + 2e-9 * 2**20),
                                        (2**22, 1e-4 + 2e-9 * 2**22)]))
    assert fit["c0"] == pytest.approx(1e-4, rel=1e-9) and fit["c1"] == pytest.approx(2e-9, rel=1e-9)
    assert fit["rmse"] == pytest.approx(0.0, abs=1e-12)


def test_fit_of_a_convex_all_reduce_takes_the_large_sizes_slope_and_the_small_sizes_latency():
    # the shape measured on this machine's bridge (68 us, 80 us, 3.1 ms): by hand, c1 = (3.1e-3 - 8e-5) / (4 MiB -
    # 256 KiB), c0 = 6.8e-5 - c1 x 4096; least squares over the three would give an intercept below 0
    pts = [(4096, 6.8e-5), (2**18, 8e-5), (2**22, 3.1e-3)]
    fit = fit_bridge_allreduce(samples(pts[::-1]))
    c1 = (3.1e-3 - 8e-5) / (2**22 - 2**18)
    assert fit["c1"] == pytest.approx(c1) and fit["c0"] == pytest.approx(6.8e-5 - c1 * 4096)
    assert fit["c0"] > 0


def test_fit_keeps_both_coefficients_non_negative():
    # the largest size measured faster than the one below it (noise): no slope, the flat mean
    fit = fit_bridge_allreduce(samples([(1000, 3e-4), (2000, 2e-4)]))
    assert fit["c0"] == pytest.approx(2.5e-4) and fit["c1"] == 0.0
    # the smallest size faster than the slope allows: intercept 0
    fit = fit_bridge_allreduce(samples([(1000, 1e-7), (2000, 1e-3), (3000, 2e-3)]))
    assert fit["c0"] == 0.0 and fit["c1"] == pytest.approx(1e-6)
    assert fit_bridge_allreduce(samples([(1000, 3e-4)])) == {**fit_bridge_allreduce(samples([(1000, 3e-4)])),
                                                             "c0": pytest.approx(3e-4), "c1": 0.0}
    assert fit_bridge_allreduce([]) is None


@pytest.mark.slow
@pytest.mark.mpi
def test_profiler_under_two_ranks_writes_the_bridge_allreduce_fit_the_predictor_uses(tmp_path):
    pytest.importorskip("mpi4py")
    from test_comm_contract import mpiexec, run_mpi
    if mpiexec() is None:
        pytest.skip("no mpiexec")
    out = tmp_path / "cpu.json"
    res = run_mpi(["-m", "hethub_jax.profile", "--out", str(out), "--seq-len", "16", "--microbatch-sizes", "1",
                   "--tp", "1", "--repeats", "1", "--no-runtime", "--corun", "off", "--no-progress"],
                  n=2, timeout=600, env={"JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    prof = json.loads(out.read_text())
    got = [s for s in prof["samples"] if s["kind"] == "bridge_allreduce"]
    assert [s["bytes"] for s in got] == list(BRIDGE_ALLREDUCE_SIZES) and all(s["seconds"] > 0 for s in got)
    fit = prof["fits"]["bridge_allreduce"]
    assert fit["c0"] > 0 and fit["c1"] > 0  # alpha > 0 s, 1 / beta > 0 s per byte
    c = DeviceCosts.from_profile(prof)
    n = 4.0 * Tied.vocab_size * Tied.hidden_size
    assert c.bridge_allreduce_s(n) == pytest.approx(fit["c0"] + fit["c1"] * n)
    # the predictor's cross-island sum of the tied embedding's gradient takes the measured line, not the ring
    # formula 2 alpha + bytes / bandwidth of the bridge (two islands): the step's all-reduce moves by exactly that
    base = DeviceCosts.from_profile(fixed_profile(0.01, 0.02, update=0.004))
    meas = base.with_bridge_allreduce(fit)
    plan, link = chain_plan(2, 4, islands=["a", "b"]), LinkModel(2e-4, 1e10)
    ring = predict(Tied, plan, {"a": base, "b": base}, seq_len=8, bridge=link)
    used = predict(Tied, plan, {"a": meas, "b": meas}, seq_len=8, bridge=link)
    assert used.allreduce_s - ring.allreduce_s == pytest.approx((fit["c0"] + fit["c1"] * n) - (2 * 2e-4 + n / 1e10))


class Tied(Cfg):
    tie_word_embeddings = True
