"""Closed-form lower bounds of a pipeline's makespan used by the planner's branch and bound (pure Python).

:func:`cycle_bound` is the 1F1B steady-state bound: with at most ``S - b`` microbatches in flight on stage
``b``, every microbatch waits for its own round trip through the stages after ``b`` (compute, host copies
and bridge deliveries both ways) before stage ``b`` may start the forward of the microbatch ``S - b``
later. When bridge deliveries dominate (``docs/benchmarks.md``, the 16,384-accelerator case) this is
within a few percent of the makespan, where the per-stage and per-island loads are far below it.

:class:`SplitBounds` evaluates the same bound, and the per-stage and per-island bounds of
``search.island_bound``, on a PARTIAL layer split (the first groups of the pipeline fixed): the stages
after the prefix are bounded by their host copies and deliveries (known once the configuration is: they do
not depend on the split) and a linear lower bound of their compute.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

__all__ = ["cycle_bound", "process_bound", "suffix_minimax", "SplitBounds", "joint_suffix_bounds",
           "joint_group_step", "terminal_suffix"]

_DIFF: dict = {}


def suffix_minimax(group_times: Sequence[Sequence[float]], num_layers: int) -> List[List[float]]:
    """``R[j][x]``: the least largest island compute when groups ``j..G-1`` (pipeline order) hold ``x``
    layers in all, each island ``g`` taking ``group_times[g][n]`` seconds per microbatch at ``n`` layers
    (``search._Planner.group_tables``: nondecreasing in ``n``, ``inf`` where ``n`` is below its stage count or
    a stage exceeds memory); ``inf`` where no split fits. Exact, by ``R[j][x] = min_n max(t_j[n],
    R[j+1][x - n])`` with numpy over all ``x`` at once (``(L + 1)^2`` per group). Every island runs its
    stages one action at a time, so a split whose groups ``j..`` hold ``x`` layers takes at least ``M R[j][x]``
    (``search.island_bound``): the best-first search bounds a partial split's remaining groups with it."""
    import numpy as np
    L = num_layers
    if L not in _DIFF:
        x, n = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
        _DIFF[L] = (np.where(n <= x, x - n, 0), n > x)
    diff, beyond = _DIFF[L]
    G = len(group_times)
    out: List[List[float]] = [None] * G  # type: ignore[list-item]
    r = np.asarray(group_times[G - 1][:L + 1], dtype=float)
    out[G - 1] = r.tolist()
    for j in range(G - 2, -1, -1):
        t = np.asarray(group_times[j][:L + 1], dtype=float)
        m = np.maximum(t[None, :], r[diff])
        m[beyond] = np.inf
        r = m.min(axis=1)
        out[j] = r.tolist()
    return out


