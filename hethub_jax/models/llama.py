"""Flax NNX Llama-2/3 decoder, buildable as any contiguous range of layers (a pipeline stage).

Shape names: B batch, S sequence, D hidden_size (d_model), H query heads, K key/value heads,
Dh head_dim, F intermediate_size, V vocab_size.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (one name per dimension);
`hethub_jax.parallel` maps those names to mesh axes. The model knows nothing of meshes or MPI.

Initialisation is keyed per parameter by (seed, global layer index, parameter name), so a stage that
holds layers 5..8 built alone gets exactly the weights layers 5..8 of the full model built with the
same seed get. With tied embeddings the last stage holds its own copy of the embedding with the same
initial values as the first stage's.
"""

from __future__ import annotations

import zlib
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hethub_jax.models.config import LlamaConfig

Array = jax.Array


def _path_ints(path: tuple) -> list[int]:
    return [p if isinstance(p, int) else zlib.crc32(p.encode()) for p in path]


def _host_normal(seed: int, path: tuple, shape: tuple[int, ...], std: float, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence([seed, *_path_ints(path)]))
    return (np.float32(std) * rng.standard_normal(shape, dtype=np.float32)).astype(jnp.dtype(dtype))


def _tracing() -> bool:
    """True under a JAX trace (`jax.jit`, `jax.eval_shape`, `nnx.eval_shape`): every jnp operation is
    staged there (omnistaging), so a fresh constant is a `jax.core.Tracer` (public API)."""
    return isinstance(jnp.zeros(()), jax.core.Tracer)


def _normal(seed: int, path: tuple, shape: tuple[int, ...], std: float, dtype: str) -> Array:
    """N(0, std^2) initial values, a pure function of (seed, path): drawn on the host with numpy
    (no XLA compilation per shape). Under tracing (`nnx.eval_shape`, `jax.jit`) the draw is a host
    callback, so abstract evaluation allocates nothing and a jitted init gives the same values."""
    fn = partial(_host_normal, seed, path, shape, std, dtype)
    if _tracing():
        return jax.pure_callback(fn, jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))
    return jnp.asarray(fn())


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019, eq. 4): y = x / sqrt(mean(x^2) + eps) * weight.

    Statistics in float32; `x: [..., D]` any float dtype -> `[..., D]` in the compute dtype.
    """

    def __init__(self, dim: int, eps: float, dtype: str, param_dtype: str):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * y.astype(self.dtype)


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse RoPE frequencies `[Dh // 2] float32`, with the config's `rope_scaling` applied.

    theta_i = rope_theta^(-2i/Dh) (Su et al. 2021, RoFormer, eq. 15). "linear" divides every
    frequency by `factor` (Chen et al. 2023, position interpolation). "llama3" (Llama 3.1 report,
    Meta 2024; as in HF `_compute_llama3_parameters`): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter than
    .../high_freq_factor kept, and the band between interpolated smoothly.
    """
    dh = config.head_dim
    inv = (1.0 / (np.float32(config.rope_theta) ** (np.arange(0, dh, 2, dtype=np.float32) / np.float32(dh))))
    inv = inv.astype(np.float32)
    rs = config.rope_scaling
    if rs is None or rs.rope_type == "default":
        return inv
    if rs.rope_type == "linear":
        return (inv / np.float32(rs.factor)).astype(np.float32)
    factor, lo, hi = rs.factor, rs.low_freq_factor, rs.high_freq_factor
    old = rs.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old / lo, old / hi
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(config: LlamaConfig, positions: Array) -> tuple[Array, Array]:
    """`positions: [B, S] int32` -> (cos, sin), each `[B, S, Dh] float32` (halves duplicated)."""
    inv = jnp.asarray(rope_inv_freq(config))
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotates `x: [B, S, heads, Dh]` by positions (non-interleaved halves, as HF Llama)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * c + rotated * s


