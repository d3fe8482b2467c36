"""Optimizer set-up shared by the pipeline runtime and the single-device reference (optax).

The runtime clips gradients by the *global* norm over all pipeline stages itself (the norm needs a
reduction across stages and islands), with the same formula as `optax.clip_by_global_norm`; every
stage then applies `make_optimizer` to its own parameters. The reference chains
`optax.clip_by_global_norm` in front of the same optimizer, so both compute the same update.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import optax
from pydantic import model_validator

from hethub_jax.typed import Float, StrictModel, unknown_keys


class OptimConfig(StrictModel):
    """AdamW with linear warm-up and cosine decay (Loshchilov & Hutter 2019; 2017).

    Attributes:
      learning_rate: peak learning rate.
      warmup_steps: optimizer steps of linear warm-up from 0 to the peak.
      decay_steps: steps from 0 until the cosine reaches `min_lr_ratio * learning_rate`
        (usually the run length).
      min_lr_ratio: final learning rate as a fraction of the peak.
      weight_decay: decoupled weight decay, applied to matrices (ndim >= 2) only.
      b1, b2, eps: Adam moments and epsilon.
      grad_clip_norm: clip the global gradient L2 norm to this value; None disables clipping.

    Raises:
      ValueError: on construction, naming the field (``optim.<field>``) and the constraint.
    """

    learning_rate: Float = 3e-3
    warmup_steps: int = 20
    decay_steps: int = 200
    min_lr_ratio: Float = 0.1
    weight_decay: Float = 0.1
    b1: Float = 0.9
    b2: Float = 0.95
    eps: Float = 1e-8
    grad_clip_norm: Optional[Float] = 1.0

    @model_validator(mode="after")
    def _check(self) -> "OptimConfig":
        if not self.learning_rate > 0:
            raise ValueError(f"optim.learning_rate must be > 0, got {self.learning_rate}")
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise ValueError(f"optim.warmup_steps must be >= 0 and decay_steps >= 1, got "
                             f"{self.warmup_steps}, {self.decay_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ValueError(f"optim.grad_clip_norm must be > 0 or null, got {self.grad_clip_norm}")
        return self

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OptimConfig":
        """``OptimConfig(**d)``; raises ValueError naming unknown keys (``unknown optim key(s)``)."""
        unknown_keys(cls, d, "optim")
        return cls(**d)


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Step -> learning rate: linear warm-up then cosine decay to `min_lr_ratio * peak`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.decay_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW on one stage's parameters (any pytree); no clipping (see module docstring)."""
    return optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay,
                       mask=lambda params: jax.tree.map(lambda x: x.ndim >= 2, params))


def make_reference_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Clipping by global norm (optax) followed by `make_optimizer`: the unsplit model's optimizer."""
    if cfg.grad_clip_norm is None:
        return make_optimizer(cfg)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), make_optimizer(cfg))


def clip_by_norm(tree: Any, global_norm: jax.Array, max_norm: float | None) -> Any:
    """Scales `tree` as `optax.clip_by_global_norm` does, given the global norm computed elsewhere:
    unchanged if `global_norm < max_norm`, else `t / global_norm * max_norm`."""
    if max_norm is None:
        return tree
    keep = global_norm < max_norm
    return jax.tree.map(lambda t: jax.lax.select(keep, t, (t / global_norm.astype(t.dtype)) * max_norm), tree)
