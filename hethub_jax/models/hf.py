"""Import of Hugging Face `transformers` Llama models and local checkpoints (config.json + safetensors).

Weight layout conversion (HF `nn.Linear.weight` is `[out, in]`):
  q/k/v_proj  [H*Dh, D] -> [D, H, Dh]      o_proj    [D, H*Dh] -> [H, Dh, D]
  gate/up     [F, D]    -> [D, F]          down_proj [D, F]    -> [F, D]
  lm_head     [V, D]    -> [D, V]          embed_tokens, norms unchanged.
torch is imported only by `from_transformers` (the caller already has a torch model).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from hethub_jax.models.config import LlamaConfig
from hethub_jax.models.llama import Llama

# HF config fields with no counterpart here that must hold these values for the import to be exact.
_REQUIRED_HF_VALUES = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                       "pretraining_tp": 1}
_DIRECT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                  "max_position_embeddings", "tie_word_embeddings", "initializer_range")


def config_from_hf(hf_config: Any, **overrides: Any) -> LlamaConfig:
    """`LlamaConfig` from a HF `LlamaConfig` object or its `config.json` dict.

    Reads `rope_theta`/`rope_scaling` (transformers < 5) or `rope_parameters` (transformers >= 5).

    Raises:
      ValueError: if the HF model is not a Llama this package reproduces exactly (naming the field:
        model_type, hidden_act, attention_bias, mlp_bias, pretraining_tp), or a value is invalid.
    """
    d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    if d.get("model_type", "llama") != "llama":
        raise ValueError(f"HF config field model_type is {d['model_type']!r}; only 'llama' is supported")
    for field, value in _REQUIRED_HF_VALUES.items():
        if field in d and d[field] != value:
            raise ValueError(f"HF config field {field}={d[field]!r} is not supported (needs {value!r})")
    kw = {k: d[k] for k in _DIRECT_FIELDS if d.get(k) is not None}
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    rope = dict(rope) if rope else {}
    kw["rope_theta"] = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope.pop("partial_rotary_factor", None)
    if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
        kw["rope_scaling"] = rope
    kw.update(overrides)
    return LlamaConfig(**kw)


def params_from_hf(state: Mapping[str, Any], config: LlamaConfig,
                   layers: Iterable[int] | None = None) -> dict[str, np.ndarray]:
    """Converts HF tensor names/layouts to this package's flat names (see `Llama.param_table`).

    Args:
      state: HF names ("model.layers.3.mlp.up_proj.weight", ...) -> arrays (numpy, torch or jax).
      config: the model config (for head counts).
      layers: global layer indices to convert (default all); embedding/head always if present.

    Raises:
      ValueError: naming the HF tensor, if one needed is missing or has the wrong shape.
    """
    c = config
    d, h, k, dh, f, v = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.intermediate_size, c.vocab_size)

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in state:
            raise ValueError(f"HF tensor {name!r} is missing from the checkpoint")
        x = _to_numpy(state[name])
        if tuple(x.shape) != shape:
            raise ValueError(f"HF tensor {name!r} has shape {tuple(x.shape)}, expected {shape} "
                             f"for the given config")
        return x

    out: dict[str, np.ndarray] = {}
    if "model.embed_tokens.weight" in state:
        out["embed_tokens"] = get("model.embed_tokens.weight", (v, d))
    if "model.norm.weight" in state:
        out["norm"] = get("model.norm.weight", (d,))
    if not c.tie_word_embeddings and "lm_head.weight" in state:
        out["lm_head"] = get("lm_head.weight", (v, d)).T
    for i in (range(c.num_hidden_layers) if layers is None else layers):
        p, g = f"model.layers.{i}", f"layers.{i}"
        out[f"{g}.input_layernorm"] = get(f"{p}.input_layernorm.weight", (d,))
        out[f"{g}.post_attention_layernorm"] = get(f"{p}.post_attention_layernorm.weight", (d,))
        out[f"{g}.self_attn.q_proj"] = get(f"{p}.self_attn.q_proj.weight", (h * dh, d)).T.reshape(d, h, dh)
        out[f"{g}.self_attn.k_proj"] = get(f"{p}.self_attn.k_proj.weight", (k * dh, d)).T.reshape(d, k, dh)
        out[f"{g}.self_attn.v_proj"] = get(f"{p}.self_attn.v_proj.weight", (k * dh, d)).T.reshape(d, k, dh)
        out[f"{g}.self_attn.o_proj"] = get(f"{p}.self_attn.o_proj.weight", (d, h * dh)).T.reshape(h, dh, d)
        out[f"{g}.mlp.gate_proj"] = get(f"{p}.mlp.gate_proj.weight", (f, d)).T
        out[f"{g}.mlp.up_proj"] = get(f"{p}.mlp.up_proj.weight", (f, d)).T
        out[f"{g}.mlp.down_proj"] = get(f"{p}.mlp.down_proj.weight", (d, f)).T
    return out


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor; bf16 has no numpy dtype -> via float32 is exact
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.float().numpy().astype(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(x)


def _build(config: LlamaConfig, state: Mapping[str, Any], first_layer: int, last_layer: int | None) -> Llama:
    model = Llama(config, first_layer=first_layer, last_layer=last_layer)
    model.load_params(params_from_hf(state, config, range(model.first_layer, model.last_layer + 1)))
    return model


def from_transformers(hf_model: Any, *, first_layer: int = 0, last_layer: int | None = None,
                      **config_overrides: Any) -> Llama:
    """Our `Llama` (or the stage [first_layer, last_layer]) with the weights of a HF `LlamaForCausalLM`.

    `config_overrides` sets e.g. `dtype`/`param_dtype`. Raises ValueError as `config_from_hf` and
    `params_from_hf`.
    """
    config = config_from_hf(hf_model.config, **config_overrides)
    return _build(config, hf_model.state_dict(), first_layer, last_layer)


class _LazySafetensors(Mapping):
    """Read-only mapping over the tensors of one or more .safetensors files, loaded on access."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._handles = [safe_open(str(p), framework="flax") for p in files]
        self._where = {name: hnd for hnd in self._handles for name in hnd.keys()}

    def __getitem__(self, name: str) -> Any:
        return np.asarray(self._where[name].get_tensor(name))

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_hf_checkpoint(path: str | os.PathLike, *, first_layer: int = 0, last_layer: int | None = None,
                       **config_overrides: Any) -> Llama:
    """Builds our model (or one stage of it) from a local HF checkpoint directory.

    The directory holds `config.json` and `model.safetensors` or sharded `*.safetensors` files (with or
    without `model.safetensors.index.json`). Only the tensors of the requested layer range are read.

    Raises:
      FileNotFoundError: naming the path, if config.json or the safetensors files are missing.
      ValueError: as `config_from_hf` / `params_from_hf` (field or tensor named).
    """
    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"HF checkpoint: {cfg_path} not found")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"HF checkpoint: no *.safetensors files in {root}")
    config = config_from_hf(json.loads(cfg_path.read_text()), **config_overrides)
    return _build(config, _LazySafetensors(files), first_layer, last_layer)