class Attention(nnx.Module):
    """Causal grouped-query self-attention (Ainslie et al. 2023, GQA).

    Kernels: q `[D, H, Dh]`, k/v `[D, K, Dh]`, o `[H, Dh, D]`. Scores and softmax in float32.
    """

    def __init__(self, config: LlamaConfig, layer: int, seed: int):
        c, d, dt, std = config, config.hidden_size, config.param_dtype, config.initializer_range
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.dtype = c.dtype
        p = lambda name, shape, axes: nnx.Param(_normal(seed, (layer, name), shape, std, dt), logical_axes=axes)
        self.q_proj = p("q_proj", (d, c.num_attention_heads, c.head_dim), ("embed", "q_heads", "head_dim"))
        self.k_proj = p("k_proj", (d, c.num_key_value_heads, c.head_dim), ("embed", "kv_heads", "head_dim"))
        self.v_proj = p("v_proj", (d, c.num_key_value_heads, c.head_dim), ("embed", "kv_heads", "head_dim"))
        self.o_proj = p("o_proj", (c.num_attention_heads, c.head_dim, d), ("q_heads", "head_dim", "embed"))

    def __call__(self, x: Array, cos: Array, sin: Array) -> Array:
        """`x: [B, S, D]` compute dtype -> `[B, S, D]`."""
        dt = self.dtype
        q = jnp.einsum("bsd,dhk->bshk", x, self.q_proj[...].astype(dt))
        k = jnp.einsum("bsd,dhk->bshk", x, self.k_proj[...].astype(dt))
        v = jnp.einsum("bsd,dhk->bshk", x, self.v_proj[...].astype(dt))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        b, s, _, dh = q.shape
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(b, s, self.num_kv_heads, group, dh)
        scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
        scores = scores * (1.0 / np.sqrt(dh))
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, self.num_heads, dh)
        return jnp.einsum("bshk,hkd->bsd", out, self.o_proj[...].astype(dt))


