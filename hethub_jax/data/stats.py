"""Statistics of token streams."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hethub_jax.data._common import check_positive_int

def unigram_entropy(token_ids: Sequence[int] | np.ndarray, vocab_size: int) -> float:
    """Entropy in nats/token of the maximum-likelihood unigram distribution of ``token_ids``.

    ``H = -sum_v p_v log p_v`` with ``p_v = count_v / N``. This is the cross-entropy of the best
    context-free model fitted to these very tokens: a language model whose loss on them is lower
    has learned to use context. Uniform use of ``k`` distinct ids gives ``log k``.

    Args:
      token_ids: integer ids, any shape (flattened).
      vocab_size: ids must lie in ``[0, vocab_size)``.

    Raises:
      ValueError: no ids, or an id outside ``[0, vocab_size)``.
    """
    ids = np.asarray(token_ids).reshape(-1)
    if ids.size == 0:
        raise ValueError("unigram_entropy: no token ids")
    vocab_size = check_positive_int("vocab_size", vocab_size)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"unigram_entropy: token ids must be integers, got dtype {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"unigram_entropy: ids span [{lo}, {hi}], outside [0, vocab_size={vocab_size})")
    counts = np.bincount(ids, minlength=vocab_size)
    p = counts[counts > 0] / ids.size
    return float(-(p * np.log(p)).sum())
