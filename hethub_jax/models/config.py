"""Llama model configuration with Hugging Face field meanings, validation and presets.

Field names and meanings follow `transformers.LlamaConfig`, so a HF `config.json` maps onto
`LlamaConfig` one to one (see `hethub_jax.models.hf`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from flax.core import FrozenDict

from hethub_jax.fields import from_dict_strict

_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-2/3 family decoder-only transformer.

    Attributes (HF `LlamaConfig` meanings):
      vocab_size: number of token ids.
      hidden_size: d_model, width of the residual stream.
      intermediate_size: width of the SwiGLU MLP.
      num_hidden_layers: number of decoder layers.
      num_attention_heads: query heads.
      num_key_value_heads: key/value heads (grouped-query attention); must divide the query heads.
      head_dim: per-head width; defaults to hidden_size // num_attention_heads.
      rope_theta: RoPE base (Su et al. 2021, "RoFormer", eq. 15: theta_i = base^(-2i/d)).
      rope_scaling: None or a dict with "rope_type" in {"default", "linear", "llama3"} and its
        parameters (Llama 3.1: factor, low_freq_factor, high_freq_factor,
        original_max_position_embeddings).
      rms_norm_eps: epsilon of RMSNorm (Zhang & Sennrich 2019).
      max_position_embeddings: longest sequence the model is configured for.
      tie_word_embeddings: LM head reuses the token embedding matrix.
      initializer_range: standard deviation of the normal initialiser of weight matrices.
      dtype: compute dtype ("float32", "bfloat16", "float16").
      param_dtype: dtype in which parameters are stored.

    Raises:
      ValueError: on construction, naming the field and the constraint that failed.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"LlamaConfig: num_attention_heads ({self.num_attention_heads}) must divide "
                    f"hidden_size ({self.hidden_size}) when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be an even integer >= 2 (RoPE rotates "
                             f"pairs), got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"LlamaConfig.rope_theta must be a positive number, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"LlamaConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            # FrozenDict keeps the config hashable (it is static data of jitted functions).
            object.__setattr__(self, "rope_scaling", FrozenDict(_check_rope_scaling(self.rope_scaling)))

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        """Builds a config from a dict of our field names; an unknown key raises ValueError."""
        return from_dict_strict(cls, d, "LlamaConfig")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = dict(d["rope_scaling"])
        return d

    def replace(self, **changes: Any) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (a count, not bytes), computed analytically from the shapes."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_hidden_layers * layer + d + head


def _check_rope_scaling(rs: Mapping[str, Any]) -> dict[str, Any]:
    rs = dict(rs)
    rope_type = rs.pop("rope_type", rs.pop("type", "default"))
    rs.pop("rope_theta", None)  # transformers>=5 keeps rope_theta inside rope_parameters
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"LlamaConfig.rope_scaling: rope_type {rope_type!r} is not supported; "
                         f"supported: {_ROPE_TYPES}")
    missing = _ROPE_KEYS[rope_type] - set(rs)
    if missing:
        raise ValueError(f"LlamaConfig.rope_scaling ({rope_type}) is missing {sorted(missing)}")
    extra = set(rs) - _ROPE_KEYS[rope_type]
    if extra:
        raise ValueError(f"LlamaConfig.rope_scaling ({rope_type}) has unknown key(s) {sorted(extra)}")
    if rope_type != "default" and not rs["factor"] > 0:
        raise ValueError(f"LlamaConfig.rope_scaling.factor must be > 0, got {rs['factor']!r}")
    if rope_type == "llama3" and not rs["high_freq_factor"] > rs["low_freq_factor"]:
        raise ValueError("LlamaConfig.rope_scaling: high_freq_factor must exceed low_freq_factor")
    return {"rope_type": rope_type, **rs}


# Presets. Sources: the HF config.json of meta-llama/Llama-2-7b-hf, Meta-Llama-3-8B and
# Meta-Llama-3-70B (Llama 3.1 adds the llama3 rope_scaling used below for the 3.x presets).
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, LlamaConfig] = {
    # CPU-trainable in minutes on the 32,000-token Llama-2-kind tokenizer (~2.6 M parameters,
    # most of them in the embedding and head).
    "tiny": LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=176,
                        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama2-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                             max_position_embeddings=4096, rms_norm_eps=1e-5, dtype="bfloat16",
                             param_dtype="float32"),
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                             rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE,
                             max_position_embeddings=131072, rms_norm_eps=1e-5, dtype="bfloat16"),
    "llama3-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                              rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE,
                              max_position_embeddings=131072, rms_norm_eps=1e-5, dtype="bfloat16"),
    # HF config.json of meta-llama/Llama-2-70b-hf.
    "llama2-70b": LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                              max_position_embeddings=4096, rms_norm_eps=1e-5, dtype="bfloat16"),
    # HF config.json of meta-llama/Llama-3.1-405B.
    "llama3-405b": LlamaConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                               num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                               rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE,
                               max_position_embeddings=131072, rms_norm_eps=1e-5, dtype="bfloat16"),
    # ~139 B-parameter Llama-shaped model standing in for HETHUB's "Llama-140B" (arXiv 2405.16256),
    # whose exact dimensions are not given there. OUR ASSUMPTION: d_model 12288, SwiGLU width 32768,
    # 90 layers, 96 query / 8 KV heads (head_dim 128), Llama-2 vocabulary (32000), untied head.
    "llama-140b": LlamaConfig(vocab_size=32000, hidden_size=12288, intermediate_size=32768,
                              num_hidden_layers=90, num_attention_heads=96, num_key_value_heads=8,
                              max_position_embeddings=4096, rms_norm_eps=1e-5, dtype="bfloat16"),
}


def get_preset(name: str) -> LlamaConfig:
    """Returns the named preset; raises ValueError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
