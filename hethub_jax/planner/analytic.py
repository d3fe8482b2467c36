"""Analytic FLOP, parameter and activation-memory counts of our Llama (pure Python, no JAX).

Shape names as in ``hethub_jax.models.llama``: D hidden_size, H query heads, K key/value heads, Dh
head_dim, F intermediate_size, V vocab_size, T tokens (= microbatch samples x seq_len), s seq_len.
FLOPs are counts (one multiply-add = 2 FLOPs), bytes are bytes. The counts follow the code of
``hethub_jax.models.llama`` (GQA attention computing the full s x s score matrix before the causal
mask, SwiGLU MLP, RMSNorm, untied or tied LM head) and ``hethub_jax.parallel.stage`` (TP layout:
q/o/gate/up/down and, when TP divides them, the KV heads and the vocabulary are split; norms are
replicated).

Sources:
  * matmul FLOPs 2 m n k per product; forward + backward = 3 x forward (the backward computes the
    gradients with respect to the input and to the weights, 2 x forward): Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 5.1
    (the 72 B s l h^2 (1 + s/6h + V/12hl) FLOPs per iteration with recompute count 4 forwards);
  * activation memory: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", section 4.1, eq. 1-2 (s b h (34 + 5 a s / h) bytes per layer in 16-bit),
    re-derived here term by term for SwiGLU/GQA and for the residuals ``jax.vjp`` keeps in our
    runtime (see :func:`layer_activation_bytes`).
"""
from __future__ import annotations

from typing import Any

__all__ = ["BACKWARD_FLOPS_FACTOR", "layer_flops", "embed_flops", "head_flops", "stage_flops", "layer_params",
           "embed_params", "head_params", "stage_params", "layer_params_per_device", "stage_params_per_device",
           "layer_activation_bytes", "head_activation_bytes", "stage_input_bytes", "logits_bytes", "dtype_bytes", "kv_sharded",
           "vocab_sharded"]

