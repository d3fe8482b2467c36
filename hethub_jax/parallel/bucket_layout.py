"""Layer buckets of the bucketed gradient all-reduce, JAX-free (issue 17).

The ONE place of the rule that cuts a one-stage replica's layers into gradient buckets: the runtime's
`hethub_jax.parallel.buckets.StageChunks` compiles these chunks, and the predictor's bucketed step
(`hethub_jax.planner.predict_buckets`) times their gradients' readiness from the same cut. Plain Python
(the planner runs without JAX).
"""

from __future__ import annotations

__all__ = ["layer_chunks"]


def layer_chunks(layer_bytes: list[int], first_layer: int, head_bytes: int, bucket_bytes: int,
                 first_bucket_bytes: int) -> list[tuple[int, int]]:
    """Cuts a stage's layers into buckets, walking from the last layer down.

    Args:
      layer_bytes: gradient bytes of each layer of the stage, in layer order.
      first_layer: global index of the stage's first layer.
      head_bytes: bytes reduced with the first bucket besides its layers (final norm, LM head, the
        dense part of the embedding gradient).
      bucket_bytes, first_bucket_bytes: a bucket closes once it holds at least this many bytes
        (the first bucket at ``first_bucket_bytes``); every bucket holds at least one layer.

    Returns:
      Inclusive global layer ranges ``(a, b)`` in backward order (last layers first).

    Raises:
      ValueError: if a cap is not positive or there are no layers.
    """
    if bucket_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError(f"bucket sizes must be > 0 bytes, got {bucket_bytes} and {first_bucket_bytes}")
    if not layer_bytes:
        raise ValueError("a stage has at least one layer")
    last = first_layer + len(layer_bytes) - 1
    chunks, hi, size, cap = [], last, head_bytes, first_bucket_bytes
    for i in range(last, first_layer - 1, -1):
        size += layer_bytes[i - first_layer]
        if size >= cap and i > first_layer:
            chunks.append((i, hi))
            hi, size, cap = i - 1, 0, bucket_bytes
    chunks.append((first_layer, hi))
    return chunks
