"""Microbatch sizes between profiled ones (issue 13): the predictor follows the profile's MEASURED
stage calls at each profiled token count, linear between them, instead of the straight fitted line.

The reference is a synthetic device whose stage calls cost a known CONVEX function of the tokens (on
this CPU the seconds per token rise with the microbatch: docs/benchmarks.md, issue 13, session 12):
the profile records its four stage kinds at the profiled microbatch sizes, and a stage of another
shape must cost what that device's formula says at a profiled size, and the chord between the two
profiled sizes around it elsewhere. Pure Python (no JAX)."""
import pytest

from hethub_jax.planner.costs import PROFILE_FORMAT, DeviceCosts
from hethub_jax.planner.predictor import stage_compute_s
from hethub_jax.profile import fit_compute

SEQ = 16


class Cfg:
    vocab_size, hidden_size, intermediate_size, num_hidden_layers = 1000, 64, 128, 8
    num_attention_heads, num_key_value_heads, head_dim = 4, 2, 16
    tie_word_embeddings, dtype, param_dtype = False, "float32", "float32"


PHASES = ("F", "F_nosave", "B", "B_recompute")
KINDS = {"first": (1, True, False), "mid1": (1, False, False), "mid2": (2, False, False), "last": (1, False, True)}


def true_s(layers, is_first, is_last, tokens, phase):
    """The synthetic device: a call's seconds, convex in tokens (1e-6 s units)."""
    # phases differ by a factor; a recomputing backward costs more than the plain forward + backward
    k = {"F": 1.2, "F_nosave": 1.0, "B": 2.0, "B_recompute": 3.2}[phase]
    per_layer = 2e-6 * tokens + 4e-9 * tokens ** 2
    return k * (1e-4 + layers * per_layer + is_first * 1e-7 * tokens + is_last * (5e-6 * tokens + 3e-8 * tokens ** 2))


def profile(mbs_list):
    samples = [{"kind": "stage", "stage": kind, "layers": n, "is_first": f, "is_last": l, "dp": 1, "tp": 1,
                "phase": ph, "microbatch_size": mbs, "tokens": mbs * SEQ, "seconds": true_s(n, f, l, mbs * SEQ, ph)}
               for kind, (n, f, l) in KINDS.items() for mbs in mbs_list for ph in PHASES]
    zero = {"c0": 0.0, "c1": 0.0}
    return {"format": PROFILE_FORMAT, "device_type": "dev", "memory_bytes": 10**12, "samples": samples,
            "fits": {"compute": fit_compute(Cfg, samples, SEQ), "update": zero, "allreduce": zero}}


def predicted(costs, layers, is_first, is_last, mbs, phase):
    return stage_compute_s(Cfg, costs, 0 if is_first else 1, layers - (1 if is_first else 0), is_first, is_last,
                           mbs * SEQ, SEQ, 1, phase)


@pytest.mark.parametrize("phase", ["F", "B", "F_nosave"])
@pytest.mark.parametrize("shape", [(3, True, False), (3, False, True), (2, False, False), (4, True, True)])
def test_profiled_microbatch_sizes_are_followed(shape, phase):
    costs = DeviceCosts.from_profile(profile([1, 2, 4]))
    for mbs in (1, 2, 4):  # at a profiled size: the device's own seconds
        assert predicted(costs, *shape, mbs, phase) == pytest.approx(true_s(*shape, mbs * SEQ, phase), rel=1e-9)
    # between two profiled sizes: the chord of the device's seconds at both
    lo, hi = true_s(*shape, 2 * SEQ, phase), true_s(*shape, 4 * SEQ, phase)
    assert predicted(costs, *shape, 3, phase) == pytest.approx((lo + hi) / 2, rel=1e-9)


def test_straight_line_through_1_and_4_overestimates_2_on_a_convex_device():
    """What the profile at microbatch 1 and 4 only gives at 2: the chord, above the convex device's
    seconds (the fitted lines would do the same); profiling 2 removes the error."""
    shape, phase = (3, False, True), "B_recompute"
    two = true_s(*shape, 2 * SEQ, phase)
    only_1_4 = predicted(DeviceCosts.from_profile(profile([1, 4])), *shape, 2, phase)
    assert only_1_4 > 1.02 * two
    assert predicted(DeviceCosts.from_profile(profile([1, 2, 4])), *shape, 2, phase) == pytest.approx(two, rel=1e-9)


def test_outside_the_profiled_sizes_the_fitted_lines_apply():
    prof = profile([1, 2, 4])
    costs = DeviceCosts.from_profile(prof)
    from dataclasses import replace
    fits_only = replace(costs, token_parts={})
    for mbs in (8, 16):
        assert predicted(costs, 3, True, False, mbs, "B") == pytest.approx(predicted(fits_only, 3, True, False, mbs, "B"))


