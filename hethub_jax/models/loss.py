"""The training loss: token cross-entropy of next-token logits, summed over the non-pad tokens.

Written once for the pipeline's last stage (`parallel/stage.py`, which needs the *sum* so that
gradients accumulate over microbatches and replicas) and the unsplit reference
(`reference.py`, which divides by the count for the mean). Pure JAX: no sharding, no communication.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed token cross-entropy in nats, number of counted tokens), both float32 scalars.

    ``ce[b, s] = logsumexp(logits[b, s]) - logits[b, s, targets[b, s]]`` (the negative log-likelihood
    of the target under ``softmax(logits[b, s])``), computed in float32 whatever the logits' dtype;
    the sum is ``sum(ce * mask)`` and the count ``sum(mask)``.

    Args:
      logits: ``[B, S, V]`` next-token logits (any float dtype).
      targets: ``[B, S]`` int32 target token ids in ``[0, V)``.
      mask: ``[B, S]`` float32 weights: 1 on tokens that count, 0 on pads and across document
        boundaries.
    """
    logits = logits.astype(jnp.float32)
    ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.sum(ce * mask), jnp.sum(mask)