class MLP(nnx.Module):
    """SwiGLU MLP (Shazeer 2020): down(silu(x @ gate) * (x @ up)); gate/up `[D, F]`, down `[F, D]`."""

    def __init__(self, config: LlamaConfig, layer: int, seed: int):
        d, f, dt, std = config.hidden_size, config.intermediate_size, config.param_dtype, config.initializer_range
        self.dtype = config.dtype
        p = lambda name, shape, axes: nnx.Param(_normal(seed, (layer, name), shape, std, dt), logical_axes=axes)
        self.gate_proj = p("gate_proj", (d, f), ("embed", "mlp"))
        self.up_proj = p("up_proj", (d, f), ("embed", "mlp"))
        self.down_proj = p("down_proj", (f, d), ("mlp", "embed"))

    def __call__(self, x: Array) -> Array:
        dt = self.dtype
        h = jax.nn.silu(x @ self.gate_proj[...].astype(dt)) * (x @ self.up_proj[...].astype(dt))
        return h @ self.down_proj[...].astype(dt)


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then h + mlp(norm(h)). `[B, S, D] -> [B, S, D]`."""

    def __init__(self, config: LlamaConfig, layer: int, seed: int):
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, c.param_dtype)
        self.self_attn = Attention(c, layer, seed)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, c.param_dtype)
        self.mlp = MLP(c, layer, seed)

    def __call__(self, x: Array, cos: Array, sin: Array) -> Array:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nnx.Module):
    """A contiguous range of a Llama model: the whole model, or one pipeline stage of it.

    The stage holding layer 0 also holds the token embedding; the stage holding the last layer also
    holds the final norm and the LM head (with tied embeddings: its own copy of the embedding matrix,
    initialised identically to the first stage's).

    Args:
      config: the full model's config (every field kept; nothing is dropped for a stage).
      first_layer, last_layer: inclusive global layer range; default the whole model.
      seed: initialisation seed; equal seeds give equal weights per global layer index.

    Call: `inputs` is `tokens: [B, S] int32` on the first stage, else `hidden: [B, S, D]` in the
    compute dtype; `positions: [B, S] int32` (default 0..S-1). Returns `logits: [B, S, V]` in the
    compute dtype on the last stage, else `hidden: [B, S, D]`.

    Raises:
      ValueError: if the layer range is empty or outside [0, num_hidden_layers).
    """

    def __init__(self, config: LlamaConfig, *, first_layer: int = 0, last_layer: int | None = None,
                 seed: int = 0):
        n = config.num_hidden_layers
        last_layer = n - 1 if last_layer is None else last_layer
        if not (0 <= first_layer <= last_layer < n):
            raise ValueError(f"layer range [{first_layer}, {last_layer}] must satisfy "
                             f"0 <= first_layer <= last_layer < num_hidden_layers ({n})")
        self.config = config
        self.first_layer, self.last_layer = first_layer, last_layer
        self.has_embedding = first_layer == 0
        self.has_head = last_layer == n - 1
        c = config
        if self.has_embedding or (self.has_head and c.tie_word_embeddings):
            self.embed_tokens = nnx.Param(
                _normal(seed, ("embed_tokens",), (c.vocab_size, c.hidden_size), c.initializer_range, c.param_dtype),
                logical_axes=("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(c, i, seed) for i in range(first_layer, last_layer + 1)])
        if self.has_head:
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, c.param_dtype)
            if not c.tie_word_embeddings:
                self.lm_head = nnx.Param(
                    _normal(seed, ("lm_head",), (c.hidden_size, c.vocab_size), c.initializer_range, c.param_dtype),
                    logical_axes=("embed", "vocab"))

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    def embed(self, tokens: Array) -> Array:
        """`tokens: [B, S] int32` -> `[B, S, D]` compute dtype."""
        return jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.config.dtype)

    def head(self, hidden: Array) -> Array:
        """`hidden: [B, S, D]` -> final norm -> `logits: [B, S, V]` compute dtype."""
        x = self.norm(hidden)
        w = self.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return x @ w.astype(self.config.dtype)

    def __call__(self, inputs: Array, positions: Array | None = None) -> Array:
        x = self.embed(inputs) if self.has_embedding else inputs.astype(self.config.dtype)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
        cos, sin = rope_cos_sin(self.config, positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(x) if self.has_head else x

    # ---- flat, HF-like parameter names with global layer indices --------------------------------
    def param_table(self) -> dict[str, nnx.Param]:
        """Maps global names ("layers.7.self_attn.q_proj", "embed_tokens", "norm", "lm_head") to Params."""
        table: dict[str, nnx.Param] = {}
        if hasattr(self, "embed_tokens"):
            table["embed_tokens"] = self.embed_tokens
        for i, layer in enumerate(self.layers):
            g = f"layers.{self.first_layer + i}"
            table[f"{g}.input_layernorm"] = layer.input_layernorm.weight
            table[f"{g}.post_attention_layernorm"] = layer.post_attention_layernorm.weight
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                table[f"{g}.self_attn.{name}"] = getattr(layer.self_attn, name)
            for name in ("gate_proj", "up_proj", "down_proj"):
                table[f"{g}.mlp.{name}"] = getattr(layer.mlp, name)
        if self.has_head:
            table["norm"] = self.norm.weight
            if hasattr(self, "lm_head"):
                table["lm_head"] = self.lm_head
        return table

    def load_params(self, params: dict[str, Any], *, strict: bool = True) -> None:
        """Assigns values from a flat dict (names as `param_table`, global layer indices).

        Extra names (other stages' layers) are ignored. Values are cast to `param_dtype`.

        Raises:
          ValueError: naming the tensor, if one this range needs is missing (strict) or its shape
            differs.
        """
        for name, param in self.param_table().items():
            if name not in params:
                if strict:
                    raise ValueError(f"parameter {name!r} is missing from the given weights")
                continue
            value = jnp.asarray(params[name])
            if value.shape != param[...].shape:
                raise ValueError(f"parameter {name!r}: shape {tuple(value.shape)} does not match the "
                                 f"model's {tuple(param[...].shape)}")
            param[...] = value.astype(self.config.param_dtype)


def count_params(model_or_state: Any) -> int:
    """Number of parameters (a count) in a model or an abstract state from `nnx.eval_shape`."""
    state = nnx.state(model_or_state, nnx.Param)
    return int(sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state)))