def cycle_bound(num_microbatches: int, fw: Sequence[float], bw: Sequence[float], act: Sequence[float],
                grad: Sequence[float]) -> float:
    """Lower bound (seconds) of the 1F1B makespan (``pipeline_time.makespan(\"1f1b\", ...)``, hence of
    ``predict``'s pipeline seconds, which only add waiting) with per-stage action times.

    Args:
      num_microbatches: M >= 1.
      fw, bw: per stage (S entries), seconds of one microbatch's F and B (with their host copies).
      act, grad: per stage boundary (S - 1 entries), activation / gradient delivery seconds.

    Derivation (1F1B as ``parallel.schedule.one_f_one_b``: stage ``b`` runs its ``B`` of microbatch ``m``
    before its ``F`` of microbatch ``m + S - b``): let ``C_b = sum_{t>=b} (F_t + B_t) + sum_{t=b}^{S-2}
    (act_t + grad_t)`` (microbatch ``m``'s round trip from the end of ``F_b(m)`` to the end of ``B_b(m)``,
    plus ``F_b``). Then ``end F_b(m + S - b) >= end F_b(m) + C_b``; with ``M - 1 = j (S - b) + r``,
    ``end B_b(M - 1) >= head_b + (j + 1) C_b`` where ``head_b = sum_{t<b} (F_t + act_t)`` delays the first
    forward, and the backward of microbatch ``M - 1`` still passes stages ``b-1..0`` (``sum_{t<b} (B_t +
    grad_t)``). Hence ``makespan >= max_b (sum_{t<b} (F_t + B_t + act_t + grad_t) + ceil(M / (S - b)) C_b)``;
    for ``b = S - 1`` this is the last stage's ``M (F + B)`` plus the fill and drain.
    """
    S, M = len(fw), num_microbatches
    suffix = [0.0] * S
    c = 0.0
    for b in range(S - 1, -1, -1):
        c += fw[b] + bw[b] + (act[b] + grad[b] if b < S - 1 else 0.0)
        suffix[b] = c
    best, head = 0.0, 0.0
    for b in range(S):
        v = head + -(-M // (S - b)) * suffix[b]
        if v > best:
            best = v
        head += fw[b] + bw[b] + (act[b] + grad[b] if b < S - 1 else 0.0)
    return best


def process_bound(schedule: str, stages: Sequence[int], M: int, fw: Sequence[float], bw: Sequence[float],
                  act: Sequence[float], grad: Sequence[float]) -> float:
    """Lower bound (seconds) of ``predict``'s pipeline seconds when each group (island) runs its ``stages[j]``
    consecutive stages from ONE process, one action at a time (``predict(concurrency="runtime")``), for
    GPipe and 1F1B; at least ``search.island_bound``.

    Args:
      schedule: ``"gpipe"`` or ``"1f1b"`` (``parallel.schedule``; any other name gives the island bound).
      stages: stage count per group in pipeline order (sum S); M: microbatches.
      fw, bw: per stage, seconds of one microbatch's F and B with their host copies (S entries).
      act, grad: per stage boundary (S - 1 entries), activation / gradient delivery seconds.

    Derivation, island ``I`` holding stages ``f..l``: let ``X`` be the start of stage ``l``'s first backward
    slot (its RECV_GRAD; the process starts a RECV only once delivered). Every backward slot of ``I``
    (``RECV_GRAD``, ``B``, ``SEND_GRAD`` of every microbatch on every stage of ``I``) starts at or after ``X``
    (stage ``s < l`` of ``I`` needs stage ``s + 1``'s backward of the same microbatch; stage ``l`` runs its
    backwards in list order) and ends by the end of stage ``f``'s last backward slot, after which that
    microbatch's backwards and gradient deliveries of stages ``f-1..0`` still run (``tail``). The process
    runs one action at a time, so the pipeline takes at least ``tail + max(head + M sum_I (F + B), X + M
    sum_I B)`` where ``head = sum_{t<f} (F_t + act_t)`` (the island's first action waits for microbatch 0).
    ``X`` is at least microbatch 0's chain ``head_l + F_l + C_l`` with ``head_l = sum_{t<l} (F_t + act_t)`` and
    ``C_l = sum_{t>l} (F_t + B_t) + sum_{t=l}^{S-2} (act_t + grad_t)`` (through the later stages and back).
    GPipe: stage ``l`` runs all M forward slots before its first backward slot, and stage ``l + 1``'s first
    backward follows ITS last forward (and so on to the last stage), so ``X >= head + M sum_I F + C_l``
    (every forward slot of ``I`` precedes stage ``l``'s last one). 1F1B: stage ``l`` runs ``W = min(S - l, M)``
    forward slots before its first backward slot (``schedule.one_f_one_b``), each needing the same
    microbatch's forwards on the earlier stages of ``I``: ``X >= head + W sum_I F``. A fused last stage
    (``fw`` the fused F+B, ``bw`` 0) fits the same argument with its (empty) backward slot.
    """
    S = len(fw)
    after = [0.0] * S  # C_l: round trip after stage l
    for b in range(S - 2, -1, -1):
        after[b] = after[b + 1] + fw[b + 1] + bw[b + 1] + act[b] + grad[b]
    best, head, tail, s0 = 0.0, 0.0, 0.0, 0
    for k in stages:
        f, l = s0, s0 + k - 1
        F = sum(fw[f:l + 1])
        B = sum(bw[f:l + 1])
        head_l = head + sum(fw[t] + act[t] for t in range(f, l))
        x = head_l + fw[l] + after[l]
        if schedule == "gpipe":
            x = max(x, head + M * F + after[l])
        elif schedule == "1f1b":
            x = max(x, head + min(S - l, M) * F)
        else:
            x = 0.0
        v = tail + max(head + M * (F + B), x + M * B)
        if v > best:
            best = v
        for t in range(f, l + 1):
            if t < S - 1:
                head += fw[t] + act[t]
                tail += bw[t] + grad[t]
        s0 += k
    return best


def rest_lb(M: int, gpipe: bool, total_lb: float, rt_sum: float, island: float) -> float:
    """Lower bound of the pipeline seconds when some island computes ``island`` seconds per microbatch
    (F + B without copies): ``M island`` (it runs its stages one action at a time), under GPipe plus every
    crossing both ways (``rt_sum``) and, as :func:`process_bound`'s fill and drain, one microbatch's F + B of
    every other stage: ``(M - 1) island + total_lb`` (``SplitBounds.total_lb`` holds the island's own
    microbatch once)."""
    if gpipe:
        return max(M * island + rt_sum, (M - 1) * island + total_lb)
    return M * island


class SplitBounds:
    """Lower bounds of the step's pipeline seconds for every split that starts with a given prefix, for one
    configuration (pipeline order, stage counts, TP/DP degrees, microbatch size, schedule).

    Args:
      stages: stage count of each group in pipeline order (sum S).
      M: microbatches.
      copies: per stage, the host-copy seconds ``predict`` charges around its F and B per microbatch
        (independent of the split).
      delivery: per boundary (S - 1), bridge seconds of one message each way (0 inside an island).
      one_layer, slope: per stage, the compute seconds (F + B) at one layer and a lower bound of each
        further layer's (a stage's time is a line in its layer count: ``stage_lines``; 0 where unknown, a
        stage holding one layer at most); used only for stages after the prefix.
      cycle: apply :func:`cycle_bound`'s terms (1F1B only).
      gpipe: the island bound counts the round trip after the island (:func:`process_bound`; GPipe only).
      num_layers: L (0: unknown); with it ``total_lb`` is a lower bound of one microbatch's F + B with copies
        over all stages plus every crossing both ways, whatever the split (0 when L is unknown).
    """

    def __init__(self, stages: Sequence[int], M: int, copies: Sequence[float], delivery: Sequence[float],
                 one_layer: Sequence[float], slope: Sequence[float], cycle: bool, gpipe: bool = False,
                 num_layers: int = 0):
        self.stages, self.M, self.cycle, self.gpipe, self.L = list(stages), M, cycle, gpipe, num_layers
        S, G = sum(stages), len(stages)
        self.S = S
        self.copies = list(copies)
        self.rt = [2.0 * d for d in delivery] + [0.0]      # per stage: its outgoing boundary, both ways
        self.first = [sum(stages[:j]) for j in range(G)]
        # after group j (stages > its last): copies + round trips of the later boundaries, and the compute
        # of one layer per stage; the minimum slope of the stages there; their stage count
        self.after_const: List[float] = [0.0] * G
        self.after_min_slope: List[float] = [0.0] * G
        self.after_stages: List[int] = [0] * G
        for j in range(G):
            e = self.first[j] + stages[j] - 1
            rest = range(e + 1, S)
            self.after_const[j] = sum(self.copies[t] + one_layer[t] + self.rt[t] for t in rest)
            self.after_min_slope[j] = min((slope[t] for t in rest), default=0.0)
            self.after_stages[j] = len(rest)
        # one microbatch's F + B (with copies) on every stage and every crossing both ways, at least
        self.total_lb = (sum(self.copies[t] + one_layer[t] + self.rt[t] for t in range(S))
                         + max(0, self.L - S) * min(slope, default=0.0)) if self.L else 0.0

    def suffix_lb(self, j: int, layers_after: int) -> float:
        """Lower bound of ``sum (F_t + B_t)`` (with copies) plus the round trips over the stages after group
        ``j`` when they hold ``layers_after`` layers in all (>= their stage count)."""
        extra = layers_after - self.after_stages[j]
        return self.after_const[j] + max(0, extra) * self.after_min_slope[j]

    def group(self, j: int, head: float, times: Sequence[float], layers_after: int, ub: float) -> float:
        """For group ``j`` whose stages take compute ``times`` (F + B per microbatch, no copies) after a
        prefix worth ``head`` seconds (``sum_{t<b} (F_t + B_t + act_t + grad_t)`` up to the group's first
        stage): returns the head for the next group, or ``math.inf`` when a bound of :meth:`group_lb`
        exceeds ``ub``."""
        h, lb = self.group_lb(j, head, times, layers_after)
        return math.inf if lb > ub else h

    def group_lb(self, j: int, head: float, times: Sequence[float], layers_after: int) -> Tuple[float, float]:
        """``(head for the next group, lower bound)`` for group ``j`` (arguments as :meth:`group`): the
        lower bound of the pipeline seconds of every split that starts with this prefix is the largest of:
        per stage ``head_b + M t_b``; per island ``head + M sum_b t_b`` (the island runs its stages one
        action at a time; ``search.island_bound``), under GPipe plus the round trip after the island
        (:meth:`suffix_lb` and the island's outgoing crossing both ways: :func:`process_bound`); with
        ``cycle``, per stage ``head_b + ceil(M / (S - b)) C_b`` with ``C_b`` bounded below by this group's
        known stages and :meth:`suffix_lb`."""
        M, b0 = self.M, self.first[j]
        load, h, lb = 0.0, head, 0.0
        tt = [t + self.copies[b0 + i] for i, t in enumerate(times)]
        for i, t in enumerate(tt):
            lb = max(lb, h + M * t)
            load += t
            h += t + self.rt[b0 + i]
        isl = head + M * load
        if self.gpipe:  # process_bound: the island's backwards wait for the round trip after its forwards
            isl += self.suffix_lb(j, layers_after) + self.rt[b0 + len(tt) - 1]
        lb = max(lb, isl)
        if self.cycle:
            c, hb = self.suffix_lb(j, layers_after), h
            for i in range(len(tt) - 1, -1, -1):
                b = b0 + i
                c += tt[i] + self.rt[b]
                hb -= tt[i] + self.rt[b]
                lb = max(lb, hb + -(-M // (self.S - b)) * c)
        return h, lb


_BAL: dict = {}


def _balanced_counts(k: int, L: int):
    """``(k, L + 1)`` int array: stage ``i``'s layers when a group of ``k`` stages holds ``n`` layers
    (``search.balanced``: the first ``n % k`` stages take one more)."""
    key = (k, L)
    if key not in _BAL:
        import numpy as np
        n = np.arange(L + 1)
        _BAL[key] = n[None, :] // k + (np.arange(k)[:, None] < (n % k)[None, :])
    return _BAL[key]


def joint_suffix_bounds(stage_times, stages: Sequence[int], copies: Sequence[float], rt: Sequence[float], M: int,
                        schedule: str, num_layers: int):
    """Lower bounds of the pipeline seconds over every layer split of the groups AFTER a prefix, minimised
    JOINTLY over the later groups' layer counts (instead of counting each later stage at one layer).

    Args:
      stage_times: ``(S, L + 1)`` array, per pipeline stage ``t[n]`` = compute seconds (F + B per microbatch,
        no host copies) at ``n`` layers, ``inf`` where ``n`` layers do not fit (``search._Planner.tables``);
      stages: stage count per group in pipeline order (sum S); copies: per stage, the host-copy seconds
        around its F and B (split-independent); rt: per stage, its outgoing boundary's delivery both ways
        (0 for the last stage; ``SplitBounds.rt``); M: microbatches; schedule: ``"1f1b"`` or ``"gpipe"``.

    Returns:
      ``(V, C)``: per group ``j``, arrays over ``x = 0..L``: ``C[j][x]`` the least one-microbatch round trip
      ``sum_{t >= f_j} (u_t + rt_t)`` (``u_t`` = compute + copies of stage ``t``) of groups ``j..`` holding ``x``
      layers (each group's layers spread by ``balanced``), and ``V[j][x]`` a lower bound, relative to
      ``H_f = sum_{t < f_j} (u_t + rt_t)``, of the largest of these terms over the stages ``b >= f_j``:
      ``H_b + M u_b`` (``pipeline_time.makespan_lower_bound`` with the crossings); ``H_f + M sum_I u`` for each
      island ``I`` (``process_bound``), under GPipe plus the round trip after the island ``rt_l + C_{l+1}``;
      under 1F1B ``H_b + ceil(M / (S - b)) C_b`` (``cycle_bound``). ``inf`` where no split fits.
      Recursion: ``V[j][x] = min_n max(A_j(n, x - n), U_j(n) + V[j+1][x - n])`` with ``U_j(n)`` the group's
      ``sum (u + rt)`` and ``A_j`` its own stages' terms, in which the later round trip ``C_{l+1}`` is bounded
      below by ``C[j+1][x - n]`` (the only relaxation: every term is a sum of non-negative stage figures,
      so a split's terms are at least these). A split whose groups ``< j`` hold ``L - x`` layers with head
      ``H`` (``SplitBounds.group``'s) takes at least ``H + V[j][x]``.
    """
    import numpy as np
    L, S, G = num_layers, sum(stages), len(stages)
    T = np.asarray(stage_times, dtype=float)
    V_next, C_next = terminal_suffix(L)
    V: List = [None] * G
    C: List = [None] * G
    end = S
    for j in range(G - 1, -1, -1):
        k = stages[j]
        b0 = end - k
        u = T[b0 + np.arange(k)[:, None], _balanced_counts(k, L)] + np.asarray(copies[b0:end], dtype=float)[:, None]
        V[j], C[j] = joint_group_step(u, rt[b0:end], [S - b0 - i for i in range(k)], M, schedule, V_next, C_next)
        V_next, C_next, end = V[j], C[j], b0
    return V, C


def terminal_suffix(L: int):
    """``(V, C)`` of the empty suffix for :func:`joint_group_step`: 0 at 0 layers, ``inf`` elsewhere."""
    import numpy as np
    V = np.full(L + 1, np.inf)
    V[0] = 0.0
    return V, V.copy()


def joint_group_step(u, rt: Sequence[float], after: Sequence[int], M: int, schedule: str, V_next, C_next,
                     root: bool = False):
    """One group of :func:`joint_suffix_bounds`' recursion: ``(V[j], C[j])`` from ``(V[j+1], C[j+1])``.

    Args:
      u: ``(k, L + 1)`` array, per stage of the group (in order) its compute plus host copies at the layer
        count ``balanced`` gives it when the group holds ``n`` layers (``inf`` where it does not fit);
      rt: per stage, its outgoing crossing both ways; after: per stage ``b``, ``S - b`` (1F1B's cycle factor
        is ``ceil(M / (S - b))``); V_next, C_next: arrays over ``x = 0..L`` (:func:`terminal_suffix` for the
        last group); root: compute only ``x = L`` (returns two floats, or two arrays when ``V_next`` and
        ``C_next`` are ``(B, L + 1)``: B suffixes after the same first group at once).
    """
    import numpy as np
    inf = np.inf
    L = u.shape[1] - 1
    k = u.shape[0]
    valid = np.isfinite(u).all(axis=0)
    nz = np.flatnonzero(valid)
    if nz.size == 0:
        shape = np.shape(V_next)[:-1] if root else (L + 1,)
        return np.full(shape, inf), np.full(shape, inf)
    lo, hi = int(nz[0]), int(nz[-1]) + 1  # only the layer counts between the first and last that fit
    u, valid = u[:, lo:hi], valid[lo:hi]
    u = np.where(valid[None, :], u, 0.0)
    ur = u + np.asarray(rt, dtype=float)[:, None]
    suf = np.cumsum(ur[::-1], axis=0)[::-1]          # sum_{i' >= i} (u + rt)
    pre = suf[0][None, :] - suf                       # sum_{i' < i} (u + rt)
    U = suf[0]
    island = M * u.sum(axis=0)
    A0 = np.maximum((pre + M * u).max(axis=0), island)  # stage terms and the island term
    if root:  # x = L: y = L - n; V_next, C_next may hold several suffixes (rows)
        y = L - np.arange(lo, hi)
        Cy, Vy, bad = C_next[..., y], V_next[..., y], ~valid
    else:  # rows x = lo..L (fewer layers than lo: nothing fits), columns n = lo..hi-1
        y = np.arange(lo, L + 1)[:, None] - np.arange(lo, hi)[None, :]
        bad = (y < 0) | ~valid[None, :]
        y = np.maximum(y, 0)
        Cy, Vy = C_next[y], V_next[y]                  # (x, n): C[j+1][x - n]
    A = np.maximum(A0, U + Vy)
    if schedule == "gpipe":
        A = np.maximum(A, (island + rt[k - 1]) + Cy)
    elif schedule == "1f1b":
        for i in range(k):
            c = -(-M // after[i])
            A = np.maximum(A, (pre[i] + c * suf[i]) + c * Cy)
    A = np.where(bad, inf, A).min(axis=-1)
    cs = np.where(bad, inf, U + Cy).min(axis=-1)
    if root:
        return A, cs
    V, C = np.full(L + 1, inf), np.full(L + 1, inf)
    V[lo:], C[lo:] = A, cs
    return V, C
