"""A float64 numpy Llama, written apart from the Flax model: the reference of the numerics check.

``python -m hethub_jax.check_numerics`` compares every island's layer outputs with this code run in
float64 on the host. It shares no code with ``hethub_jax.models.llama`` (RMSNorm, RoPE with its
``linear`` / ``llama3`` scaling, grouped-query attention, SwiGLU, head and loss are written again from
their papers and the HF ``transformers`` Llama), so a bug there is not repeated here;
``tests/test_check_numerics.py`` checks this module against HF ``transformers`` run in float64.

Shape names as in ``models/llama.py``: B batch, S sequence, D hidden_size, H query heads, K key/value
heads, Dh head_dim, F intermediate_size, V vocab_size. Weights use the flat names and layouts of
``Llama.param_table`` (q ``[D, H, Dh]``, k/v ``[D, K, Dh]``, o ``[H, Dh, D]``, gate/up ``[D, F]``,
down ``[F, D]``, embedding ``[V, D]``, lm_head ``[D, V]``). Every function casts its inputs to
float64 and returns float64.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["rms_norm", "inv_freq", "cos_sin", "embed", "decoder_layer", "head", "next_token_loss",
           "forward_chain"]

F64 = np.float64


def _f(x: Any) -> np.ndarray:
    return np.asarray(x).astype(F64)


def _get(obj: Any, key: str) -> Any:
    return obj[key] if isinstance(obj, Mapping) else getattr(obj, key)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich 2019, eq. 4): ``x / sqrt(mean(x^2) + eps) * weight``; ``[..., D]``."""
    x = _f(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f(weight)


def inv_freq(config: Any) -> np.ndarray:
    """RoPE inverse frequencies ``[Dh // 2]``: ``rope_theta^(-2i/Dh)`` (RoFormer eq. 15), with the
    ``linear`` (position interpolation) or ``llama3`` (Llama 3.1; HF ``_compute_llama3_parameters``)
    scaling of ``config.rope_scaling`` applied."""
    dh = config.head_dim
    inv = 1.0 / (F64(config.rope_theta) ** (np.arange(0, dh, 2, dtype=F64) / dh))
    rs = config.rope_scaling
    kind = None if rs is None else _get(rs, "rope_type")
    if kind in (None, "default"):
        return inv
    factor = F64(_get(rs, "factor"))
    if kind == "linear":
        return inv / factor
    old = F64(_get(rs, "original_max_position_embeddings"))
    lo, hi = F64(_get(rs, "low_freq_factor")), F64(_get(rs, "high_freq_factor"))
    wavelen = 2 * np.pi / inv
    out = np.where(wavelen > old / lo, inv / factor, inv)  # long wavelengths: interpolated
    smooth = (old / wavelen - lo) / (hi - lo)
    between = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(between, (1 - smooth) * out / factor + smooth * out, out)


def cos_sin(config: Any, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin``: ``[S, Dh]`` for positions ``0 .. S-1`` (frequency halves repeated, as HF)."""
    angles = np.arange(seq_len, dtype=F64)[:, None] * inv_freq(config)[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + rot * sin[None, :, None, :]


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _attention(x: np.ndarray, w: Mapping[str, np.ndarray], p: str, config: Any) -> np.ndarray:
    """Causal GQA self-attention (Ainslie et al. 2023): query head h reads key/value head
    ``h // (H / K)`` (HF ``repeat_kv``). ``x: [B, S, D]`` -> ``[B, S, D]``."""
    q = np.einsum("bsd,dhk->bshk", x, _f(w[p + "q_proj"]))
    k = np.einsum("bsd,dhk->bshk", x, _f(w[p + "k_proj"]))
    v = np.einsum("bsd,dhk->bshk", x, _f(w[p + "v_proj"]))
    s, dh = x.shape[1], q.shape[-1]
    cos, sin = cos_sin(config, s)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bshd,bthd->bhst", q, k) / np.sqrt(F64(dh))
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    out = np.einsum("bhst,bthd->bshd", _softmax(scores), v)
    return np.einsum("bshd,hdm->bsm", out, _f(w[p + "o_proj"]))


def _mlp(x: np.ndarray, w: Mapping[str, np.ndarray], p: str) -> np.ndarray:
    """SwiGLU (Shazeer 2020): ``down(silu(x @ gate) * (x @ up))``, silu(z) = z / (1 + exp(-z))."""
    g = x @ _f(w[p + "gate_proj"])
    return (g / (1.0 + np.exp(-g)) * (x @ _f(w[p + "up_proj"]))) @ _f(w[p + "down_proj"])


def embed(tokens: np.ndarray, weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """``tokens: [B, S]`` int -> rows of the embedding ``[B, S, D]``."""
    return _f(weights["embed_tokens"])[np.asarray(tokens)]


def decoder_layer(x: np.ndarray, weights: Mapping[str, np.ndarray], layer: int, config: Any) -> np.ndarray:
    """Pre-norm decoder layer ``layer`` (global index): ``h = x + attn(norm(x))``,
    ``h + mlp(norm(h))``. ``x: [B, S, D]`` -> ``[B, S, D]``."""
    p, eps = f"layers.{layer}.", config.rms_norm_eps
    x = _f(x)
    h = x + _attention(rms_norm(x, weights[p + "input_layernorm"], eps), weights, p + "self_attn.", config)
    return h + _mlp(rms_norm(h, weights[p + "post_attention_layernorm"], eps), weights, p + "mlp.")


def head(x: np.ndarray, weights: Mapping[str, np.ndarray], config: Any) -> np.ndarray:
    """Final RMSNorm and LM head (the embedding transposed when tied): ``[B, S, D]`` -> ``[B, S, V]``."""
    w = _f(weights["embed_tokens"]).T if config.tie_word_embeddings else _f(weights["lm_head"])
    return rms_norm(x, weights["norm"], config.rms_norm_eps) @ w


def next_token_loss(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``logits[:, :-1]`` (every token
    counted): a float64 scalar (0-d array). ``logits: [B, S, V]``, ``tokens: [B, S]`` int."""
    z = _f(logits)[:, :-1]
    m = z.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))[..., 0]
    tgt = np.take_along_axis(z, np.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
    return np.asarray(np.mean(lse - tgt))


def forward_chain(tokens: np.ndarray, weights: Mapping[str, np.ndarray], config: Any) -> list[np.ndarray]:
    """The whole model in float64: ``[embedding out, layer 0 out, ..., head out (logits), loss]``."""
    outs = [embed(tokens, weights)]
    for i in range(config.num_hidden_layers):
        outs.append(decoder_layer(outs[-1], weights, i, config))
    outs.append(head(outs[-1], weights, config))
    outs.append(next_token_loss(outs[-1], tokens))
    return outs
