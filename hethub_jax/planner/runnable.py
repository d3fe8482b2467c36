"""Runnable candidates: the searched plans with each multi-node group split into one island per stage.

The search (``planner.search``) makes one island of each node group and predicts it as today's
runtime would run one island: its stages one action at a time (``predict(concurrency="runtime")``).
Today's runtime, though, runs only one stage on an island of several processes
(``parallel.rules.check_runtime_support``), so a candidate with several stages on a multi-node group
could not be trained. :func:`split_candidate` replaces such a group's island by one island per stage
(``parallel.split.split_islands``; the planner gives each stage ``dp x tp`` devices from the group's
first free device, and its level 2 keeps only sizes ``parallel.rules.uniform_stages_run`` accepts: inside
one node or whole nodes, so the split always runs) and predicts the split plan again, as the runtime runs it: the group's stages now run
concurrently (one process each) and each of the group's internal stage boundaries crosses the MPI host
bridge (host copies + the plan's bridge, the slowest inter-group link the search passes, as for
boundaries between groups). :func:`runnable_result` does this for every candidate of a search, ranks
them again (``search.rank_key``, the search's order) and recomputes the upper bound the same way. Every figure is PREDICTED.

Pure Python, like the rest of ``planner`` (JAX only through the predictor's lazy imports).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Tuple

from hethub_jax.parallel.split import split_islands
from hethub_jax.planner.cluster import ClusterSpec, load_cluster
from hethub_jax.planner.search import (Candidate, PlanningError, SearchOptions, SearchResult, bridge_for,
                                       group_costs, rank_key, search, upper_bound_missing_note)

__all__ = ["RunnableCandidate", "split_candidate", "runnable_result"]


@dataclass(frozen=True)
class RunnableCandidate(Candidate):
    """A :class:`~hethub_jax.planner.search.Candidate` whose plan has its multi-node groups split into
    one island per stage, PREDICTED again on that plan.

    Attributes (besides the candidate's):
      island_groups: island name of ``plan`` -> the node group (cluster spec) it belongs to.
      searched: the candidate as the search found and predicted it (one island per group), or None
        when the split changed nothing (then ``plan`` is that candidate's plan).
    """

    island_groups: Mapping[str, str] = field(default_factory=dict)
    searched: Optional[Candidate] = None


def _bridge_pairs(plan: Any) -> Sequence[Tuple[str, str]]:
    """The group pairs the search passes to ``bridge_for`` for this (unsplit) plan: neighbours along
    the pipeline; every pair of groups for heterogeneous DP."""
    if plan.num_replicas > 1:
        return list(itertools.combinations([i.name for i in plan.islands], 2))
    isl = [st.island for st in plan.replicas[0].stages]
    return list(zip(isl, isl[1:]))


def split_candidate(c: Candidate, cfg: Any, cluster: ClusterSpec, costs: Mapping[str, Any],
                    seq_len: int, grad_bucket_mb: Any = "auto") -> RunnableCandidate:
    """``c`` with its plan split per stage (``parallel.split.split_islands``) and predicted again with
    the same device costs (per group), bridge, ``seq_len`` and ``grad_bucket_mb`` (``SearchOptions.grad_bucket_mb``:
    the gradient all-reduce path ranked) as the search; MFU scaled by the step
    time (the same devices' peak). Unchanged (``searched=None``) when the split changes nothing.

    Raises:
      ValueError: as ``split_islands`` (a split island's name taken) or ``predict``.
    """
    from hethub_jax.planner.predictor import predict
    plan, origin = split_islands(c.plan)
    if plan == c.plan:
        return RunnableCandidate(c.plan, c.prediction, c.kind, c.layers, c.mfu, c.upper_bound_fraction,
                                 island_groups={n: n for n in origin})
    used = {st.island for rep in plan.replicas for st in rep.stages}
    pred = predict(cfg, plan, {n: costs[origin[n]] for n in used}, seq_len=seq_len,
                   bridge=bridge_for(cluster, _bridge_pairs(c.plan)), grad_bucket_mb=grad_bucket_mb)
    mfu = c.mfu * c.step_time_s / pred.step_time_s if pred.step_time_s > 0 else c.mfu
    return RunnableCandidate(plan, pred, c.kind, c.layers, mfu, None, island_groups=origin, searched=c)


def runnable_result(res: SearchResult, cfg: Any, cluster: Any, seq_len: int, *,
                    costs: Optional[Mapping[str, Any]] = None, options: Optional[SearchOptions] = None,
                    profiles_dir: Optional[str] = None, upper_bound: bool = False) -> SearchResult:
    """``res`` (a :func:`~hethub_jax.planner.search.search` result, computed with ``upper_bound=False``)
    with every candidate split by :func:`split_candidate` and ranked again by
    :func:`~hethub_jax.planner.search.rank_key` (the search's own order: PREDICTED step time, then on exact
    ties recompute ``none``, fewer devices, less PREDICTED peak memory, plan JSON). ``upper_bound``: the cluster's upper bound computed as the search's (the sum over groups
    of the best homogeneous tokens/s of a search on that group alone), with those candidates split the
    same way, and each candidate's ``upper_bound_fraction`` against it. The top k are the search's top
    k under its own model (one island per group), split; see docs/planner.md ("Runs today?").

    Raises:
      ValueError: as :func:`split_candidate`.
    """
    t0 = time.perf_counter()
    cluster = load_cluster(cluster).resolved()
    opt = options or SearchOptions()
    costs = costs or group_costs(cluster, opt.efficiency, profiles_dir)
    cands = sorted((split_candidate(c, cfg, cluster, costs, seq_len, opt.grad_bucket_mb) for c in res.candidates),
                   key=rank_key)
    gbs = res.best.plan.global_batch_size
    ub, note = _split_upper_bound(cfg, cluster, gbs, seq_len, costs, opt) if upper_bound else (None, None)
    if ub:
        cands = [RunnableCandidate(c.plan, c.prediction, c.kind, c.layers, c.mfu, c.tokens_per_s / ub,
                                   island_groups=c.island_groups, searched=c.searched) for c in cands]
    return SearchResult(tuple(cands), res.skeletons, res.expanded, res.evaluated,
                        res.wall_s + time.perf_counter() - t0, ub, note)


def _split_upper_bound(cfg: Any, cluster: ClusterSpec, gbs: int, seq_len: int, costs: Mapping[str, Any],
                       opt: SearchOptions) -> Tuple[Optional[float], Optional[str]]:
    """Sum over groups of the best split candidate's tokens/s of a search on that group alone, or
    ``(None, why)`` when a group cannot train the model alone."""
    total, missing = 0.0, []
    sub_opt = SearchOptions(**{**opt.__dict__, "hetero_dp": False})
    for g in cluster.groups:
        sub = ClusterSpec.model_validate({"name": f"{cluster.name}/{g.name}", "groups": [g.model_dump()]})
        try:
            r = search(cfg, sub, gbs, seq_len, costs={g.name: costs[g.name]}, options=sub_opt)
        except PlanningError:
            missing.append(g.name)
            continue
        total += max(split_candidate(c, cfg, sub, costs, seq_len, opt.grad_bucket_mb).tokens_per_s
                     for c in r.candidates)
    return (None, upper_bound_missing_note(missing)) if missing else (total, None)
