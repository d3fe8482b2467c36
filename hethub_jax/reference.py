"""The unsplit single-device training step: the reference every parallel plan must reproduce.

No microbatches, no stages, no meshes: the whole model on one device, the mean token cross-entropy
over the global batch, `jax.value_and_grad`, and `optax.clip_by_global_norm` + AdamW
(`hethub_jax.optim.make_reference_optimizer`). Tests compare the pipeline runtime against it, and
`benchmarks/runtime_overhead.py` uses it as the plain `jax.jit` baseline.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hethub_jax.models.config import LlamaConfig
from hethub_jax.models.llama import Llama
from hethub_jax.models.loss import token_cross_entropy
from hethub_jax.optim import OptimConfig, make_reference_optimizer


class ReferenceTrainer:
    """Single-device trainer of the full model.

    Args:
      config: model config; optim: optimizer settings; seed: initialisation seed (the same seed gives
      the pipeline runtime's initial weights); device: JAX device (default the first).
    """

    def __init__(self, config: LlamaConfig, optim: OptimConfig, *, seed: int = 0, device: Any = None):
        device = device or jax.devices()[0]
        model = Llama(config, seed=seed)
        self._model = model
        graphdef, state = nnx.split(model)
        self.params = jax.device_put(nnx.to_pure_dict(state), device)
        self.tx = make_reference_optimizer(optim)
        self.opt_state = jax.device_put(self.tx.init(self.params), device)

        def loss_fn(params, batch):
            logits = nnx.merge(graphdef, params)(batch["tokens"])
            loss_sum, num_tokens = token_cross_entropy(logits, batch["targets"], batch["loss_mask"])
            return loss_sum / num_tokens

        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

        self._grad = jax.jit(jax.value_and_grad(loss_fn))
        self._step = jax.jit(step, donate_argnums=(0, 1))

    def train_step(self, batch: dict[str, np.ndarray]) -> tuple[float, float]:
        """One step on the whole batch; returns (mean loss, gradient global norm before clipping)."""
        self.params, self.opt_state, loss, norm = self._step(self.params, self.opt_state, _as_jnp(batch))
        return float(loss), float(norm)

    def gradients(self, batch: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        """(mean loss, flat name -> gradient), names as `Llama.param_table`."""
        loss, grads = self._grad(self.params, _as_jnp(batch))
        return float(loss), self._flat(grads)

    def flat_params(self) -> dict[str, np.ndarray]:
        return self._flat(self.params)

    def _flat(self, tree: Any) -> dict[str, np.ndarray]:
        from hethub_jax.parallel.stage import flat_name

        return {flat_name(p, 0): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def _as_jnp(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {"tokens": jnp.asarray(batch["tokens"], jnp.int32), "targets": jnp.asarray(batch["targets"], jnp.int32),
            "loss_mask": jnp.asarray(batch["loss_mask"], jnp.float32)}
