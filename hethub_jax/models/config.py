"""Llama model configuration with Hugging Face field meanings, validation and presets.

Field names and meanings follow `transformers.LlamaConfig`, so a HF `config.json` maps onto
`LlamaConfig` one to one (see `hethub_jax.models.hf`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from pydantic import model_validator

from hethub_jax.typed import Float, StrictModel, unknown_keys

__all__ = ["LlamaConfig", "RopeScaling", "PRESETS", "get_preset"]

_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


class RopeScaling(StrictModel):
    """RoPE frequency scaling (HF ``rope_scaling`` / ``rope_parameters``), frozen and hashable.

    Attributes:
      rope_type: "default" (none), "linear" (Chen et al. 2023, position interpolation: every frequency
        divided by ``factor``) or "llama3" (Llama 3.1 report, Meta 2024). Read from "rope_type" or the
        older "type"; a "rope_theta" key (transformers >= 5) is dropped (it is ``LlamaConfig.rope_theta``).
      factor: frequency divisor (> 0); "linear" and "llama3".
      low_freq_factor, high_freq_factor, original_max_position_embeddings: the llama3 band
        (``high_freq_factor > low_freq_factor``); "llama3" only.

    ``rs["factor"]`` reads a parameter as from the HF dict (``KeyError`` for one the type lacks);
    :meth:`to_dict` gives that dict back.

    Raises:
      ValueError: naming the key: unsupported type, a parameter missing or unknown for the type, a
        factor <= 0, ``high_freq_factor <= low_freq_factor``.
    """

    rope_type: str = "default"
    factor: Optional[Float] = None
    low_freq_factor: Optional[Float] = None
    high_freq_factor: Optional[Float] = None
    original_max_position_embeddings: Optional[int] = None

    @model_validator(mode="before")
    @classmethod
    def _keys_for_type(cls, d: Any) -> Any:
        if not isinstance(d, Mapping):
            return d
        d = dict(d)
        rope_type = d.pop("rope_type", d.pop("type", "default"))
        d.pop("rope_theta", None)  # transformers>=5 keeps rope_theta inside rope_parameters
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"LlamaConfig.rope_scaling: rope_type {rope_type!r} is not supported; "
                             f"supported: {_ROPE_TYPES}")
        missing = _ROPE_KEYS[rope_type] - set(d)
        if missing:
            raise ValueError(f"LlamaConfig.rope_scaling ({rope_type}) is missing {sorted(missing)}")
        extra = set(d) - _ROPE_KEYS[rope_type]
        if extra:
            raise ValueError(f"LlamaConfig.rope_scaling ({rope_type}) has unknown key(s) {sorted(extra)}")
        return {"rope_type": rope_type, **d}

    @model_validator(mode="after")
    def _values(self) -> "RopeScaling":
        if self.rope_type != "default" and not self.factor > 0:
            raise ValueError(f"LlamaConfig.rope_scaling.factor must be > 0, got {self.factor!r}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("LlamaConfig.rope_scaling: high_freq_factor must exceed low_freq_factor")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The HF form: ``{"rope_type": ..., <the type's parameters>}``."""
        return self.model_dump(exclude_none=True)

    def __getitem__(self, key: str) -> Any:
        d = self.to_dict()
        if key not in d:
            raise KeyError(key)
        return d[key]


class LlamaConfig(StrictModel):
    """Architecture of a Llama-2/3 family decoder-only transformer (frozen, hashable: it is static
    data of jitted functions). Importing this module imports no JAX.

    Attributes (HF `LlamaConfig` meanings):
      vocab_size: number of token ids.
      hidden_size: d_model, width of the residual stream.
      intermediate_size: width of the SwiGLU MLP.
      num_hidden_layers: number of decoder layers.
      num_attention_heads: query heads.
      num_key_value_heads: key/value heads (grouped-query attention); must divide the query heads;
        ``None`` on input: equal to the query heads.
      head_dim: per-head width; ``None`` on input: hidden_size // num_attention_heads.
      rope_theta: RoPE base (Su et al. 2021, "RoFormer", eq. 15: theta_i = base^(-2i/d)).
      rope_scaling: None or a :class:`RopeScaling` (given as the HF dict: "rope_type" in {"default",
        "linear", "llama3"} and its parameters; Llama 3.1: factor, low_freq_factor,
        high_freq_factor, original_max_position_embeddings).
      rms_norm_eps: epsilon of RMSNorm (Zhang & Sennrich 2019).
      max_position_embeddings: longest sequence the model is configured for.
      tie_word_embeddings: LM head reuses the token embedding matrix.
      initializer_range: standard deviation of the normal initialiser of weight matrices.
      dtype: compute dtype ("float32", "bfloat16", "float16").
      param_dtype: dtype in which parameters are stored.

    Raises:
      ValueError: on construction, naming the field and the constraint that failed (a wrong type:
        ``hethub_jax.typed.FieldTypeError``, also a ``TypeError``).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rope_theta: Float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: Float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: Float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"

    @model_validator(mode="after")
    def _check(self) -> "LlamaConfig":
        fill = self.__dict__  # frozen: derived defaults are filled once, while validating
        if self.num_key_value_heads is None:
            fill["num_key_value_heads"] = self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"LlamaConfig: num_attention_heads ({self.num_attention_heads}) must divide "
                    f"hidden_size ({self.hidden_size}) when head_dim is not given")
            fill["head_dim"] = self.hidden_size // self.num_attention_heads
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be an even integer >= 2 (RoPE rotates "
                             f"pairs), got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})")
        if not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig.rope_theta must be a positive number, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"LlamaConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")
        return self

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        """Builds a config from a dict of our field names (``rope_scaling`` as the HF dict).

        Raises:
          ValueError: for unknown keys (all named: ``unknown LlamaConfig key(s) [...]``) or as the
            constructor."""
        unknown_keys(cls, d, "LlamaConfig")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Every field; ``rope_scaling`` as the HF dict (or None). ``LlamaConfig.from_dict`` of it
        gives an equal config."""
        d = self.model_dump()
        d["rope_scaling"] = None if self.rope_scaling is None else self.rope_scaling.to_dict()
        return d

    def replace(self, **changes: Any) -> "LlamaConfig":
        """A copy with ``changes``, validated again (derived ``head_dim`` / ``num_key_value_heads``
        are kept unless changed, as ``dataclasses.replace``)."""
        return LlamaConfig.from_dict(self.to_dict() | changes)

    def num_params(self) -> int:
        """Parameter count (a count, not bytes), computed analytically from the shapes."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_hidden_layers * layer + d + head


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
