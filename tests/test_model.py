"""The Flax Llama against HF transformers (torch, CPU, fp32) and against itself split into ranges."""

import json
import re

import numpy as np
import pytest

import jax.numpy as jnp
import torch
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hethub_jax.models import hf as hf_io
from hethub_jax.models.config import PRESETS, LlamaConfig
from hethub_jax.models.llama import Llama, count_params, rope_inv_freq

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             max_position_embeddings=256, rms_norm_eps=1e-5,
             initializer_range=0.1)  # larger than HF's 0.02 so attention is far from uniform
CASES = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa_8q_2kv": dict(num_attention_heads=8, num_key_value_heads=2),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # head_dim 16, theta 500000: wavelengths 6.3, 32.4, 167, ... With original length 64 and factors
    # 1/4 the smoothed band is [16, 64], so one frequency is kept, one smoothed, the rest divided by 8.
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}
LLAMA3_SEQ = 160  # positions well beyond the original 64


def _hf_model(case: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**SMALL, **CASES[case], attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to one; random norms make the test sharper
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case):
    hf_model = _hf_model(case)
    seq = LLAMA3_SEQ if case == "llama3_rope" else 24
    tokens = np.random.default_rng(1).integers(0, SMALL["vocab_size"], size=(2, seq))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    ours = hf_io.from_transformers(hf_model)
    if case == "llama3_rope":
        rs = ours.config.rope_scaling
        assert rs["rope_type"] == "llama3" and ours.config.rope_theta == 500000.0  # not the default
        assert seq > rs["original_max_position_embeddings"]
        # Every branch of the llama3 rule is exercised: kept (short), smoothed (between), scaled (long).
        dh = ours.config.head_dim
        wavelen = 2 * np.pi / (1.0 / 500000.0 ** (np.arange(0, dh, 2) / dh))
        hi_w = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
        lo_w = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
        assert (wavelen < hi_w).any() and (wavelen > lo_w).any()
        assert ((wavelen > hi_w) & (wavelen < lo_w)).any(), (wavelen, hi_w, lo_w)
    got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
    assert got.shape == ref.shape == (2, seq, SMALL["vocab_size"])
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # The comparison is sensitive: a model with one weight perturbed must not pass.
    params = ours.param_table()
    params["layers.1.self_attn.k_proj"][...] = params["layers.1.self_attn.k_proj"][...] * 1.1
    assert np.abs(np.asarray(ours(jnp.asarray(tokens, jnp.int32))) - ref).max() > 1e-4


@pytest.mark.parametrize("head_dim, theta, scaling", [
    (16, 500000.0, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
    (128, 500000.0, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)),
    (32, 10000.0, dict(factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=128)),
])
def test_rope_inv_freq_matches_transformers_llama3(head_dim, theta, scaling):
    rope = {"rope_type": "llama3", **scaling}
    heads = 4
    hf_cfg = transformers.LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads,
                                      rope_theta=theta, rope_scaling=dict(rope))
    ref, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    assert attention_factor == 1.0
    ours = rope_inv_freq(LlamaConfig(**(SMALL | dict(hidden_size=head_dim * heads, num_attention_heads=heads,
                                                     num_key_value_heads=heads, rope_theta=theta,
                                                     rope_scaling=rope))))
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv
    old = scaling["original_max_position_embeddings"]
    lo_w, hi_w = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
    assert ((wavelen > hi_w) & (wavelen < lo_w)).any()  # the smoothed band is not empty
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=0)


def test_local_checkpoint_directory(tmp_path):
    hf_model = _hf_model("gqa_8q_2kv", seed=3)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    tokens = np.random.default_rng(2).integers(0, SMALL["vocab_size"], size=(1, 16))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    ours = hf_io.load_hf_checkpoint(tmp_path)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens, jnp.int32))), ref, atol=1e-4, rtol=0)
    # A stage loaded alone reads only its layers and equals the same layers of the full import.
    stage = hf_io.load_hf_checkpoint(tmp_path, first_layer=1, last_layer=1)
    full = ours.param_table()
    for name, p in stage.param_table().items():
        np.testing.assert_array_equal(np.asarray(p[...]), np.asarray(full[name][...]))


def test_checkpoint_directory_missing_files_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'config.json'} not found")):
        hf_io.load_hf_checkpoint(tmp_path)
    hf_model = _hf_model("mha")
    (tmp_path / "config.json").write_text(json.dumps(hf_model.config.to_dict()))
    with pytest.raises(FileNotFoundError, match=re.escape(f"no *.safetensors files in {tmp_path}")):
        hf_io.load_hf_checkpoint(tmp_path)


