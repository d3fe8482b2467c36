"""Vectorised lower bounds of every pipeline configuration (one choice of stage count, TP and DP per group)
for the planner's search (numpy, no JAX).

For one microbatch size, recompute policy and schedule, each group ``g`` offers choices ``(k, tp, dp)``;
a configuration takes one per group. :func:`configuration_bounds` bounds the step time of every pipeline of
a configuration from below, whatever the group order and the layer split, for all configurations at once
(the product of the groups' choices, as numpy arrays), from per-choice figures:

* ``w``: a lower bound of one layer's F + B seconds per microbatch on the choice's stages;
* ``K``: a lower bound of the island's per-microbatch seconds that do not grow with its layers (its ``k``
  stages' constant parts and host copies);
* ``cap``: an upper bound of the layers the choice's ``k`` stages hold in memory.

The island of group ``g`` holding ``n_g`` layers computes at least ``M (K_g + n_g w_g)`` per step (it runs
its stages one action at a time), with ``n_g <= cap_g`` and ``sum_g n_g = L``; the least largest island
load over such splits (water filling) is a bound. Microbatch 0 passes every stage forward and backward and
crosses at least ``G - 1`` group boundaries each way: ``sum_g K_g + L min_g w_g + R``; under 1F1B every
round of ``S`` microbatches waits for such a round trip at stage 0 (``search_bounds.cycle_bound``), so it
counts ``ceil(M / S)`` times. Under GPipe an island's last stage runs all its forwards before its first
backward, which waits for the round trip through the later stages, and the island's first action waits for
the earlier ones (``search_bounds.process_bound``): at every position in the order the island's load is
accompanied by at least ``G - 1`` crossings each way, so the island term gains the crossings' seconds;
and the process bound's fill and drain also hold one microbatch's F + B of every OTHER island (before the
island: its forwards and, after the island's last backward, its backwards; after it: the round trip), so
the step is at least ``max_g (M load_g + sum_{h != g} load_h) + R >= (M - 1) max_g load_g + sum_h load_h +
R``, bounded by ``(M - 1)`` x the water filling plus the chain (the least sum of the loads).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["configuration_bounds", "water_fill"]


def water_fill(K: np.ndarray, w: np.ndarray, cap: np.ndarray, L: int, iters: int = 40) -> np.ndarray:
    """Per configuration (rows), a lower bound of ``min over n of max_g (K_g + n_g w_g)`` subject to
    ``1 <= n_g <= cap_g`` (integers) and ``sum_g n_g = L``: the larger of ``max_g (K_g + w_g)`` and the
    minimum over real ``0 <= n_g <= cap_g``; ``K, w, cap``: arrays of shape ``(N, G)``, ``w >= 0``
    (``w = 0``: the group's island takes ``cap`` layers at no cost beyond ``K``). Bisection on the level
    ``T`` (the held layers ``sum_g clip((T - K_g) / w_g, 0, cap_g)`` grow with ``T``) from ``max_g (K_g + w_g)``
    (only on the feasible rows); returns the lower end of the final bracket, so the value never exceeds the
    exact minimum. ``inf`` where ``sum cap < L`` or a
    group holds no layer (every group of a pipeline holds >= 1)."""
    K, w, cap = (np.asarray(a, dtype=float) for a in (K, w, cap))
    out = np.full(K.shape[0], np.inf)
    rows = np.nonzero((cap.sum(axis=1) >= L) & (cap >= 1).all(axis=1))[0]  # every group holds >= 1 layer
    if rows.size == 0:
        return out
    K, w, cap = K[rows], w[rows], cap[rows]
    floor = (K + w).max(axis=1)  # the answer is at least this: start the bracket there
    lo = floor.copy()
    hi = np.maximum(np.max(K + cap * w, axis=1), lo) + 1e-300
    pos = w > 0
    fast = bool(pos.all())
    with np.errstate(divide="ignore"):
        inv = np.where(pos, 1.0 / w, 0.0)
    buf = np.empty_like(K)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if fast:
            np.subtract(mid[:, None], K, out=buf)
            buf *= inv
        else:  # w = 0: the island holds cap layers once the level reaches K
            buf = np.where(pos, (mid[:, None] - K) * inv, np.where(mid[:, None] >= K, np.inf, 0.0))
        np.clip(buf, 0.0, cap, out=buf)
        ok = buf.sum(axis=1) >= L
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid)
    out[rows] = np.maximum(lo, floor)
    return out


def configuration_bounds(per_group: Sequence[dict], L: int, M: int, schedule: str, round_trip: float,
                         orders: bool = True) -> np.ndarray:
    """Lower bounds (seconds) of the step time of every configuration, flattened in C order over the
    groups' choices (``np.unravel_index`` with the choice counts recovers them); ``inf`` where the
    groups cannot hold the ``L`` layers.

    Args:
      per_group: per group (cluster order), arrays ``k``, ``w``, ``K``, ``cap`` over its choices (see the
        module docstring; same length per group).
      L: decoder layers; M: microbatches per step.
      schedule: ``"1f1b"`` (the cycle factor applies) or another schedule.
      round_trip: lower bound of the delivery seconds on microbatch 0's round trip (the crossings).
      orders: under 1F1B also the per-order cycle terms (:func:`order_cycle_bounds`); without them every
        term is nondecreasing in ``K``, ``w`` and nonincreasing in ``k``, ``cap``.
    """
    G = len(per_group)
    sizes = [len(pg["k"]) for pg in per_group]
    grids = {}
    for name in [n for n in ("k", "w", "K", "cap", "own") if n in per_group[0]]:
        cols = []
        for j, pg in enumerate(per_group):
            shape = [1] * G
            shape[j] = sizes[j]
            cols.append(np.broadcast_to(np.asarray(pg[name], dtype=float).reshape(shape), sizes).reshape(-1))
        grids[name] = np.stack(cols, axis=1)
    k, w, K, cap = grids["k"], grids["w"], grids["K"], grids["cap"]
    wf = water_fill(K, w, cap, L)
    chain = K.sum(axis=1) + L * w.min(axis=1) + round_trip
    if schedule == "gpipe":  # search_bounds.process_bound: the island's M loads + every other island once
        return np.maximum(M * wf + round_trip, chain + ((M - 1) * wf if M > 1 else 0.0))  # no 0 x inf
    if schedule == "1f1b":
        chain = chain * np.ceil(M / k.sum(axis=1))
        live = np.nonzero(np.isfinite(wf))[0]  # only configurations that fit memory
        if orders and G <= 5 and live.size:
            d = round_trip / max(1, 2 * (G - 1))
            own = grids["own"][live] if "own" in grids else w[live]
            chain[live] = np.maximum(chain[live], order_cycle_bounds(k[live], (K + k * w)[live], own, M, d).min(axis=1))
    return np.maximum(M * wf, chain)


def order_cycle_bounds(k: np.ndarray, load: np.ndarray, own: np.ndarray, M: int, d: float) -> np.ndarray:
    """1F1B lower bounds (seconds) per configuration (rows) and pipeline order (columns, in
    ``itertools.permutations(range(G))`` order): :func:`search_bounds.cycle_bound` at the LAST stage ``b``
    of the island at each position ``p < G - 1``: ``head_b + ceil(M / (S - b)) C_b`` with ``S - b = 1 +``
    the stages after the island, ``C_b >= 2 (G - 1 - p) d +`` stage ``b``'s own F + B (``own``) and the
    later islands' least one-microbatch compute, and ``head_b >= 2 p d +`` the earlier islands' (every
    crossing both ways costs at least ``d`` seconds of delivery each way).

    Args:
      k: stage counts, shape ``(N, G)``; load: per island a lower bound of one microbatch's F + B with host
        copies over its stages (``K + k w``: every stage holds >= 1 layer), ``(N, G)``; M: microbatches;
      own: per island, a lower bound of ONE of its stages' F + B with host copies (a stage holds >= 1
        layer and RECVs at least once), ``(N, G)``; d: least delivery seconds of one message over any
        group pair."""
    import itertools
    N, G = k.shape
    perms = list(itertools.permutations(range(G)))
    out = np.zeros((N, len(perms)))
    for c, perm in enumerate(perms):
        kp, lp, op = k[:, list(perm)], load[:, list(perm)], own[:, list(perm)]
        after_k = np.cumsum(kp[:, ::-1], axis=1)[:, ::-1]   # stages at positions >= p
        after_l = np.cumsum(lp[:, ::-1], axis=1)[:, ::-1]
        before = np.cumsum(lp, axis=1) - lp                  # load at positions < p
        for q in range(G - 1):
            cyc = 2 * (G - 1 - q) * d + after_l[:, q + 1] + op[:, q]
            v = 2 * q * d + before[:, q] + np.ceil(M / (1 + after_k[:, q + 1])) * cyc
            np.maximum(out[:, c], v, out=out[:, c])
    return out
