"""The cross-island numerics check (hethub_jax.check_numerics, issue 16 part 4).

The float64 reference (models/numpy_reference.py) is checked against HF transformers run in float64;
the check itself on the two CPU islands of configs/plans/tiny_2island.json, in-process and under
mpiexec, with and without a deliberately perturbed island.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_comm_contract import ROOT, run_mpi
from test_model import CASES, LLAMA3_SEQ, _hf_model

from hethub_jax import check_numerics as cn
from hethub_jax.models import hf as hf_io
from hethub_jax.models import numpy_reference as npref

PLAN = str(ROOT / "configs" / "plans" / "tiny_2island.json")
# The tiny preset (6 layers, GQA, tied embeddings) with a smaller vocabulary: quicker, same layers.
FAST = ["--plan", PLAN, "--set", "model.vocab_size=512", "--seq-len", "16"]


# ---- the float64 reference against HF transformers in float64 ----------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_numpy_reference_matches_transformers_in_float64(case):
    hf_model = _hf_model(case)
    ours = hf_io.from_transformers(hf_model)  # float32 values, copied exactly into our layout
    weights = {k: np.asarray(p[...]) for k, p in ours.param_table().items()}
    config = ours.config
    seq = LLAMA3_SEQ if case == "llama3_rope" else 24
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, size=(2, seq))
    hf64 = hf_model.double()  # the same float32 values, exactly, in float64
    # HF keeps RoPE angles, RMSNorm statistics and the softmax in float32 whatever the model dtype,
    # so the float64 model agrees with ours to float32 accuracy (normwise 2e-6 here), not to float64:
    # that checks every layout, the GQA head mapping, RoPE scaling, the tied head and the loss.
    np.testing.assert_allclose(npref.inv_freq(config), hf64.model.rotary_emb.inv_freq.numpy(), rtol=2 ** -22)
    with torch.no_grad():
        out = hf64(torch.tensor(tokens), labels=torch.tensor(tokens), output_hidden_states=True)
    chain = npref.forward_chain(tokens, weights, config)
    hs = [h.numpy() for h in out.hidden_states]  # embedding, after each layer but the last, after norm
    for i in range(config.num_hidden_layers):
        np.testing.assert_allclose(chain[i], hs[i], rtol=0, atol=2e-6 * np.abs(hs[i]).max())
    logits = out.logits.numpy()
    np.testing.assert_allclose(chain[-2], logits, rtol=0, atol=2e-6 * np.abs(logits).max())
    assert abs(float(chain[-1]) - out.loss.item()) <= 2e-6 * out.loss.item()
    # Sensitive: one weight changed by 1e-3 moves the logits well beyond the tolerance above.
    weights["layers.1.mlp.up_proj"] = weights["layers.1.mlp.up_proj"] * (1 + 1e-3)
    assert np.abs(npref.forward_chain(tokens, weights, config)[-2] - logits).max() > 2e-5 * np.abs(logits).max()


# ---- tolerances ------------------------------------------------------------------------------------
def test_tolerance_follows_the_unit_roundoff_and_reduction_length():
    t = cn.tolerance
    assert t("bfloat16", 64) > t("float16", 64) > t("float32", 64) > 0
    assert t("float32", 4096) > t("float32", 64)
    assert t("float32", 64, against="island") == cn.ISLAND_FACTOR * t("float32", 64)
    assert t("float32", 64, chain=8) == pytest.approx(8 * t("float32", 64))
    # float32: the formula's own terms (u = 2^-24 from the format's 24 significand bits)
    assert t("float32", 100) == pytest.approx((cn.GROWTH + cn.ACCUMULATION * 10) * 2.0 ** -24)
    with pytest.raises(ValueError, match="float8"):
        t("float8", 64)


# ---- the check on two CPU islands, in-process ---------------------------------------------------------
def _run(tmp_path, *extra):
    out = tmp_path / "report.json"
    status = cn.main([*FAST, *extra, "--json", str(out)])
    return status, json.loads(out.read_text())


def _assert_rows(report, num_layers=6):
    names = ["embedding", *(f"layer {i}" for i in range(num_layers)), "head", "loss", "end-to-end loss"]
    assert [r["name"] for r in report["rows"]] == names
    assert all(set(r["islands"]) == {"fast", "slow"} for r in report["rows"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_cpu_islands_pass(tmp_path, capsys, dtype):
    status, report = _run(tmp_path, "--dtype", dtype)
    assert status == 0, capsys.readouterr().out
    _assert_rows(report)
    assert report["passed"] and report["first_failure"] is None
    for row in report["rows"]:
        for d in row["islands"].values():
            assert d["ok"] and d["max_rel_vs_island"] <= row["tol_vs_island"]
            assert d["max_rel_vs_float64"] <= row["tol_vs_float64"]
    # The float64 comparison compares something: rounding shows in every decoder layer.
    assert all(row["islands"]["slow"]["max_rel_vs_float64"] > 0 for row in report["rows"][1:7])
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("island, piece, row, against", [
    ("slow", "3", "layer 3", "island fast"),   # a non-reference island: differs from the reference island
    ("fast", "head", "head", "float64"),       # the reference island itself: only float64 can tell
])
def test_perturbed_island_fails_naming_the_first_layer(tmp_path, capsys, island, piece, row, against):
    status, report = _run(tmp_path, "--perturb-island", island, "--perturb-layer", piece,
                          "--perturb-scale", "1e-3")
    out = capsys.readouterr().out
    assert status == cn.EXIT_BEYOND_TOLERANCE
    f = report["first_failure"]
    assert (f["row"], f["island"], f["against"]) == (row, island, against), f
    assert f"FAILED: first row beyond tolerance: {row} on island {island} against {against}" in out
    assert "TESTING THE CHECKER" in out
    # Each piece is fed the reference island's input, so no row before the perturbed one differs.
    names = [r["name"] for r in report["rows"]]
    for r in report["rows"][:names.index(row)]:
        assert all(d["ok"] for d in r["islands"].values()), r


@pytest.mark.parametrize("flags, message", [
    (["--perturb-island", "gpu", "--perturb-layer", "1"], "--perturb-island 'gpu' is not an island"),
    (["--perturb-island", "slow", "--perturb-layer", "6"], "--perturb-layer must be"),
    (["--perturb-island", "slow"], "go together"),
    (["--reference-island", "nope"], "--reference-island 'nope'"),
    (["--seq-len", "1"], "--seq-len"),
    (["--perturb-island", "slow", "--perturb-layer", "1", "--perturb-scale", "nan"], "--perturb-scale"),
])
def test_bad_input_is_one_line_before_any_work(capsys, flags, message):
    assert cn.main([*FAST, *flags]) == cn.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_island_platform_missing_in_process_is_bad_input(tmp_path, capsys):
    plan = json.loads(open(PLAN).read())
    plan["islands"][0]["platform"] = "rocm"  # island "fast"; this test process has only the cpu backend
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert cn.main(["--plan", str(path), "--set", "model.vocab_size=512"]) == cn.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "island fast: platform 'rocm' is not available" in err and "mpiexec" in err, err


# ---- one process per island under mpiexec -------------------------------------------------------------
@pytest.mark.mpi
def test_mpi_two_islands_perturbed_layer_named(tmp_path):
    out = tmp_path / "report.json"
    res = run_mpi(["-m", "hethub_jax.check_numerics", *FAST, "--perturb-island", "slow", "--perturb-layer", "2",
                   "--json", str(out)], 2, timeout=240)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "FAILED: first row beyond tolerance: layer 2 on island slow against island fast" in res.stdout, \
        res.stdout + res.stderr
    report = json.loads(out.read_text())
    _assert_rows(report)
    # Every other row of the separately computed islands is within tolerance, and the outputs really
    # travelled: the slow island's rounding against float64 is there in every decoder layer.
    for r in report["rows"]:
        if r["name"] not in ("layer 2", "end-to-end loss"):
            assert all(d["ok"] for d in r["islands"].values()), r
    assert all(r["islands"]["slow"]["max_rel_vs_float64"] > 0 for r in report["rows"][1:7])
    assert math.isfinite(report["rows"][-1]["islands"]["slow"]["max_rel_vs_island"])