def test_profiles_without_stage_kinds_keep_the_fitted_lines():
    prof = profile([1, 2, 4])
    for s in prof["samples"]:
        s.pop("stage")
    assert DeviceCosts.from_profile(prof).token_parts == {}


@pytest.mark.parametrize("hetero_dp", [False, True])
def test_search_still_equals_exhaustive_with_measured_token_parts(hetero_dp):
    """The planner's bounds (per-layer lower bounds, stage lines) read the same interpolated parts as
    ``predict``: on the convex device profiled at microbatch 1, 2 and 4 (8: the fitted lines), the search
    finds what exhaustive enumeration finds."""
    from pathlib import Path

    from hethub_jax.planner import SearchOptions, exhaustive_search, search
    from tests.test_planner import small_model
    tiny2 = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "tiny_2island_cpu.yaml"
    prof = profile([1, 2, 4])
    costs = {"fast": DeviceCosts.from_profile(prof), "slow": DeviceCosts.from_profile(prof)}
    cfg = small_model(layers=4)
    opt = SearchOptions(top_k=2, max_stages_per_group=2, hetero_dp=hetero_dp)
    got = search(cfg, tiny2, 8, SEQ, costs=costs, options=opt)
    ref = exhaustive_search(cfg, tiny2, 8, SEQ, costs=costs, options=opt)
    assert got.best.step_time_s == pytest.approx(ref.best.step_time_s, rel=1e-12)
    assert got.candidates[-1].step_time_s >= ref.candidates[-1].step_time_s * (1 - 1e-12)


def _with_whole(prof, mbs_list, mid2_noise=0.0):
    """``prof`` plus the whole model (every layer, both ends) measured as one stage (``--stage-shapes``), its
    ``mid2`` samples raised by ``mid2_noise`` x one layer's true seconds (a noisy two-layer stage)."""
    L = Cfg.num_hidden_layers
    for s in prof["samples"]:
        if s["stage"] == "mid2":
            s["seconds"] += mid2_noise * (true_s(2, False, False, s["tokens"], s["phase"])
                                         - true_s(1, False, False, s["tokens"], s["phase"]))
    prof["samples"] += [{"kind": "stage_shape", "first_layer": 0, "last_layer": L - 1, "layers": L, "is_first": True,
                         "is_last": True, "dp": 1, "tp": 1, "phase": ph, "microbatch_size": mbs, "tokens": mbs * SEQ,
                         "seconds": true_s(L, True, True, mbs * SEQ, ph)} for mbs in mbs_list for ph in PHASES]
    return prof


def test_parts_with_shapes_agree_on_a_consistent_profile_and_correct_a_noisy_layer():
    """``_token_parts(with_shapes=True)`` (least squares over the four stage kinds and the measured whole stages):
    on samples that the parts model reproduces exactly it gives the same parts as the exact solve; with the
    two-layer stage measured 2 layers too slow (a noisy ``mid2 - mid1``), the exact solve triples the layer and
    a 3-layer last stage built from it is off by at least 4 layers' seconds, while the least squares, held by the
    8-layer whole stage, is at least 3x closer to the device's true seconds."""
    from dataclasses import replace

    from hethub_jax.planner.costs import _token_parts
    prof = _with_whole(profile([1, 2, 4]), [1, 2, 4])
    exact, lsq = _token_parts(prof["samples"]), _token_parts(prof["samples"], with_shapes=True)
    assert exact.keys() == lsq.keys()
    for k in exact:
        for a, b in zip(exact[k], lsq[k]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-12)
    noisy = _with_whole(profile([1, 2, 4]), [1, 2, 4], mid2_noise=2.0)
    costs = DeviceCosts.from_profile(noisy)
    shaped = replace(costs, token_parts=_token_parts(noisy["samples"], with_shapes=True))
    for mbs in (1, 4):
        for phase in ("F", "B_recompute"):
            true = true_s(3, False, True, mbs * SEQ, phase)
            layer = true_s(2, False, False, mbs * SEQ, phase) - true_s(1, False, False, mbs * SEQ, phase)
            off_exact = predicted(costs, 3, False, True, mbs, phase) - true
            off_lsq = predicted(shaped, 3, False, True, mbs, phase) - true
            # 4 layers' seconds (base + 7 layers for 3), more where the base solved below 0 s reads 0 s
            assert off_exact >= 4 * layer * (1 - 1e-6)
            assert abs(off_lsq) < abs(off_exact) / 3