def test_import_errors_name_the_tensor_and_field():
    hf_model = _hf_model("mha")
    state = dict(hf_model.state_dict())
    cfg = hf_io.config_from_hf(hf_model.config)
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:-1]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*shape"):
        hf_io.params_from_hf(state, cfg)
    del state["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.v_proj\.weight.*missing"):
        hf_io.params_from_hf(state, cfg, layers=[0])
    bad = hf_model.config.to_dict() | {"hidden_act": "gelu"}
    with pytest.raises(ValueError, match="hidden_act"):
        hf_io.config_from_hf(bad)


def test_layer_range_alone_reproduces_full_model_hidden_states():
    cfg = LlamaConfig(**(SMALL | dict(num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2)))
    full = Llama(cfg, seed=5)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 12)), jnp.int32)
    from hethub_jax.models.llama import rope_cos_sin

    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    cos, sin = rope_cos_sin(cfg, positions)
    hidden = [full.embed(tokens)]  # hidden[i] = input of layer i
    for layer in full.layers:
        hidden.append(layer(hidden[-1], cos, sin))
    for first, last in [(0, 2), (3, 5), (2, 2), (6, 6), (4, 6)]:
        stage = Llama(cfg, first_layer=first, last_layer=last, seed=5)  # built alone, same seed
        x = tokens if first == 0 else hidden[first]
        out = stage(x, positions)
        expect = full.head(hidden[last + 1]) if last == 6 else hidden[last + 1]
        np.testing.assert_allclose(np.asarray(out), np.asarray(expect), rtol=1e-6, atol=1e-6)
        assert stage.config == cfg  # every field intact
    np.testing.assert_allclose(np.asarray(full.head(hidden[-1])), np.asarray(full(tokens)), rtol=1e-6, atol=1e-6)
    # A different seed gives different weights: the equality above is not vacuous.
    other = Llama(cfg, first_layer=3, last_layer=5, seed=6)
    assert np.abs(np.asarray(other(hidden[3], positions)) - np.asarray(hidden[6])).max() > 1e-3


def test_tied_last_stage_copy_equals_first_stage_embedding():
    cfg = LlamaConfig(**(SMALL | dict(num_hidden_layers=3, num_attention_heads=4, tie_word_embeddings=True)))
    first, last = Llama(cfg, last_layer=0, seed=2), Llama(cfg, first_layer=1, seed=2)
    np.testing.assert_array_equal(np.asarray(first.embed_tokens[...]), np.asarray(last.embed_tokens[...]))
    assert "lm_head" not in last.param_table()


def _hf_count(cfg: LlamaConfig) -> int:
    d = cfg.to_dict()
    rope = d.pop("rope_scaling")
    d.pop("dtype"), d.pop("param_dtype")
    hf_cfg = transformers.LlamaConfig(**d, **({"rope_scaling": rope} if rope else {}))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny", "llama2-7b", "llama3-8b", "llama3-70b"])
def test_preset_param_counts_match_transformers(name):
    cfg = PRESETS[name]
    abstract = nnx.eval_shape(lambda: Llama(cfg))  # no weights allocated
    assert count_params(abstract) == _hf_count(cfg) == cfg.num_params()


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden_size=66, num_attention_heads=4), r"num_attention_heads \(4\) must divide hidden_size \(66\)"),
    (dict(num_attention_heads=8, num_key_value_heads=3), r"num_key_value_heads \(3\) must divide num_attention_heads \(8\)"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
    (dict(dtype="float64"), "dtype must be one of"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_type 'yarn' is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "missing"),
])
def test_bad_config_names_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**(SMALL | kwargs))


def test_unknown_config_key_rejected():
    with pytest.raises(ValueError, match=r"unknown LlamaConfig key\(s\) \['hiden_size'\]"):
        LlamaConfig.from_dict({"hiden_size": 64})


def test_bad_layer_range():
    with pytest.raises(ValueError, match="layer range"):
        Llama(LlamaConfig(**SMALL), first_layer=1, last_layer=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_cross_entropy_matches_torch(dtype):
    """The loss written once for the pipeline's last stage and the reference: against torch's
    `cross_entropy` (summed over the unmasked tokens, count = mask sum), in float32 from any dtype."""
    from hethub_jax.models.loss import token_cross_entropy

    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((3, 7, 50)) * 4).astype(np.float32)
    targets = rng.integers(0, 50, size=(3, 7)).astype(np.int32)
    mask = (rng.random((3, 7)) > 0.3).astype(np.float32)
    logits_in = jnp.asarray(logits, dtype)
    loss_sum, count = token_cross_entropy(logits_in, jnp.asarray(targets), jnp.asarray(mask))
    ref = torch.nn.functional.cross_entropy(torch.from_numpy(np.asarray(logits_in.astype(jnp.float32))).reshape(-1, 50),
                                            torch.from_numpy(targets).long().reshape(-1), reduction="none")
    want = float((ref * torch.from_numpy(mask).reshape(-1)).sum())
    assert loss_sum.dtype == jnp.float32 and count.dtype == jnp.float32
    np.testing.assert_allclose(float(loss_sum), want, rtol=1e-5)
    assert float(count) == mask.sum()