#: backward FLOPs / forward FLOPs (Narayanan et al. 2021, section 5.1)
BACKWARD_FLOPS_FACTOR = 2.0

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (``"float32"``: 4, ``"bfloat16"``/``"float16"``: 2).

    Raises:
      ValueError: for another name.
    """
    try:
        return _DTYPE_BYTES[str(name)]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPE_BYTES)}") from None


def _dims(cfg: Any):
    h, k = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    dh = cfg.head_dim or cfg.hidden_size // h
    return cfg.hidden_size, h, k, dh, cfg.intermediate_size, cfg.vocab_size


def _check_tokens(tokens: float, seq_len: int) -> None:
    if tokens < 0 or seq_len < 1:
        raise ValueError(f"tokens must be >= 0 and seq_len >= 1, got tokens={tokens}, seq_len={seq_len}")


def layer_flops(cfg: Any, tokens: float, seq_len: int) -> float:
    """Forward FLOPs of ONE decoder layer for ``tokens`` tokens in sequences of ``seq_len``, summed
    over all TP shards (the whole layer's work).

    ``2 T D (H + 2K) Dh`` (q, k, v) + ``2 T H Dh D`` (o) + ``6 T D F`` (gate, up, down) +
    ``4 T s H Dh`` (scores q k^T and probs v over the full s x s matrix, as our attention computes
    it before the causal mask). Element-wise work (norms, RoPE, softmax, SiLU) is left out (< 1% for
    D >= 64 and s <= 4 D). Source: module docstring.

    Raises:
      ValueError: if ``tokens < 0`` or ``seq_len < 1``.
    """
    _check_tokens(tokens, seq_len)
    d, h, k, dh, f, _ = _dims(cfg)
    t = float(tokens)
    proj = 2 * t * d * (h + 2 * k) * dh + 2 * t * h * dh * d
    mlp = 6 * t * d * f
    attn = 4 * t * seq_len * h * dh
    return proj + mlp + attn


def embed_flops(cfg: Any, tokens: float) -> float:
    """Forward FLOPs of the token embedding: 0 (a gather; its cost is memory traffic, T D elements)."""
    return 0.0


def head_flops(cfg: Any, tokens: float) -> float:
    """Forward FLOPs of the final RMSNorm, LM head and summed softmax cross-entropy for ``tokens``.

    ``2 T D V`` (LM head matmul) + ``5 T V`` (cast, max, subtract, exp and sum of the log-sum-exp:
    about 5 operations per logit, an estimate) + ``4 T D`` (RMSNorm).
    """
    d, _, _, _, _, v = _dims(cfg)
    t = float(tokens)
    return 2 * t * d * v + 5 * t * v + 4 * t * d


def stage_flops(cfg: Any, first_layer: int, last_layer: int, is_first: bool, is_last: bool, tokens: float,
                seq_len: int) -> float:
    """Forward FLOPs of a stage (layers first_layer..last_layer inclusive, plus embedding / head)."""
    n = last_layer - first_layer + 1
    out = n * layer_flops(cfg, tokens, seq_len)
    if is_first:
        out += embed_flops(cfg, tokens)
    if is_last:
        out += head_flops(cfg, tokens)
    return out


# ---- parameters ------------------------------------------------------------------------------------

def layer_params(cfg: Any) -> int:
    """Parameters (count) of one decoder layer: ``D H Dh + 2 D K Dh + H Dh D + 3 D F + 2 D``."""
    d, h, k, dh, f, _ = _dims(cfg)
    return d * h * dh + 2 * d * k * dh + h * dh * d + 3 * d * f + 2 * d


def embed_params(cfg: Any) -> int:
    """Parameters of the token embedding, ``V D``."""
    d, *_, v = _dims(cfg)
    return v * d


def head_params(cfg: Any) -> int:
    """Parameters of the final norm and LM head that the model adds: ``D`` (norm) + ``D V`` (LM head)
    when untied, ``D`` when tied. With tied embeddings the LAST STAGE still holds its own copy of the
    ``V D`` embedding (``hethub_jax.models.llama.Llama``); :func:`stage_params` counts that copy."""
    d, *_, v = _dims(cfg)
    return d + (0 if cfg.tie_word_embeddings else d * v)


def stage_params(cfg: Any, first_layer: int, last_layer: int, is_first: bool, is_last: bool) -> int:
    """Parameters held by a stage (count): its layers, the embedding on the first stage, the norm and
    LM head on the last stage, and with tied embeddings the last stage's copy of the embedding (held
    once when one stage is both first and last)."""
    out = (last_layer - first_layer + 1) * layer_params(cfg)
    if is_first or (is_last and cfg.tie_word_embeddings):
        out += embed_params(cfg)
    if is_last:
        out += head_params(cfg)
    return out


def param_tensors(cfg: Any) -> dict[str, int]:
    """Parameter count of every tensor of the whole model, by the runtime's flat names
    (``hethub_jax.models.llama.Llama.param_table``: ``embed_tokens``, ``layers.{i}.self_attn.q_proj``,
    ..., ``norm``, ``lm_head`` when untied). Sums to ``stage_params`` of the whole model."""
    d, h, k, dh, f, v = _dims(cfg)
    layer = {"input_layernorm": d, "post_attention_layernorm": d, "self_attn.q_proj": d * h * dh,
             "self_attn.k_proj": d * k * dh, "self_attn.v_proj": d * k * dh, "self_attn.o_proj": h * dh * d,
             "mlp.gate_proj": d * f, "mlp.up_proj": d * f, "mlp.down_proj": f * d}
    out = {"embed_tokens": v * d}
    for i in range(cfg.num_hidden_layers):
        out.update({f"layers.{i}.{n}": c for n, c in layer.items()})
    out["norm"] = d
    if not cfg.tie_word_embeddings:
        out["lm_head"] = d * v
    return out


def stage_tensor_names(cfg: Any, first_layer: int, last_layer: int, is_first: bool, is_last: bool) -> list[str]:
    """Names (:func:`param_tensors`) of the tensors a stage holds: its layers, the embedding on the first
    stage and, when tied, on the last; the norm and LM head on the last."""
    names = [n for n in param_tensors(cfg) if n.startswith("layers.")
             and first_layer <= int(n.split(".")[1]) <= last_layer]
    if is_first or (is_last and cfg.tie_word_embeddings):
        names.append("embed_tokens")
    if is_last:
        names += ["norm"] + ([] if cfg.tie_word_embeddings else ["lm_head"])
    return names


def kv_sharded(cfg: Any, tp: int) -> bool:
    """True when TP splits the KV heads (``K % tp == 0``), else they are replicated (stage.py)."""
    return (cfg.num_key_value_heads or cfg.num_attention_heads) % tp == 0


def vocab_sharded(cfg: Any, tp: int) -> bool:
    """True when TP splits the vocabulary of the embedding and LM head (``V % tp == 0``, stage.py)."""
    return cfg.vocab_size % tp == 0


def layer_params_per_device(cfg: Any, tp: int) -> float:
    """Parameters of one layer on ONE device of a TP group of ``tp`` (stage.py layout: q, o, gate,
    up, down split; k, v split when ``K % tp == 0`` else replicated; norms replicated)."""
    d, h, k, dh, f, _ = _dims(cfg)
    kv = 2 * d * k * dh
    return (2 * d * h * dh + 3 * d * f) / tp + (kv / tp if kv_sharded(cfg, tp) else kv) + 2 * d


def stage_params_per_device(cfg: Any, first_layer: int, last_layer: int, is_first: bool, is_last: bool,
                            tp: int) -> float:
    """Parameters of a stage on ONE device (the DP axis replicates, TP splits as in stage.py)."""
    d, *_, v = _dims(cfg)
    vdiv = tp if vocab_sharded(cfg, tp) else 1
    out = (last_layer - first_layer + 1) * layer_params_per_device(cfg, tp)
    if is_first or (is_last and cfg.tie_word_embeddings):
        out += v * d / vdiv
    if is_last:
        out += d + (0 if cfg.tie_word_embeddings else d * v / vdiv)
    return out


# ---- activations -----------------------------------------------------------------------------------

def layer_activation_bytes(cfg: Any, tokens: float, seq_len: int, tp: int, recompute: str,
                           dtype_bytes: int) -> float:
    """Bytes kept per in-flight microbatch, per device, for ONE decoder layer.

    ``tokens`` is the microbatch's tokens on one DP rank (``microbatch_size / dp * seq_len``);
    ``dtype_bytes`` is the compute dtype's size (``a`` below; our attention keeps its scores and
    softmax in float32, counted as ``a`` too because the tiny preset computes in float32 -- an
    approximation for bf16 models, where those three terms are 4 bytes).

    ``recompute="none"``: the residuals ``jax.vjp`` of our layer keeps (``hethub_jax.models.llama``),
    the analogue of Korthikanti et al. 2022, eq. 1 (``s b h (34 + 5 a s / h)``) for SwiGLU/GQA,
    term by term (T tokens, s seq_len, TP splits heads and MLP as stage.py does):
      * ``7 T D a``: layer input, two RMSNorm inputs / outputs, the residual after attention, the
        inputs of q/k/v, gate/up and of the MLP's residual add (replicated over TP);
      * ``6 T F a / tp``: gate and up outputs, SiLU input / output, their product and down's input;
      * ``3 T s H a / tp + T s H / tp``: scores, exp and probabilities of the full s x s attention
        (float32) and the boolean causal mask; ``2 T H a / tp``: the softmax max and sum;
      * ``2 T H Dh a / tp`` (q and the attention output) + ``2 T K Dh a / kv_split`` (k, v);
      * ``4 T Dh a + 4 T a``: RoPE cos / sin broadcasts and RMSNorm statistics;
      * the layer's matrices in the compute dtype (``jax.vjp`` returns them as residuals: XLA writes
        a copy per saved microbatch), ``(layer_params_per_device - 2 D) a``.
    Checked against ``memory_analysis()`` of the compiled ``forward_saving`` in
    ``tests/test_predictor.py`` (within 10%).

    ``recompute="full"``: 0 per layer; the stage keeps only its input per microbatch
    (:func:`stage_input_bytes`), and one microbatch's residuals exist while its backward runs.

    Raises:
      ValueError: for an unknown recompute policy.
    """
    if recompute == "full":
        return 0.0
    if recompute != "none":
        raise ValueError(f"recompute must be 'none' or 'full', got {recompute!r}")
    _check_tokens(tokens, seq_len)
    d, h, k, dh, f, _ = _dims(cfg)
    t, a, s = float(tokens), dtype_bytes, seq_len
    kv_div = tp if kv_sharded(cfg, tp) else 1
    elems = (7 * t * d + 6 * t * f / tp + 3 * t * s * h / tp + 2 * t * h / tp + 2 * t * h * dh / tp
             + 2 * t * k * dh / kv_div + 4 * t * dh + 4 * t)
    weights = (layer_params_per_device(cfg, tp) - 2 * d) * a
    return elems * a + t * s * h / tp + weights


def head_activation_bytes(cfg: Any, tokens: float, tp: int, dtype_bytes: int) -> float:
    """Bytes the last stage's ``jax.vjp`` keeps per microbatch for the final norm, LM head and loss
    (recompute ``none``, and under either policy while a fused forward + backward runs): the float32 logits ``4 T V / v_split``, the LM
    head (or tied embedding) matrix in the compute dtype ``D V a / v_split`` and ``2 T D a`` of the
    final norm. Checked against ``memory_analysis()`` like :func:`layer_activation_bytes`."""
    d, *_, v = _dims(cfg)
    vdiv = tp if vocab_sharded(cfg, tp) else 1
    return 4.0 * tokens * v / vdiv + d * v * dtype_bytes / vdiv + 2.0 * tokens * d * dtype_bytes


def stage_input_bytes(cfg: Any, tokens: float, is_first: bool, dtype_bytes: int) -> float:
    """Bytes of a stage's input for one microbatch on one device: ``T D a`` (token ids, ``4 T``
    bytes of int32, on the first stage)."""
    return 4.0 * tokens if is_first else float(tokens) * cfg.hidden_size * dtype_bytes


def logits_bytes(cfg: Any, tokens: float, tp: int) -> float:
    """Bytes of the ``[microbatch, seq, vocab]`` logits on one device of the last stage, in float32
    (stage.py casts them for the loss), split over the vocabulary when TP divides it; x2 for the
    logits in the compute dtype kept beside them and their gradient of the same size."""
    vdiv = tp if vocab_sharded(cfg, tp) else 1
    return 2.0 * float(tokens) * cfg.vocab_size * 4 / vdiv
