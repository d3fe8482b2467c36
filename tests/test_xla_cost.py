"""The XLA cost-analysis adapter (hethub_jax.planner.xla_cost) and the predicted memory of compiled
stages against XLA's memory_analysis() (CPU)."""
import warnings

import pytest

from hethub_jax.planner import xla_cost
from hethub_jax.planner.xla_cost import cost_from_analysis, normalize_cost_analysis


def test_dict_list_and_none_inputs():
    d = {"flops": 100.0, "bytes accessed": 40.0}
    assert normalize_cost_analysis(d) is d
    assert normalize_cost_analysis([d]) is d
    assert normalize_cost_analysis(None) is None and normalize_cost_analysis([]) is None
    with pytest.raises(TypeError):
        normalize_cost_analysis(3.0)
    c = cost_from_analysis([d], 90.0)
    assert (c.flops, c.bytes_accessed, c.fallback) == (100.0, 40.0, False)


@pytest.mark.parametrize("raw", [None, [], {"flops": -1.0}, {"flops": 0}, [{"flops": -1}], {"bytes accessed": 5}])
def test_missing_or_non_positive_falls_back_with_a_notice(raw):
    with pytest.warns(UserWarning, match="analytic"):
        c = cost_from_analysis(raw, 123.0)
    assert c.flops == 123.0 and c.fallback and "analytic" in c.notice


@pytest.mark.parametrize("xla,ok", [(250.0, False), (201.0, False), (199.0, True), (51.0, True), (49.0, False)])
def test_more_than_2x_off_falls_back(xla, ok):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = cost_from_analysis({"flops": xla}, 100.0)
    assert c.fallback == (not ok)
    assert c.flops == (xla if ok else 100.0)
    assert c.xla_flops == xla


def test_no_analytic_count_to_fall_back_to_raises():
    with pytest.raises(ValueError, match="analytic"):
        cost_from_analysis(None, None, warn=False)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_compiled_matmul_plus_bias(n):
    import jax
    import jax.numpy as jnp
    f = jax.jit(lambda x, w, b: x @ w + b)
    compiled = f.lower(jnp.zeros((n, 73)), jnp.zeros((73, 256)), jnp.zeros((256,))).compile()
    want = 2 * n * 73 * 256 + n * 256  # multiply-adds of the product, plus the bias additions
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = xla_cost.analyze(compiled, want)
    if c.fallback:  # a JAX version without the analysis: the analytic count, with a notice
        assert c.flops == want and c.notice and caught
    else:
        assert c.flops == want and not caught
    mem = xla_cost.memory_of(compiled)
    assert mem is None or mem["argument"] == 4 * (n * 73 + 73 * 256 + 256)


STAGE_SHAPES = [  # (first_layer, last_layer, microbatch_size, seq_len, tp)
    (1, 2, 2, 64, 1),   # middle stage, two layers
    (0, 1, 4, 32, 1),   # first stage (embedding)
    (1, 2, 2, 64, 2),   # middle stage, TP 2
    (5, 5, 2, 64, 1),   # last stage (head and loss, no fusion as under GPipe)
]


@pytest.mark.parametrize("fl,ll,mbs,seq,tp", STAGE_SHAPES)
def test_predicted_stage_memory_matches_memory_analysis(fl, ll, mbs, seq, tp):
    """Residuals of one microbatch (the compiled forward_saving's outputs) and the parameters (its
    arguments besides the microbatch's inputs) of a real PipelineStage, per device, against the predictor's memory model: 10%."""
    import jax
    import jax.numpy as jnp

    from hethub_jax.models.config import get_preset
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage, StageInputs
    from hethub_jax.planner.predictor import stage_memory_bytes
    cfg = get_preset("tiny")
    st = PipelineStage(cfg, fl, ll, jax.devices()[:tp], 1, tp, seed=0, recompute=False,
                       optimizer=make_optimizer(OptimConfig()))
    x = jnp.zeros((mbs, seq), jnp.int32) if st.is_first else jnp.zeros((mbs, seq, cfg.hidden_size), jnp.float32)
    extra = (jnp.zeros((mbs, seq), jnp.int32), jnp.zeros((mbs, seq), jnp.float32)) if st.is_last else ()
    inputs_mb = StageInputs(x, jnp.zeros((mbs, seq), jnp.int32), *(extra or (None, None)))
    mem = xla_cost.memory_of(st.forward_saving.lower(st.params, inputs_mb).compile())
    pred = stage_memory_bytes(cfg, fl, ll, st.is_first, st.is_last, microbatch_size=mbs, seq_len=seq, dp=1, tp=tp,
                              in_flight=1, recompute="none")
    assert pred.activations == pytest.approx(mem["output"], rel=0.10)
    inputs = x.nbytes + 4 * mbs * seq + sum(e.nbytes for e in extra)  # batch-split over dp = 1: whole
    assert pred.params + inputs == pytest.approx(mem["argument"], rel=0.10)
