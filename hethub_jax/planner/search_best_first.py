"""Best-first branch and bound over every pipeline plan of the planner's search space (pure Python).

One priority queue holds, across ALL configurations, the open work keyed by a lower bound of the step time
of every plan it stands for: a pipeline order of one configuration (``"sk"``, keyed by the configuration
bound of ``search_configs``), a partial layer split (``"node"``: the first groups' layer counts fixed,
keyed by the largest bound known for it: the configuration bound, the minimax island compute and
:meth:`search_bounds.SplitBounds.group_lb`), and a complete split (``"split"``, keyed by the same and,
once refined, :meth:`search._Planner.step_lb`). The configurations themselves arrive in increasing bound
order from :meth:`search._Planner.combo_streams` and are merged in lazily. The least key is always
worked on next; ``predict`` runs on a complete split only when its refined bound is the least of
everything outstanding, so a plan is predicted only if its lower bound is at most the k-th best step time
found so far. Work is dropped when its bound exceeds the k-th best (times ``1 + LB_SLACK``), and the search
stops when the least key does: since the k-th best only decreases, every plan left out has a lower bound
above the final k-th best and cannot enter the top k (``docs/planner_internals.md``). Ties go to deeper work (a
complete split before a partial one) and then to the order of insertion: deterministic.
"""
from __future__ import annotations

import heapq
import itertools
import math
from typing import Any, List, Tuple

from hethub_jax.planner.search_bounds import joint_suffix_bounds, rest_lb, suffix_minimax

__all__ = ["best_first"]


def best_first(p: Any) -> None:
    """Run the pipeline part of the search on planner ``p`` (a ``search._Planner``): every plan whose lower
    bound is at most the final k-th best step time is predicted and offered to ``p``'s top k."""
    from hethub_jax.planner.search import LB_SLACK
    heap: List[Tuple[float, int, int, str, Any]] = []
    seq = itertools.count()
    stream = p.combo_streams()
    nxt = next(stream, None)
    while heap or nxt is not None:
        ub = p.ub() * (1 + LB_SLACK)
        top = heap[0][0] if heap else math.inf
        if nxt is not None and nxt[0] <= top:  # a configuration: keyed by its stage counts' bound
            lb0, mbs, rec, sched, combo = nxt
            if lb0 > ub:
                break
            nxt = next(stream, None)
            lb = max(lb0, p.kind_config_lb(mbs, rec, sched, combo))
            if lb <= ub:
                heapq.heappush(heap, (lb, 1, next(seq), "cfg", (mbs, rec, sched, combo)))
            continue
        lb, _, _, kind, data = heapq.heappop(heap)
        if lb > ub:
            break
        if kind == "cfg":  # one item per pipeline order
            mbs, rec, sched, combo = data
            for sk in p.skeletons_of(mbs, rec, combo, (sched,)):
                p.skeletons += 1
                b = max(lb, p.order_lb(sk), p.kind_bound(mbs, rec, sched, sk.groups, sk.stages))
                if b <= ub:
                    heapq.heappush(heap, (b, 0, next(seq), "sk", sk))
        elif kind == "sk":
            _open(p, heap, seq, lb, data, ub)
        elif kind == "node":
            _branch(p, heap, seq, lb, data, ub)
        else:
            _split(p, heap, seq, lb, data, ub)


def _open(p: Any, heap, seq, lb: float, sk: Any, ub: float) -> None:
    """A pipeline order: its tables, the minimax island compute (``M x`` the greedy split's bottleneck;
    under GPipe plus the crossings both ways: ``search_bounds.process_bound``), then the root node."""
    M, L = p.gbs // sk.microbatch_size, p.L
    if L < sk.num_stages or not p.order_fits(sk):
        return
    times = p.tables(sk)
    gt = p.group_tables(sk, times)
    rest = suffix_minimax(gt, L)
    beta = rest[0][L]
    if beta == math.inf:
        return
    bounds = p.split_bounds(sk, times)
    gp = sk.schedule == "gpipe"
    rt = sum(bounds.rt)
    lb = max(lb, rest_lb(M, gp, bounds.total_lb, rt, beta))
    if lb > ub:
        return
    joint, _ = joint_suffix_bounds(times, sk.stages, bounds.copies, bounds.rt, M, sk.schedule, L)
    lb = max(lb, float(joint[0][L]))
    if lb > ub:
        return
    p.expanded += 1
    heapq.heappush(heap, (lb, -1, next(seq), "node", ((sk, times, gt, bounds, rest, gp, rt, joint), 0, L, 0.0, ())))


def _branch(p: Any, heap, seq, lb: float, data, ub: float) -> None:
    """A partial split with groups ``0..j-1`` holding ``cur``: one child per layer count of group ``j``
    whose bound is not above ``ub`` (a complete split when ``j`` is the last group)."""
    from hethub_jax.planner.search import _stage_counts, balanced
    (sk, times, gt, bounds, rest, gp, rt, joint), j, left, head, cur = data
    G, M = len(sk.groups), p.gbs // sk.microbatch_size
    nxt = rest[j + 1] if j < G - 1 else None
    need = sum(sk.stages[j + 1:])
    hi = left if j == G - 1 else left - need
    lo = left if j == G - 1 else sk.stages[j]
    b0 = bounds.first[j]
    for n in range(hi, lo - 1, -1):
        if gt[j][n] == math.inf:  # a stage exceeds memory
            continue
        b = max(lb, M * gt[j][n] + head)
        if nxt is not None:  # the later groups hold left - n layers: their least largest island
            if nxt[left - n] == math.inf:
                continue
            b = max(b, rest_lb(M, gp, bounds.total_lb, rt, max(gt[j][n], nxt[left - n])))
        if b > ub:
            continue
        ts = [times[b0 + i][c] for i, c in enumerate(balanced(n, sk.stages[j]))]
        h, glb = bounds.group_lb(j, head, ts, left - n)
        b = max(b, glb)
        if j < G - 1:  # the later groups' terms, minimised jointly over their split
            b = max(b, h + float(joint[j + 1][left - n]))
        if b > ub:
            continue
        if j == G - 1:
            heapq.heappush(heap, (b, -G - 2, next(seq), "split", (sk, _stage_counts(sk, cur + (n,)), False)))
        else:
            heapq.heappush(heap, (b, -j - 2, next(seq), "node", (data[0], j + 1, left - n, h, cur + (n,))))


def _split(p: Any, heap, seq, lb: float, data, ub: float) -> None:
    """A complete split: first refined by ``step_lb`` (the makespan and closed-form bounds; pushed back if
    that raises its key), then predicted when it is again the least key."""
    sk, counts, refined = data
    if not refined:
        b = max(lb, p.step_lb(sk, counts))
        if b > ub:
            return
        if b > lb:
            heapq.heappush(heap, (b, -len(sk.groups) - 3, next(seq), "split", (sk, counts, True)))
            return
    p.evaluate(sk, counts, bound=False)
