"""Automatic parallel planner: three-level search for the plan with the least predicted step time.

DESIGN.md section 8; the method, the search space and the exactness argument are in
``docs/planner_internals.md`` (how to use the planner: ``docs/planner.md``).

Search space (for a model, a cluster spec and a global batch size):
  * pipeline plans: an order of ALL node groups along the pipeline (every permutation); per group a
    number of stages ``k`` (1..``max_stages_per_group``), a TP degree ``tp`` (level 3: divides the
    devices per node, divides the attention heads and divides or is a multiple of the KV heads) and
    the DP degree ``dp`` (level 2: the largest divisor of the microbatch size with ``k * dp * tp`` <=
    the group's devices and, with ``SearchOptions.runnable_stages`` (default), a stage size ``dp * tp``
    that today's runtime runs once the group is split per stage: ``rules.uniform_stages_run``, inside one
    node or a whole number of nodes, so every emitted plan runs); the microbatch size (a divisor of the global batch), the schedule, the
    recompute policy, and every split of the layers into contiguous stages of >= 1 layer (level 1);
  * heterogeneous-DP plans: one replica per group (each a pipeline inside its group, chosen as the
    group's minimum-bottleneck pipeline), batch shares by ``parallel.plan.proportional_shares`` of
    the replicas' speeds (``microbatch_size / bottleneck``).
Every candidate is ranked by ``predictor.predict(..., grad_bucket_mb=SearchOptions.grad_bucket_mb).step_time_s``
(default ``"auto"``, training's ``train.grad_bucket_mb`` default: a heterogeneous-DP plan whose replicas can
bucket their gradient all-reduce is ranked by the PREDICTED step of the path the runtime's warm-up rule keeps,
``Prediction.buckets["auto_keeps"]``) and must fit memory (``Prediction.fits``); exact ties are broken by
:func:`rank_key` (the one order of candidates, here and in ``planner.runnable``). Pipeline plans are found by
branch and bound: ``predict``'s step time is at least the pipeline makespan, which is at least ``max_b(M t_b + sum_{s<b} t_s)`` and ``M x`` the busiest
island's per-microbatch compute (``planner.pipeline_time``), both plus the bridge crossings before them, and
at least microbatch 0's chain through every stage and crossing (:func:`island_bound`, ``round_trip_lb``);
under 1F1B at least the cycle bound (every ``S - b`` microbatches wait one round trip from stage ``b``:
``search_bounds``); and the process bound (an island's stages run from one process; under GPipe its
backwards wait for the round trip after its forwards: ``search_bounds.process_bound``). Configurations are
bounded all at once with numpy (``search_configs``) and merged into one best-first queue with pipeline
orders, partial and complete splits (``search_best_first``); work whose bound is above the k-th best step
time found so far cannot enter the top k and is skipped. All other splits are evaluated with ``predict``:
the result equals exhaustive enumeration (``exhaustive_search``).
The hetero-DP bounds (:meth:`_Planner.hetero_lb`, :meth:`_Planner.hetero_plan_lb`) count a replica's compute,
lowered by :meth:`_Planner.bucket_slack` so that they also bound the bucketed path's step (its chunked last
microbatch may be measured faster than fused).

Python and numpy: no JAX import.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from hethub_jax.parallel.plan import Plan, proportional_shares
from hethub_jax.parallel.schedule import get_schedule, in_flight_bound
from hethub_jax.planner.cluster import ClusterSpec, islands_of, load_cluster
from hethub_jax.planner.pipeline_time import makespan
from hethub_jax.planner.search_best_first import best_first
from hethub_jax.planner.search_bounds import SplitBounds, cycle_bound, process_bound

__all__ = ["SearchOptions", "Skeleton", "Candidate", "SearchResult", "PlanningError", "search",
           "exhaustive_search", "min_bottleneck_split", "greedy_bottleneck_split", "group_costs", "bridge_for", "valid_tp_degrees",
           "island_bound", "DEFAULT_TOP_K", "rank_key", "devices_used"]

#: candidates the search keeps (``SearchOptions.top_k``) by default, for the plan CLI (``--top``) and plan-less
#: training (``train_predict``) alike: ``planner.runnable.runnable_result`` splits and predicts again only these
#: and ranks them again, so the chosen plan depends on k whenever a multi-node group's split changes the
#: ranking; one constant keeps ``python -m hethub_jax.plan`` and ``python -m hethub_jax.train --cluster``
#: choosing the same plan
DEFAULT_TOP_K = 3

#: relative slack on lower bounds: the planner's linear stage-time formulas and ``predict`` may round the
#: last bit differently; a bound is trusted to prune only when it exceeds the incumbent by this much
LB_SLACK = 1e-9

#: Default :attr:`SearchOptions.memory_headroom`: 5% of each device's memory is kept free. The predictor
#: counts parameters, gradients, optimizer state and activations (``predictor.stage_memory_bytes``), not
#: what the runtime adds around them: allocator fragmentation (XLA's BFC allocator, more of it with
#: ``XLA_PYTHON_CLIENT_PREALLOCATE=false``), XLA scratch/workspace buffers (cuBLAS/hipBLAS, collectives),
#: the CUDA/ROCm context. PyTorch's caching allocator commonly reports 5-10% of "reserved but unallocated"
#: memory for the same reason. 5% of an 80 GB H100 is 3.7 GiB, of a 192 GB MI300X 8.9 GiB: room for
#: those without discarding plans that a 10-25% reserve would. JAX on GPU preallocates only 75% of the
#: memory by default (``XLA_PYTHON_CLIENT_MEM_FRACTION``): raise that fraction (e.g. 0.95) or plan with
#: ``memory_headroom`` 0.25 (docs/planner.md, "Memory headroom").
DEFAULT_MEMORY_HEADROOM = 0.05


class PlanningError(ValueError):
    """No plan of the search space fits; the message names the binding constraint."""


@dataclass(frozen=True)
class SearchOptions:
    """What the search may choose (defaults: everything the runtime supports).

    Attributes:
      microbatch_sizes: candidate microbatch sizes (samples); ``None``: every divisor of the global batch.
      schedules: pipeline schedules to try (``"1f1b"``, ``"gpipe"``).
      recompute: recompute policies to try (``"none"``, ``"full"``).
      tp_degrees: candidate TP degrees; ``None``: every valid divisor of the devices per node.
      max_stages_per_group: most pipeline stages one group (island) may hold.
      hetero_dp: also try the heterogeneous data-parallel plan family.
      top_k: candidates kept (:data:`DEFAULT_TOP_K`); ``planner.runnable.runnable_result`` splits and ranks again
        only these, so a smaller k may choose another plan when a multi-node group is split.
      efficiency: fraction of datasheet peak assumed for catalog device types (``DeviceCosts.from_catalog``).
      last_group: only pipelines whose last stage (final norm, LM head, loss) is on this group.
      memory_headroom: fraction of each device's memory kept free, in [0, 1): a stage fits when its
        PREDICTED memory per device is at most ``(1 - memory_headroom) x`` the device's capacity
        (:data:`DEFAULT_MEMORY_HEADROOM`, 0.05; 0: plan up to the full capacity).
      runnable_stages: level 2 keeps only stage sizes that today's runtime runs once a multi-node group
        is split per stage (``parallel.rules.uniform_stages_run``: a group holding several stages gives
        each ``dp x tp`` devices inside one node or a whole number of nodes), so every emitted plan runs
        (after ``planner.runnable``'s split); False: the largest DP that fits the group, e.g. plans of
        12 devices per stage on 8-device nodes, which no split runs (for comparisons).
      grad_bucket_mb: the runs' ``train.grad_bucket_mb`` (MiB > 0, ``"auto"`` or None), passed to
        ``predictor.predict``: which gradient all-reduce path a heterogeneous-DP candidate is ranked by.
        ``"auto"`` (default, as training's default): the path ``parallel.plan.keeps_bucketed_allreduce``
        keeps on the two PREDICTED step times (bucketed only when faster by more than 2%); a number: the
        bucketed path (buckets of that many MiB); None: the all-reduce after the whole backward.
        Pipeline plans (one replica) have no cross-replica all-reduce and are ranked the same either way.
    """

    microbatch_sizes: Optional[Tuple[int, ...]] = None
    schedules: Tuple[str, ...] = ("1f1b", "gpipe")
    recompute: Tuple[str, ...] = ("none", "full")
    tp_degrees: Optional[Tuple[int, ...]] = None
    max_stages_per_group: int = 4
    hetero_dp: bool = True
    top_k: int = DEFAULT_TOP_K
    efficiency: float = 0.4
    last_group: Optional[str] = None
    runnable_stages: bool = True
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
    grad_bucket_mb: Optional[Any] = "auto"


@dataclass(frozen=True)
class Skeleton:
    """A pipeline configuration without its layer split.

    Attributes:
      microbatch_size, schedule, recompute: as in the plan.
      groups: group names in pipeline order.
      stages, tp, dp: per group (same order): stage count, TP and DP degree of each of its stages.
    """

    microbatch_size: int
    schedule: str
    recompute: str
    groups: Tuple[str, ...]
    stages: Tuple[int, ...]
    tp: Tuple[int, ...]
    dp: Tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return sum(self.stages)

    def stage_group(self) -> List[int]:
        """Per pipeline stage, the index (into ``groups``) of its group."""
        return [j for j, k in enumerate(self.stages) for _ in range(k)]


@dataclass(frozen=True)
class Candidate:
    """One planned configuration, PREDICTED.

    Attributes:
      plan: the plan (validated against the model).
      prediction: ``predictor.Prediction`` of the plan (every figure predicted).
      kind: ``"pipeline"`` or ``"hetero-dp"``.
      layers: per replica, the layer count of each stage.
      mfu: model FLOPs utilisation, predicted: model FLOPs per step (forward + backward, no recompute)
        / (step time x the plan's devices' peak FLOP/s).
      upper_bound_fraction: tokens/s / the cluster's upper bound (sum over groups of the best
        homogeneous tokens/s), when computed.
    """

    plan: Plan
    prediction: Any
    kind: str
    layers: Tuple[Tuple[int, ...], ...]
    mfu: float
    upper_bound_fraction: Optional[float] = None

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.prediction.tokens_per_s


@dataclass(frozen=True)
class SearchResult:
    """Result of :func:`search`.

    Attributes:
      candidates: the top k, best first in :func:`rank_key` order (least PREDICTED step time; exact ties
        to recompute ``none``, fewer devices, less PREDICTED peak memory, then the plan JSON).
      skeletons: configurations and pipeline orders the search looked at (the configurations of a
        (microbatch size, recompute, schedule) row whose cheap bound exceeds the k-th best are never
        built and not counted); expanded: pipeline orders not pruned by their bound.
      evaluated: ``predict`` calls.
      wall_s: seconds the search took.
      upper_bound_tokens_per_s: sum over groups of each group's best homogeneous tokens/s (or None:
        not asked for, or a group cannot train the model alone; ``upper_bound_note`` says which).
      upper_bound_note: why the upper bound is None although it was asked for (else None).
    """

    candidates: Tuple[Candidate, ...]
    skeletons: int
    expanded: int
    evaluated: int
    wall_s: float
    upper_bound_tokens_per_s: Optional[float] = None
    upper_bound_note: Optional[str] = None

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def devices_used(plan: Plan) -> int:
    """Accelerators the plan's stages use (sum of every stage's ``dp x tp``, over all replicas)."""
    return sum(st.num_devices for rep in plan.replicas for st in rep.stages)


def rank_key(candidate: Candidate) -> Tuple[float, bool, int, float, str]:
    """The one order of candidates (best first) wherever plans are ranked: the search's top k
    (``_Planner.offer``), ``planner.runnable.runnable_result`` (the plan CLI and plan-less training) and
    so the plan both choose. ``(PREDICTED step time, recompute != "none", devices used, PREDICTED peak
    memory per device over the stages (bytes), plan JSON)``: the least step time first; on an exact tie
    recompute ``none`` (when every forward is fused with its backward, e.g. one-stage replicas under 1F1B,
    both policies run the same calls and ``full`` only reads as a third more compute; issue 17), then the
    plan leaving more devices free, then the one with more memory to spare, then the JSON (deterministic).

    Raises:
      AttributeError: for an object without ``plan`` and ``prediction`` (a :class:`Candidate`)."""
    plan, pred = candidate.plan, candidate.prediction
    peak = max((sp.memory.total for sp in pred.stages), default=0.0)
    return (pred.step_time_s, plan.recompute != "none", devices_used(plan), peak, plan.to_json(indent=None))


# ---------------------------------------------------------------------------------------------------
# level 1: exact minimum-bottleneck split (dynamic program over layer prefixes)

def min_bottleneck_split(stage_times: Sequence[Sequence[float]], num_layers: int) -> Tuple[float, Tuple[int, ...]]:
    """Split ``num_layers`` layers into ``S = len(stage_times)`` contiguous stages of >= 1 layer each,
    minimising the largest stage time; exact dynamic program over layer prefixes.

    Args:
      stage_times: per stage ``s``, ``stage_times[s][n]`` = seconds of stage ``s`` holding ``n`` layers
        (index 0 unused; embedding/LM-head costs already included for the first/last stage;
        ``math.inf`` where ``n`` layers do not fit memory). Must have at least ``num_layers + 1`` entries.

    Returns:
      ``(bottleneck seconds, layer counts per stage)``; ties go to the split that gives earlier stages
      more layers. ``(inf, ())`` when no split fits.
    """
    S, L = len(stage_times), num_layers
    if S == 0 or L < S:
        return math.inf, ()
    inf = math.inf
    # best[s][p]: least bottleneck of stages 0..s holding layers 0..p-1; choice[s][p]: stage s's count
    best = [[inf] * (L + 1) for _ in range(S)]
    choice = [[0] * (L + 1) for _ in range(S)]
    t0 = stage_times[0]
    for p in range(1, L - S + 2):
        best[0][p] = t0[p]
        choice[0][p] = p
    for s in range(1, S):
        ts, prev, row, ch = stage_times[s], best[s - 1], best[s], choice[s]
        for p in range(s + 1, L - (S - 1 - s) + 1):
            b, c = inf, 0
            for n in range(1, p - s + 1):  # stage s holds layers p-n..p-1
                v = prev[p - n]
                if ts[n] > v:
                    v = ts[n]
                if v < b:
                    b, c = v, n
            row[p], ch[p] = b, c
    if best[S - 1][L] == inf:
        return inf, ()
    counts, p = [], L
    for s in range(S - 1, -1, -1):
        counts.append(choice[s][p])
        p -= choice[s][p]
    return best[S - 1][L], tuple(reversed(counts))


def greedy_bottleneck_split(stage_times: Sequence[Sequence[float]], num_layers: int,
                            minimum: Optional[Sequence[int]] = None) -> Tuple[float, Tuple[int, ...]]:
    """The same least bottleneck as :func:`min_bottleneck_split`, in ``O(L log S)``: a stage's time
    depends only on its own layer count and is nondecreasing in it, so the minimax allocation is
    reached by starting every stage at its minimum (``minimum[s]``, default 1 layer) and giving each
    further layer to the stage whose time after taking it is least (each step keeps the maximum as
    small as any allocation of that many layers can; ties to the lower stage index).
    ``tests/test_planner.py`` checks it against the DP. Returns ``(inf, ())`` when no split fits."""
    S, L = len(stage_times), num_layers
    counts = list(minimum or [1] * S)
    if S == 0 or L < sum(counts) or any(stage_times[s][c] == math.inf for s, c in enumerate(counts)):
        return math.inf, ()
    nxt = lambda s: stage_times[s][counts[s] + 1] if counts[s] + 1 <= L else math.inf
    heap = [(nxt(s), s) for s in range(S)]
    heapq.heapify(heap)
    for _ in range(L - sum(counts)):
        t, s = heapq.heappop(heap)
        if t == math.inf:
            return math.inf, ()
        counts[s] += 1
        heapq.heappush(heap, (nxt(s), s))
    return max(stage_times[s][n] for s, n in enumerate(counts)), tuple(counts)


# ---------------------------------------------------------------------------------------------------
# inputs: device costs, links, TP degrees

def group_costs(cluster: ClusterSpec, efficiency: float = 0.4, profiles_dir: Optional[str] = None) -> Dict[str, Any]:
    """Per group name, its ``costs.DeviceCosts``: the group's ``profile`` file; else
    ``<profiles_dir>/<device>.json`` or ``<profiles_dir>/<group>.json`` when present; else the device
    catalog entry with the group's ``devices_per_node`` and bandwidths, at the group's ``efficiency``
    of peak when its spec gives one, else ``efficiency``. A ``--profiles`` file found for a group
    replaces the catalog (and its efficiency). With ``<profiles_dir>/bridge_allreduce.json``
    (``costs.BRIDGE_ALLREDUCE_FILE``: the bridge's all-reduce MEASURED on a plan-less training job's ranks),
    every group's costs carry that line (``DeviceCosts.with_bridge_allreduce``), as plan-less training's do.

    Raises:
      ValueError: for an unknown catalog device, an unreadable profile or bridge all-reduce file.
    """
    import dataclasses
    import os

    from hethub_jax.planner.catalog import get_device
    from hethub_jax.planner.costs import DeviceCosts
    out = {}
    for g in cluster.resolved().groups:
        path = g.profile
        if path is None and profiles_dir:
            for name in (g.device, g.name):
                p = os.path.join(profiles_dir, f"{name}.json")
                if name and os.path.exists(p):
                    path = p
                    break
        if path is not None:
            out[g.name] = DeviceCosts.from_profile(path)
            continue
        spec = dataclasses.replace(get_device(g.device), devices_per_node=g.devices_per_node,
                                   intra_node_bandwidth=g.intra_node_bandwidth,
                                   network_bandwidth=g.network_bandwidth)
        out[g.name] = DeviceCosts.from_catalog(spec, efficiency if g.efficiency is None else g.efficiency)
    from hethub_jax.planner.costs import read_bridge_allreduce
    saved = read_bridge_allreduce(profiles_dir)
    if saved is not None:
        out = {k: c.with_bridge_allreduce(saved["fit"]) for k, c in out.items()}
    return out


def bridge_for(cluster: ClusterSpec, pairs: Sequence[Tuple[str, str]]):
    """The ``costs.LinkModel`` passed to ``predict`` (one bridge per plan): the slowest link (least
    bandwidth, then most latency) among the given group pairs; the default link when there is none."""
    from hethub_jax.planner.costs import LinkModel
    links = [cluster.link(a, b) for a, b in pairs if a != b]
    if not links:
        bw, lat = cluster.link("", " ")
    else:
        bw, lat = min(links, key=lambda x: (x[0], -x[1]))
    return LinkModel(lat, bw)


def valid_tp_degrees(cfg: Any, devices_per_node: int, allowed: Optional[Sequence[int]] = None) -> List[int]:
    """TP degrees inside one node (level 3): divisors of ``devices_per_node`` that divide the attention
    heads and divide or are a multiple of the KV heads (``Plan.validate``'s rule), optionally limited
    to ``allowed``."""
    heads = cfg.num_attention_heads
    kv = cfg.num_key_value_heads or heads
    out = [t for t in range(1, devices_per_node + 1) if devices_per_node % t == 0 and heads % t == 0
           and (kv % t == 0 or t % kv == 0)]
    return [t for t in out if allowed is None or t in allowed]


def balanced(n: int, k: int) -> List[int]:
    """``n`` layers over ``k`` stages of one group as evenly as possible (the first ``n % k`` stages take
    one more): the search space's split inside a group."""
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def _stage_counts(sk: "Skeleton", per_group: Sequence[int]) -> Tuple[int, ...]:
    return tuple(c for n, k in zip(per_group, sk.stages) for c in balanced(n, k))


@functools.lru_cache(maxsize=1024)
def _divisors(n: int) -> Tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max((d for d in _divisors(n) if d <= cap), default=0)


def island_bound(stages: Sequence[int], M: int, fw: Sequence[float], bw: Sequence[float],
                 act: Sequence[float], grad: Sequence[float]) -> float:
    """Lower bound of the pipeline makespan when each group (island) runs its ``stages[j]`` consecutive
    stages one action at a time (``predict(concurrency="runtime")``), for GPipe and 1F1B.

    Island ``j`` with first stage ``f`` is busy ``M * sum_{s in j} (F_s + B_s)`` (``fw``/``bw``: seconds per
    microbatch with the host copies of the stage's SEND/RECV actions). Its first action cannot start
    before a microbatch has passed the forwards of stages ``0..f-1`` and the ``f`` activation deliveries
    (``head = sum_{s<f} F_s + act_s``): every action of the island depends on stage ``f``'s first RECV.
    Its last action is stage ``f``'s last backward and SEND_GRAD (every other action of the island
    precedes it through the backward chain of the last microbatch), after which that microbatch's
    backwards of stages ``f-1..0`` and the gradient deliveries still run (``tail = sum_{s<f} B_s +
    grad_s``). Hence ``makespan >= max_j (head_j + load_j + tail_j)``; the first island's head and tail
    are 0. ``act``/``grad``: per stage boundary, delivery seconds (``S - 1`` entries)."""
    best, s0, head, tail = 0.0, 0, 0.0, 0.0
    for k in stages:
        load = M * sum(fw[s] + bw[s] for s in range(s0, s0 + k))
        best = max(best, head + load + tail)
        for s in range(s0, s0 + k):
            if s < len(act):
                head += fw[s] + act[s]
                tail += bw[s] + grad[s]
        s0 += k
    return best


# ---------------------------------------------------------------------------------------------------
# the search

class _Planner:
    """State of one search: inputs, cost caches, the top-k list and counters."""

    def __init__(self, cfg: Any, cluster: ClusterSpec, global_batch: int, seq_len: int,
                 costs: Mapping[str, Any], options: SearchOptions):
        self.cfg, self.cluster, self.opt = cfg, cluster.resolved(), options
        self.gbs, self.seq, self.L = int(global_batch), int(seq_len), int(cfg.num_hidden_layers)
        self.costs = dict(costs)
        self.groups = {g.name: g for g in self.cluster.groups}
        #: per group, the bytes per device a stage may use: capacity x (1 - memory_headroom)
        self.mem_limit = {n: self.costs[n].memory_bytes * (1.0 - float(options.memory_headroom))
                          for n in self.groups}
        self.factor = {n: float(g.slowdown) / float(getattr(self.costs[n], "emulated_slowdown", 1.0))
                       for n, g in self.groups.items()}
        self._times: Dict[tuple, List[float]] = {}
        self._lines: Dict[tuple, tuple] = {}
        #: some group's costs hold MEASURED whole-stage shapes (``DeviceCosts.stage_shapes``, profile
        #: ``--stage-shapes``): its stage seconds are then not a line in the layer count, which every bound
        #: and the layer-split tables assume; the tables take each stage size's seconds from the calls
        #: ``predict`` makes (:meth:`stage_fb`) and no bound prunes (every plan of the space is predicted)
        self.exact = any(getattr(c, "stage_shapes", None) for c in self.costs.values())
        self._fused: Dict[tuple, str] = {}
        self._upd: Dict[tuple, float] = {}
        self._seen: set = set()
        self._bridges: Dict[tuple, Any] = {}
        self.dedupe = True
        self._caps: Dict[tuple, int] = {}
        self._const: Dict[tuple, float] = {}
        self._layer_lb: Dict[tuple, float] = {}
        self._capped: Dict[tuple, List[float]] = {}
        self._kind: Dict[tuple, float] = {}
        self._suffix: Dict[tuple, tuple] = {}
        self._rows: Dict[tuple, Any] = {}
        self._preds: Dict[str, Any] = {}
        self._choices: Dict[tuple, List[Tuple[int, int, int]]] = {}
        #: (group, mbs, k, tp) -> (largest dp that fits, dp the runtime rule leaves) where they differ
        self.restricted: Dict[tuple, Tuple[int, int]] = {}
        #: the k best so far, :func:`rank_key` order: (step time, plan JSON, candidate, rank key)
        self.top: List[Tuple[float, str, Candidate, tuple]] = []
        self.skeletons = self.expanded = self.evaluated = 0

    # ---- top k -----------------------------------------------------------------------------------
    def ub(self) -> float:
        """The k-th best step time so far (inf until k candidates exist): the pruning threshold; inf with
        measured stage shapes (:attr:`exact`: the bounds assume stage seconds linear in the layer count)."""
        if self.exact:
            return math.inf
        return self.top[-1][0] if len(self.top) >= self.opt.top_k else math.inf

    def prunes(self, bound: float) -> bool:
        return bound > self.ub() * (1 + LB_SLACK)

    def offer(self, cand: Candidate) -> None:
        """Keeps ``cand`` if it is among the k best in :func:`rank_key` order (a plan already kept, same JSON,
        is not added twice). Ties never change :meth:`ub` (the k-th least step time), so the pruning
        stays exact under any tie order."""
        key = rank_key(cand)
        if any(k[1] == key[-1] for k in self.top):
            return
        self.top.append((key[0], key[-1], cand, key))
        self.top.sort(key=lambda x: x[3])
        del self.top[self.opt.top_k:]

    # ---- per-stage costs (the same calls predict makes) -----------------------------------------
    def layer_lb(self, g: str, tp: int, dp: int, mbs: int, rec: str) -> float:
        """Lower bound of one layer's F + B seconds per microbatch on a stage of group ``g``
        (slowdown included; the last stage's fused F+B counted as its cheaper alternative). Cached."""
        key = (g, tp, dp, mbs, rec)
        if key not in self._layer_lb:
            c, tokens = self.costs[g], mbs // dp * self.seq
            lt = lambda ph: c.layer_time_s(self.cfg, tokens, self.seq, tp, ph, dp)
            fb = lt("F") + lt("B") if rec == "none" else lt("F_nosave") + lt("B_recompute")
            self._layer_lb[key] = self.factor[g] * min(fb, lt("B_recompute"))
        return self._layer_lb[key]

    def stage_lines(self, g: str, tp: int, dp: int, mbs: int, rec: str, first: bool, last: bool, fused: str):
        """``(F, B)`` seconds of one microbatch's actions on a stage of group ``g`` as lines ``(time at 1
        layer, time per extra layer)``, from the calls ``predict`` makes (``stage_compute_s`` x the
        island's slowdown factor). ``fused`` (last stage only): ``"all"`` when every forward directly
        precedes its own backward in the schedule (the runtime then runs one fused forward+backward
        action, phase ``B_recompute``, and the B action costs nothing), ``"none"`` when no forward does,
        ``"some"`` otherwise (then F is the cheaper of the two and B is 0: a lower bound)."""
        key = (g, tp, dp, mbs, rec, first, last, fused)
        if key not in self._lines:
            from hethub_jax.planner.predictor import stage_compute_s
            c, f, tokens = self.costs[g], self.factor[g], mbs // dp * self.seq
            sc = lambda n, ph: f * stage_compute_s(self.cfg, c, 0, n - 1, first, last, tokens, self.seq, tp, ph,
                                                   dp)  # the (dp, tp) mesh's figures, as predict asks
            def line(ph):
                one = sc(1, ph)
                return one, sc(2, ph) - one
            fph, bph = ("F", "B") if rec == "none" else ("F_nosave", "B_recompute")
            fl, bl = line(fph), line(bph)
            if last and fused == "all":
                fl, bl = line("B_recompute"), (0.0, 0.0)
            elif last and fused == "some":
                fu = line("B_recompute")
                fl, bl = (min(fl[0], fu[0]), min(fl[1], fu[1])), (0.0, 0.0)
            self._lines[key] = (fl, bl)
        return self._lines[key]

    def stage_times(self, g: str, tp: int, dp: int, mbs: int, rec: str, first: bool, last: bool,
                    fused: str = "none") -> List[float]:
        """``t[n]``, n = 0..L: seconds of F + B of one microbatch on a stage of ``n`` layers (lines of
        :meth:`stage_lines`; with measured stage shapes, :meth:`stage_fb` per ``n``); ``t[0] = inf``."""
        key = (g, tp, dp, mbs, rec, first, last, fused)
        if key not in self._times:
            if self.exact:
                self._times[key] = [math.inf] + [sum(self.stage_fb(*key, n)) for n in range(1, self.L + 1)]
            else:
                (fa, fs), (ba, bs) = self.stage_lines(*key)
                self._times[key] = [math.inf] + [fa + ba + (n - 1) * (fs + bs) for n in range(1, self.L + 1)]
        return self._times[key]

    def stage_fb(self, g: str, tp: int, dp: int, mbs: int, rec: str, first: bool, last: bool, fused: str,
                 n: int) -> Tuple[float, float]:
        """``(F, B)`` seconds of one microbatch's actions on a stage of ``n`` layers of group ``g``, each from
        the call ``predict`` makes (``stage_compute_s`` x the island's slowdown factor: a MEASURED stage
        shape's seconds where the profile has them), the last stage's fusion as in :meth:`stage_lines`
        (``"some"``: F the cheaper of the unfused F and the fused F+B, B 0: a lower bound)."""
        from hethub_jax.planner.predictor import stage_compute_s
        c, f, tokens = self.costs[g], self.factor[g], mbs // dp * self.seq
        sc = lambda ph: f * stage_compute_s(self.cfg, c, 0, n - 1, first, last, tokens, self.seq, tp, ph, dp)
        fph, bph = ("F", "B") if rec == "none" else ("F_nosave", "B_recompute")
        if last and fused == "all":
            return sc("B_recompute"), 0.0
        if last and fused == "some":
            return min(sc(fph), sc("B_recompute")), 0.0
        return sc(fph), sc(bph)

    def fused(self, sched: str, num_stages: int, M: int) -> str:
        """Whether the last stage's forwards run fused with their backwards (see :meth:`stage_lines`):
        1F1B's last stage has no warm-up, so every F is directly followed by its own B ("all"); GPipe's
        runs all F then all B, so only with M = 1 ("all", else "none"). Other schedules: read from the
        action lists."""
        if sched == "1f1b":
            return "all"
        if sched == "gpipe":
            return "all" if M == 1 else "none"
        key = (sched, num_stages, M)
        if key not in self._fused:
            acts = [a for a in get_schedule(sched)(num_stages, M)[-1] if a.is_compute]
            pairs = [i + 1 < len(acts) and acts[i + 1].kind.value == "B" and acts[i + 1].microbatch == a.microbatch
                     for i, a in enumerate(acts) if a.kind.value == "F"]
            self._fused[key] = "all" if all(pairs) else ("none" if not any(pairs) else "some")
        return self._fused[key]

    def step_lb(self, sk: Skeleton, counts: Sequence[int]) -> float:
        """A lower bound of ``predict``'s step time for ``sk`` split as ``counts``: the larger of the
        makespan (:func:`pipeline_time.makespan`) with every action at most as long as ``predict`` makes
        it and :func:`search_bounds.process_bound` (each island runs its stages one action at a time: its load
        plus the pipeline fill before and the drain after it, and under GPipe the round trip after its
        forwards; at least :func:`island_bound`), plus, for S >= 2 stages, the optimizer updates (the
        busiest island's sum over its stages, as ``predict`` adds them). The makespan is nondecreasing in
        every action time, and an island that runs several stages one action at a time only delays
        actions. The process bound and, for 1F1B, :func:`search_bounds.cycle_bound` (closed forms) are computed
        first; the makespan only when they cannot prune."""
        M, S = self.gbs // sk.microbatch_size, len(counts)
        fw, bw, act, grad, upd = self.action_times(sk, counts)
        lb = process_bound(sk.schedule, sk.stages, M, fw, bw, act, grad) + (upd if S > 1 else 0.0)
        if self.prunes(lb):
            return lb
        if sk.schedule == "1f1b":
            lb = max(lb, cycle_bound(M, fw, bw, act, grad) + (upd if S > 1 else 0.0))
            if self.prunes(lb):
                return lb
        return max(lb, makespan(sk.schedule, M, fw, bw, act, grad) + (upd if S > 1 else 0.0))

    def action_times(self, sk: Skeleton, counts: Sequence[int]):
        """``(fw, bw, act, grad, update)``: per stage, seconds of one microbatch's F and B with the host
        copies around them (:meth:`message_times`), per boundary the activation and gradient delivery
        seconds, and the busiest island's optimizer update seconds (lower bounds of ``predict``'s)."""
        sg, S, M = sk.stage_group(), len(counts), self.gbs // sk.microbatch_size
        fu = self.fused(sk.schedule, S, M)
        fw, bw, upd = [], [], {}
        for s, n in enumerate(counts):
            j = sg[s]
            g, first, last = sk.groups[j], s == 0, s == S - 1
            args = (g, sk.tp[j], sk.dp[j], sk.microbatch_size, sk.recompute, first, last, fu if last else "none")
            if self.exact:
                f_s, b_s = self.stage_fb(*args, n)
            else:
                (fa, fs), (ba, bs) = self.stage_lines(*args)
                f_s, b_s = fa + (n - 1) * fs, ba + (n - 1) * bs
            fw.append(f_s)
            bw.append(b_s)
            upd[g] = upd.get(g, 0.0) + self.update_s(g, sk.tp[j], n, first, last, sk.dp[j])
        act, grad = self.message_times(sk, counts, fw, bw)
        return fw, bw, act, grad, max(upd.values())

    def message_times(self, sk: Skeleton, counts: Sequence[int], fw: List[float], bw: List[float]):
        """Adds to ``fw``/``bw`` (in place) the host copies ``predict`` charges around each compute action
        (a RECV's copy onto the devices; a SEND's copy to the host when the peer is on another island) and
        returns the per-boundary delivery seconds (the bridge between islands, 0 inside one): the
        message of a microbatch is ``microbatch x seq_len x hidden`` activations in the compute dtype
        (``docs/predictor.md``). Returns ``(act, grad)`` lists for :func:`pipeline_time.makespan`."""
        from hethub_jax.planner import analytic
        sg, S = sk.stage_group(), len(counts)
        nbytes = sk.microbatch_size * self.seq * self.cfg.hidden_size * analytic.dtype_bytes(self.cfg.dtype)
        isl = [sk.groups[sg[s]] for s in range(S)]
        copy = [self.costs[g].host_copy_s(nbytes) for g in isl]
        delivery = []
        for s in range(S - 1):
            cross = isl[s] != isl[s + 1]
            delivery.append(self.bridge(tuple(zip(sk.groups, sk.groups[1:]))).time_s(nbytes) if cross else 0.0)
            fw[s] += copy[s] if cross else 0.0      # SEND_ACT after F
            fw[s + 1] += copy[s + 1]                # RECV_ACT before F
            bw[s] += copy[s]                        # RECV_GRAD before B
            bw[s + 1] += copy[s + 1] if cross else 0.0  # SEND_GRAD after B
        return delivery, list(delivery)

    def bridge(self, pairs: Tuple[Tuple[str, str], ...]):
        if pairs not in self._bridges:
            self._bridges[pairs] = bridge_for(self.cluster, pairs)
        return self._bridges[pairs]

    def update_s(self, g: str, tp: int, n: int, first: bool, last: bool, dp: int = 1) -> float:
        """Seconds of one stage's optimizer update (``DeviceCosts.update_time_s`` of its parameters per
        device on a ``dp``-way mesh, x the slowdown factor), as ``predict`` counts it."""
        key = (g, tp, n, first, last, dp)
        if key not in self._upd:
            from hethub_jax.planner import analytic
            nparam = analytic.stage_params_per_device(self.cfg, 0, n - 1, first, last, tp)
            self._upd[key] = self.factor[g] * self.costs[g].update_time_s(
                nparam, analytic.dtype_bytes(self.cfg.param_dtype), dp, tp)
        return self._upd[key]

    def stage_cap(self, g: str, tp: int, dp: int, mbs: int, rec: str, first: bool, last: bool,
                  in_flight: int) -> int:
        """Most layers a stage can hold within device memory (``predictor.stage_memory_bytes``), 0 if
        not even one layer fits. Memory is linear in the layer count."""
        key = (g, tp, dp, mbs, rec, first, last, in_flight)
        if key not in self._caps:
            from hethub_jax.planner.predictor import stage_memory_bytes
            mem = self.mem_limit[g] * (1 + LB_SLACK)
            m = lambda n: stage_memory_bytes(self.cfg, 0, n - 1, first, last, microbatch_size=mbs,
                                             seq_len=self.seq, dp=dp, tp=tp, in_flight=in_flight,
                                             recompute=rec).total
            m1 = m(1)
            if m1 > mem:
                cap = 0
            else:
                slope = m(2) - m1
                cap = self.L if slope <= 0 else min(self.L, 1 + int((mem - m1) // slope))
            self._caps[key] = cap
        return self._caps[key]

    def tables(self, sk: Skeleton, num_microbatches: Optional[int] = None,
               last_fused: Optional[str] = None) -> List[List[float]]:
        """Per pipeline stage of ``sk``, ``t[n]`` with ``inf`` where ``n`` layers do not fit memory."""
        S, sg = sk.num_stages, sk.stage_group()
        M = num_microbatches or self.gbs // sk.microbatch_size
        out = []
        for s in range(S):
            j, first, last = sg[s], s == 0, s == S - 1
            args = (sk.groups[j], sk.tp[j], sk.dp[j], sk.microbatch_size, sk.recompute, first, last)
            inflight = 0 if (last and sk.schedule == "1f1b") else in_flight_bound(sk.schedule, S, s, M)
            fu = (last_fused or self.fused(sk.schedule, S, M)) if last else "none"
            out.append(self._capped_table(args + (inflight, fu)))
        return out

    def _capped_table(self, key: tuple) -> List[float]:
        """``t[n]`` of :meth:`stage_times` with ``inf`` above :meth:`stage_cap`; ``key`` = (group, tp, dp,
        microbatch size, recompute, first, last, in-flight microbatches, fused). Cached; read only."""
        if key not in self._capped:  # shared across pipeline orders and configurations: read only
            cap = self.stage_cap(*key[:7], key[7])
            t = self.stage_times(*key[:7], key[8])
            self._capped[key] = t if cap >= self.L else t[:cap + 1] + [math.inf] * (self.L - cap)
        return self._capped[key]

    def kind_bound(self, mbs: int, rec: str, sched: str, groups: Tuple[str, ...], ks: Tuple[int, ...]) -> float:
        """Lower bound (seconds) of the step time of every pipeline with groups in order ``groups`` holding
        ``ks`` stages each, WHATEVER their TP/DP choices and layer split: :func:`search_bounds.joint_suffix_bounds`
        on per-stage tables that are, elementwise, the least over the group's choices with that stage count
        (:meth:`tables` at the stage's pipeline position; ``inf`` only where no choice fits), with the host
        copies and crossings :meth:`message_times` charges (they do not depend on TP/DP). The recursion runs
        from the last group; a suffix of groups after the first depends only on those groups, their stage
        counts and the delivery seconds (positions counted from the end), so its tables are shared between
        orders and stage counts (cached). Cached per argument tuple."""
        key = (mbs, rec, sched, groups, ks)
        if key not in self._kind:
            self._kind_batch(mbs, rec, sched, [(groups, ks)])
        return self._kind[key]

    def _kind_batch(self, mbs: int, rec: str, sched: str, orders) -> None:
        """Fill :meth:`kind_bound`'s cache for ``orders`` (``(groups, ks)`` pairs): the suffix after the first
        group from the shared cache, then the first group's step once per (first group, its stage count,
        delivery seconds) for all its orders at once (numpy rows)."""
        import numpy as np

        from hethub_jax.planner import analytic
        from hethub_jax.planner.search_bounds import joint_group_step, terminal_suffix
        M, L = self.gbs // mbs, self.L
        nbytes = mbs * self.seq * self.cfg.hidden_size * analytic.dtype_bytes(self.cfg.dtype)
        batches: Dict[tuple, list] = {}
        for groups, ks in orders:
            S, G = sum(ks), len(groups)
            if L < S or not all(any(c[0] == k for c in self.choices(g, mbs)) for g, k in zip(groups, ks)):
                self._kind[(mbs, rec, sched, groups, ks)] = math.inf
                continue
            d = self.bridge(tuple(zip(groups, groups[1:]))).time_s(nbytes) if G > 1 else 0.0
            fu = self.fused(sched, S, M)
            V, C = terminal_suffix(L)
            after = 0
            for j in range(G - 1, 0, -1):  # the suffix after the first group: shared between orders
                skey = (mbs, rec, sched, d, fu, groups[j:], ks[j:])
                if skey not in self._suffix:
                    u = self._kind_rows(groups[j], ks[j], mbs, rec, sched, False, j == G - 1, after, fu, nbytes)
                    rt = [0.0] * (ks[j] - 1) + [2.0 * d if j < G - 1 else 0.0]
                    self._suffix[skey] = joint_group_step(u, rt, [after + ks[j] - i for i in range(ks[j])], M, sched,
                                                          V, C)
                V, C = self._suffix[skey]
                after += ks[j]
            batches.setdefault((groups[0], ks[0], d, fu, G, after), []).append(((groups, ks), V, C))
        for (g, k, d, fu, G, after), items in batches.items():
            u = self._kind_rows(g, k, mbs, rec, sched, True, G == 1, after, fu, nbytes)
            rt = [0.0] * (k - 1) + [2.0 * d if G > 1 else 0.0]
            vals, _ = joint_group_step(u, rt, [after + k - i for i in range(k)], M, sched,
                                       np.stack([v for _, v, _ in items]), np.stack([c for _, _, c in items]),
                                       root=True)
            for (key, _, _), v in zip(items, np.atleast_1d(vals).tolist()):
                self._kind[(mbs, rec, sched) + key] = v

    def _kind_rows(self, g: str, k: int, mbs: int, rec: str, sched: str, first_group: bool, last_group: bool,
                   after: int, fu: str, nbytes: float):
        """``(k, L + 1)`` array for :meth:`kind_bound`: per stage of group ``g`` (``k`` stages, ``after`` stages
        after them), the least over the group's choices of its capped table (:meth:`tables`' in-flight counts
        and fused last stage) at the layer count ``balanced`` gives it, plus the host copies
        :meth:`message_times` charges there (a RECV before F on every stage but the pipeline's first, a RECV
        before B on every stage but the last, a SEND's copy on each side of a crossing). Cached."""
        key = (g, k, mbs, rec, sched, first_group, last_group, after, fu)
        if key not in self._rows:
            import numpy as np

            from hethub_jax.planner.search_bounds import _balanced_counts
            S_after = after + k  # stages from this group's first to the pipeline's end
            M = self.gbs // mbs
            chs = [(tp, dp) for kk, tp, dp in self.choices(g, mbs) if kk == k]
            copy = self.costs[g].host_copy_s(nbytes)
            rows = []
            for i in range(k):
                first, last = first_group and i == 0, last_group and i == k - 1
                to_end = S_after - i  # S - s
                inflight = 0 if (last and sched == "1f1b") else (M if sched == "gpipe" else min(to_end, M))
                tabs = [self._capped_table((g, tp, dp, mbs, rec, first, last, inflight, fu if last else "none"))
                        for tp, dp in chs]
                n_copies = ((not first) + (to_end >= 2) + (to_end >= 2 and i == k - 1)
                            + (i == 0 and not first_group))
                rows.append(np.min(np.asarray(tabs, dtype=float), axis=0) + n_copies * copy)
            self._rows[key] = np.stack(rows)[np.arange(k)[:, None], _balanced_counts(k, self.L)]
        return self._rows[key]

    def kind_config_lb(self, mbs: int, rec: str, sched: str, combo) -> float:
        """Lower bound of every pipeline of configuration ``combo`` (per group in cluster order ``(k, tp,
        dp)``): the least :meth:`kind_bound` over the pipeline orders the search visits. Cached per stage
        counts (it does not depend on TP/DP)."""
        names = list(self.groups)
        ks = tuple(c[0] for c in combo)
        key = ("cfg", mbs, rec, sched, ks)
        if key not in self._kind:
            orders = [(tuple(names[j] for j in perm), tuple(ks[j] for j in perm))
                      for perm in itertools.permutations(range(len(names)))
                      if self.opt.last_group is None or names[perm[-1]] == self.opt.last_group]
            self._kind_batch(mbs, rec, sched, [o for o in orders if (mbs, rec, sched) + o not in self._kind])
            self._kind[key] = min((self._kind[(mbs, rec, sched) + o] for o in orders), default=math.inf)
        return self._kind[key]

    def order_lb(self, sk: Skeleton) -> float:
        """1F1B: lower bound (seconds) of the step time of every split of ``sk`` from its pipeline order,
        :func:`search_configs.order_cycle_bounds` for this order alone (pure Python, the same figures as
        :meth:`choice_figures`); 0 for other schedules."""
        G = len(sk.groups)
        if sk.schedule != "1f1b" or G < 2:
            return 0.0
        from hethub_jax.planner import analytic
        mbs, M = sk.microbatch_size, self.gbs // sk.microbatch_size
        nbytes = mbs * self.seq * self.cfg.hidden_size * analytic.dtype_bytes(self.cfg.dtype)
        key = ("order_lb", mbs, sk.recompute)
        if key not in self._const:
            self._const[key] = self.delivery_lb(mbs) / (2 * (len(self.groups) - 1))
        d = self._const[key]
        load, own = [], []
        for g, k, tp, dp in zip(sk.groups, sk.stages, sk.tp, sk.dp):
            c, w = self.costs[g].host_copy_s(nbytes), self.layer_lb(g, tp, dp, mbs, sk.recompute)
            cst = self.stage_constant(g, tp, dp, mbs, sk.recompute)
            load.append(k * (cst + 2 * c + w))
            own.append(cst + c + w)
        best, before = 0.0, 0.0
        after_k, after_l = sum(sk.stages), sum(load)
        for q in range(G - 1):
            after_k -= sk.stages[q]
            after_l -= load[q]
            v = 2 * q * d + before + -(-M // (1 + after_k)) * (2 * (G - 1 - q) * d + after_l + own[q])
            best = max(best, v)
            before += load[q]
        return best

    def order_fits(self, sk: Skeleton) -> bool:
        """Whether some layer split of ``sk`` may fit memory: every stage holds >= 1 layer and the groups'
        capacities sum to >= L. A group's layers are spread by :func:`balanced`, so it holds at most ``k m + r``
        layers, ``m`` the least layer cap of its stages at their pipeline positions (:meth:`stage_cap` with the
        in-flight microbatches :meth:`tables` uses), ``r`` the leading stages (from its first) whose cap
        exceeds ``m``; every count from ``k`` up to that fits (balanced counts grow with ``n``). A cheap test before :meth:`tables` (the configuration bound's caps
        do not know the positions: under 1F1B an early stage holds more microbatches)."""
        S, sg = sk.num_stages, sk.stage_group()
        if S > self.L:  # more stages than layers: no split (the best-first caller tests this first too)
            return False
        M = self.gbs // sk.microbatch_size
        caps = []
        for s in range(S):
            j, first, last = sg[s], s == 0, s == S - 1
            inflight = 0 if (last and sk.schedule == "1f1b") else in_flight_bound(sk.schedule, S, s, M)
            cap = self.stage_cap(sk.groups[j], sk.tp[j], sk.dp[j], sk.microbatch_size, sk.recompute, first, last,
                                 inflight)
            if cap < 1:
                return False
            caps.append(cap)
        total, s0 = 0, 0
        for k in sk.stages:  # the most a group holds with balanced(): every stage at least m = its least cap,
            c = caps[s0:s0 + k]  # plus one on each leading stage (from the first) that holds m + 1
            m = min(c)
            lead = next((i for i, x in enumerate(c) if x <= m), k)
            total += k * m + lead
            s0 += k
        return total >= self.L

    # ---- configurations --------------------------------------------------------------------------
    def microbatch_sizes(self) -> List[int]:
        given = self.opt.microbatch_sizes
        return sorted(m for m in (given or _divisors(self.gbs)) if m >= 1 and self.gbs % m == 0)

    def choices(self, g: str, mbs: int) -> List[Tuple[int, int, int]]:
        """Levels 2 and 3 for group ``g``: ``(stages, tp, dp)`` with ``dp`` the largest divisor of
        ``mbs`` such that ``stages * dp * tp`` devices fit the group and (``opt.runnable_stages``) the
        runtime runs ``stages`` stages of ``dp * tp`` devices on its nodes once split per stage
        (``rules.uniform_stages_run``; ``dp = 1`` always does, as ``tp`` divides the node). Where the rule
        lowers ``dp``, :attr:`restricted` records both (for :meth:`why_infeasible`). Also every smaller
        DP degree (dividing ``mbs``) whose ``(dp, tp)`` mesh the group's profile MEASURED
        (``DeviceCosts.measured_dp_degrees``): with measured DP figures a larger DP degree is not
        faster by assumption (fake CPU devices share one host's cores), so the search weighs them."""
        if (g, mbs) in self._choices:
            return self._choices[(g, mbs)]
        from hethub_jax.parallel.rules import uniform_stages_run
        grp = self.groups[g]
        out = self._choices[(g, mbs)] = []
        for tp in valid_tp_degrees(self.cfg, grp.devices_per_node, self.opt.tp_degrees):
            for k in range(1, min(self.opt.max_stages_per_group, self.L) + 1):
                if k * tp > grp.num_devices:
                    break
                dp = _largest_divisor_at_most(mbs, grp.num_devices // (k * tp))
                if self.opt.runnable_stages and not uniform_stages_run(k, dp * tp, grp.devices_per_node):
                    ok = max(d for d in _divisors(mbs)
                             if d < dp and uniform_stages_run(k, d * tp, grp.devices_per_node))
                    self.restricted[(g, mbs, k, tp)] = (dp, ok)
                    dp = ok
                out.append((k, tp, dp))
                measured = getattr(self.costs.get(g), "measured_dp_degrees", lambda t: ())(tp)
                out += [(k, tp, d) for d in sorted(measured, reverse=True)
                        if len(measured) > 1 and d < dp and mbs % d == 0
                        and (not self.opt.runnable_stages or uniform_stages_run(k, d * tp, grp.devices_per_node))]
        return out

    def combo_streams(self) -> Iterator[Tuple[float, int, str, str, Tuple[Tuple[int, int, int], ...]]]:
        """``(LB0, mbs, recompute, schedule, per-group choices in cluster order)`` in ascending LB0 (ties in
        a fixed order: the (microbatch size, recompute, schedule) row, then the flat index), LB0 a lower
        bound of the step time of every pipeline of those choices, whatever the order and split
        (:func:`search_configs.configuration_bounds`, numpy over all configurations of one (microbatch size,
        recompute, schedule) at once); the caller may stop at the first LB0 above the k-th best.
        Configurations whose groups cannot hold the layers in memory are left out. A row's arrays are built
        only when the stream reaches its cheap bound (``configuration_bounds`` of one relaxed configuration:
        per group the least ``K`` and ``w``, the most ``k`` and ``cap`` over its choices, without the
        per-order terms; every term there is monotone in these, so it bounds every configuration of the
        row): rows whose cheap bound is never reached cost one small call."""
        import numpy as np

        from hethub_jax.planner.search_configs import configuration_bounds
        names, pending = list(self.groups), []
        for mbs in self.microbatch_sizes():
            M = self.gbs // mbs
            for rec in self.opt.recompute:
                choices = [self.choices(g, mbs) for g in names]
                if any(not cs for cs in choices):
                    continue
                for sched in self.opt.schedules:
                    per = [self.choice_figures(g, cs, mbs, rec, M if sched == "gpipe" else 0, len(names) > 1,
                                               M if sched == "1f1b" else 0)
                           for g, cs in zip(names, choices)]
                    cheap = self.row_cheap_bound(per, M, sched, mbs)
                    pending.append((cheap, len(pending), mbs, rec, sched, choices, per))
        pending.sort(key=lambda x: (x[0], x[1]))
        heap: List[tuple] = []
        i = 0
        while True:
            while i < len(pending) and (not heap or pending[i][0] <= heap[0][0]):
                cheap, r, mbs, rec, sched, choices, per = pending[i]
                i += 1
                if cheap == math.inf:
                    continue
                lb = configuration_bounds(per, self.L, self.gbs // mbs, sched, self.delivery_lb(mbs))
                keep = np.nonzero(np.isfinite(lb))[0]
                self.skeletons += int(lb.size - keep.size)
                if keep.size:
                    order = keep[np.argsort(lb[keep], kind="stable")]
                    vals = lb[order].tolist()
                    it = iter(zip(vals, order.tolist()))
                    v, flat = next(it)
                    heapq.heappush(heap, (v, r, flat, it, (mbs, rec, sched, choices)))
            if not heap:
                return
            v, r, flat, it, row = heapq.heappop(heap)
            mbs, rec, sched, choices = row
            idx = np.unravel_index(flat, [len(cs) for cs in choices])
            yield v, mbs, rec, sched, tuple(cs[int(x)] for cs, x in zip(choices, idx))
            nx = next(it, None)
            if nx is not None:
                heapq.heappush(heap, (nx[0], r, nx[1], it, row))

    def row_cheap_bound(self, per: Sequence[dict], M: int, sched: str, mbs: int) -> float:
        """A lower bound of every configuration bound of one (microbatch size, recompute, schedule) row
        (``per``: :meth:`choice_figures` per group): ``configuration_bounds`` of ONE relaxed configuration, per
        group the least ``K``, ``w`` and the most ``k``, ``cap`` over its choices, without the per-order terms
        (every remaining term is nondecreasing in ``K``, ``w`` and nonincreasing in ``k``, ``cap``)."""
        from hethub_jax.planner.search_configs import configuration_bounds
        relaxed = [{"k": [max(f["k"])], "w": [min(f["w"])], "K": [min(f["K"])], "cap": [max(f["cap"])],
                    "own": [min(f["own"])]} for f in per]
        return float(configuration_bounds(relaxed, self.L, M, sched, self.delivery_lb(mbs), orders=False)[0])

    def choice_figures(self, g: str, choices, mbs: int, rec: str, in_flight: int, copies: bool,
                       one_f_one_b: int = 0) -> dict:
        """Per choice ``(k, tp, dp)`` of group ``g``: ``k``; ``w`` (:meth:`layer_lb`); ``K``, the island's
        per-microbatch seconds that do not grow with its layers, at least ``k`` x the least stage constant
        (:meth:`stage_constant`) plus, in a pipeline of >= 2 islands, ``2 k`` host copies (each stage
        RECVs at least once, each island SENDs across at least once; ``message_times``); ``own``: one of its
        stages' F + B at least (the constant, one layer, one RECV's host copy); ``cap``: ``k`` x
        the layers a middle stage holds with ``in_flight`` microbatches (:meth:`stage_cap`). With
        ``one_f_one_b = M`` (1F1B with M microbatches) the caps follow 1F1B's in-flight counts instead:
        the group's stages sit at ``k`` consecutive positions ``s..s+k-1``, and position ``s + i`` holds
        ``min(S - s - i, M) >= min(k - i, M)`` microbatches, except the pipeline's last stage (0 in flight: its
        fused forward + backward holds one microbatch's residuals, ``predictor.stage_memory_bytes``);
        memory grows with them. The group's layers are spread by :func:`balanced` (its first stage takes
        the most), and for ``k >= 2`` its first stage is not the pipeline's last and holds ``>= min(k, M)``: at
        most ``k x cap(min(k, M))`` layers fit (a first stage above its cap does not fit; one at ``cap`` leaves no
        stage more); for ``k = 1`` at most ``cap(0)``."""
        from hethub_jax.planner import analytic
        nbytes = mbs * self.seq * self.cfg.hidden_size * analytic.dtype_bytes(self.cfg.dtype)
        c = self.costs[g].host_copy_s(nbytes) if copies else 0.0
        out: Dict[str, list] = {"k": [], "w": [], "K": [], "cap": [], "own": []}
        for k, tp, dp in choices:
            out["k"].append(k)
            out["w"].append(self.layer_lb(g, tp, dp, mbs, rec))
            out["K"].append(k * (self.stage_constant(g, tp, dp, mbs, rec) + 2 * c))
            out["own"].append(self.stage_constant(g, tp, dp, mbs, rec) + c + out["w"][-1])
            cap = lambda f: self.stage_cap(g, tp, dp, mbs, rec, False, False, f)
            if one_f_one_b:  # balanced() gives the group's first stage (the most in flight) the most layers
                out["cap"].append(cap(0) if k == 1 else k * cap(min(k, one_f_one_b)))
            else:
                out["cap"].append(k * cap(in_flight))
        return out

    def stage_constant(self, g: str, tp: int, dp: int, mbs: int, rec: str) -> float:
        """``min_v (a_v - s_v)`` over the stage variants of :meth:`stage_lines` (F + B at ``n`` layers ``=
        a_v + (n - 1) s_v`` with ``s_v >=`` :meth:`layer_lb`): a stage of ``n`` layers takes at least this
        plus ``n`` x ``layer_lb`` seconds per microbatch (no host copies). The variants: a middle stage, a
        last stage fused or partly fused; the first stage's embedding and an unfused last stage's head
        only add seconds (``predictor.stage_compute_s``: non-negative terms)."""
        key = (g, tp, dp, mbs, rec)
        if key not in self._const:
            out = math.inf
            for last, fused in ((False, "none"), (True, "all"), (True, "some")):
                (fa, fs), (ba, bs) = self.stage_lines(g, tp, dp, mbs, rec, False, last, fused)
                out = min(out, fa + ba - fs - bs)
            self._const[key] = out
        return self._const[key]

    def delivery_lb(self, mbs: int) -> float:
        """Bridge delivery seconds on microbatch 0's round trip in any pipeline of ``G`` groups: ``2 (G -
        1)`` crossings over at least the fastest group pair's link (:meth:`round_trip_lb` without copies)."""
        from hethub_jax.planner import analytic
        from hethub_jax.planner.costs import LinkModel
        names = list(self.groups)
        if len(names) < 2:
            return 0.0
        nbytes = mbs * self.seq * self.cfg.hidden_size * analytic.dtype_bytes(self.cfg.dtype)
        links = [self.cluster.link(a, b) for a, b in itertools.combinations(names, 2)]
        return 2 * (len(names) - 1) * min(LinkModel(lat, bw).time_s(nbytes) for bw, lat in links)

    def round_trip_lb(self, mbs: int) -> float:
        """Lower bound of the message seconds on microbatch 0's forward-and-backward chain in any pipeline
        plan of microbatch size ``mbs``: a pipeline uses all ``G`` groups, each its own island, so at
        least ``G - 1`` stage boundaries cross the bridge, each crossed by the activation and the gradient
        (``microbatch x seq_len x hidden`` in the compute dtype), each crossing costing a delivery over the
        plan's bridge (some group pair's link: at least the fastest pair's ``LinkModel.time_s``) and two
        host copies (the SEND's on the sender, the RECV's on the receiver: at least the cheapest group's
        ``host_copy_s``), as ``predict`` charges them. 0 for one group."""
        from hethub_jax.planner import analytic
        from hethub_jax.planner.costs import LinkModel
        names = list(self.groups)
        if len(names) < 2:
            return 0.0
        nbytes = mbs * self.seq * self.cfg.hidden_size * analytic.dtype_bytes(self.cfg.dtype)
        links = [self.cluster.link(a, b) for a, b in itertools.combinations(names, 2)]
        d = min(LinkModel(lat, bw).time_s(nbytes) for bw, lat in links)
        c = min(self.costs[g].host_copy_s(nbytes) for g in names)
        return 2 * (len(names) - 1) * (d + 2 * c)

    def twin_class(self, g: str) -> Any:
        """Groups of one class are interchangeable: same fields but the name, and no explicit link names
        them (so every link to them is the default one). Swapping two of them changes no prediction."""
        linked = {n for link in self.cluster.links for n in link.between}
        if g in linked or self.opt.last_group == g:
            return g
        return json.dumps(self.groups[g].model_dump(exclude={"name"}), sort_keys=True)

    def skeletons_of(self, mbs: int, rec: str, combo, schedules: Optional[Sequence[str]] = None) -> Iterator[Skeleton]:
        """Every pipeline order and schedule (``schedules``, default all) for one choice per group
        (``combo`` in cluster order), except those equal to one already given up to swapping
        interchangeable groups (:meth:`twin_class`)."""
        names = list(self.groups)
        cls = [self.twin_class(g) for g in names]
        for sched in schedules or self.opt.schedules:
            for perm in itertools.permutations(range(len(names))):
                if self.opt.last_group is not None and names[perm[-1]] != self.opt.last_group:
                    continue
                sig = (mbs, rec, sched, tuple((cls[j], combo[j]) for j in perm))
                if self.dedupe and sig in self._seen:
                    continue
                self._seen.add(sig)
                yield Skeleton(mbs, sched, rec, tuple(names[j] for j in perm),
                               tuple(combo[j][0] for j in perm), tuple(combo[j][1] for j in perm),
                               tuple(combo[j][2] for j in perm))

    # ---- level 1 inside one configuration: branch and bound over the splits ------------------------
    def group_tables(self, sk: Skeleton, times: List[List[float]]) -> List[List[float]]:
        """Per group ``j`` of ``sk``, ``f[n]``: the island's compute per microbatch when it holds ``n``
        layers spread evenly over its stages (:func:`balanced`); ``inf`` if a stage exceeds memory or
        ``n`` is below the group's stage count. Nondecreasing in ``n``."""
        out, s0 = [], 0
        for k in sk.stages:
            f = [math.inf] * (self.L + 1)
            if k <= self.L:
                cur = sum(times[s0 + i][1] for i in range(k))
                f[k] = cur
                for n in range(k + 1, self.L + 1):  # balanced(n, k) adds one layer to stage (n - 1) % k
                    i, c = (n - 1) % k, (n - 1) // k
                    cur += times[s0 + i][c + 1] - times[s0 + i][c]
                    f[n] = cur if cur == cur else math.inf  # inf - inf is nan
                    if f[n] == math.inf:
                        break
            out.append(f)
            s0 += k
        return out

    def expand(self, sk: Skeleton) -> None:
        """Evaluate every split of ``sk`` that can still enter the top k (module docstring)."""
        self.skeletons += 1
        G, M, L = len(sk.groups), self.gbs // sk.microbatch_size, self.L
        if L < sk.num_stages:
            return
        times = self.tables(sk)
        gt = self.group_tables(sk, times)
        beta, per_group = greedy_bottleneck_split(gt, L, sk.stages)
        if not per_group or self.prunes(M * beta):
            return
        bounds = self.split_bounds(sk, times)
        if sk.schedule == "gpipe" and self.prunes(M * beta + sum(bounds.rt)):  # process_bound: + the crossings
            return
        self.expanded += 1
        self.evaluate(sk, _stage_counts(sk, per_group))
        self._dfs(sk, times, gt, bounds, 0, L, 0.0, [])

    def split_bounds(self, sk: Skeleton, times: List[List[float]]) -> SplitBounds:
        """:class:`search_bounds.SplitBounds` of ``sk``: the host copies and deliveries ``predict`` charges
        (:meth:`message_times`, independent of the split) and each stage's compute line from ``times``."""
        S, M = sk.num_stages, self.gbs // sk.microbatch_size
        fw, bw = [0.0] * S, [0.0] * S
        act, _ = self.message_times(sk, [1] * S, fw, bw)
        one = [t[1] for t in times]
        slope = [t[2] - t[1] if self.L >= 2 and t[2] < math.inf else 0.0 for t in times]
        return SplitBounds(sk.stages, M, [f + b for f, b in zip(fw, bw)], act, one, slope, sk.schedule == "1f1b",
                           sk.schedule == "gpipe", self.L)

    def _dfs(self, sk: Skeleton, times, gt, bounds: SplitBounds, j: int, left: int, head: float,
             cur: List[int]) -> None:
        """Depth-first over group ``j``'s layer count (most first), the groups before it holding ``cur``;
        a prefix is dropped when a :class:`SplitBounds` bound exceeds the k-th best (module docstring)."""
        G, M = len(sk.groups), self.gbs // sk.microbatch_size
        need = sum(sk.stages[j + 1:])
        hi = left if j == G - 1 else left - need
        lo = left if j == G - 1 else sk.stages[j]
        b0 = bounds.first[j]
        for n in range(hi, lo - 1, -1):
            ub = self.ub() * (1 + LB_SLACK)
            if gt[j][n] == math.inf or not M * gt[j][n] + head <= ub:  # inf: a stage exceeds memory
                continue
            ts = [times[b0 + i][c] for i, c in enumerate(balanced(n, sk.stages[j]))]
            nxt = bounds.group(j, head, ts, left - n, ub)
            if nxt == math.inf:
                continue
            cur.append(n)
            if j == G - 1:
                self.evaluate(sk, _stage_counts(sk, cur))
            else:
                self._dfs(sk, times, gt, bounds, j + 1, left - n, nxt, cur)
            cur.pop()

    # ---- evaluation ------------------------------------------------------------------------------
    def pipeline_plan(self, sk: Skeleton, counts: Sequence[int]) -> Plan:
        stages, first, sg = [], 0, sk.stage_group()
        for s, n in enumerate(counts):
            j = sg[s]
            stages.append({"island": sk.groups[j], "dp": sk.dp[j], "tp": sk.tp[j], "first_layer": first,
                           "last_layer": first + n - 1})
            first += n
        names = [g for g in self.groups if g in sk.groups]
        return Plan.from_dict({
            "description": f"PREDICTED plan from python -m hethub_jax.plan (cluster {self.cluster.name}): "
                           f"pipeline {' -> '.join(sk.groups)}, layers {list(counts)}",
            "islands": islands_of(self.cluster, names), "stages": stages, "global_batch_size": self.gbs,
            "microbatch_size": sk.microbatch_size, "schedule": sk.schedule, "recompute": sk.recompute,
            "seq_len": self.seq})

    def evaluate(self, sk: Skeleton, counts: Sequence[int], bound: bool = True) -> None:
        if bound and self.prunes(self.step_lb(sk, counts)):
            return
        plan = self.pipeline_plan(sk, counts)
        pairs = list(zip(sk.groups, sk.groups[1:]))
        self.consider(plan, "pipeline", (tuple(counts),), pairs)

    def consider(self, plan: Plan, kind: str, layers, pairs) -> None:
        """``predict`` the plan (memoised on its JSON) and offer it to the top k if it fits memory."""
        key = plan.to_json(indent=None)
        if key not in self._preds:
            from hethub_jax.planner.predictor import predict
            used = {st.island for rep in plan.replicas for st in rep.stages}
            self._preds[key] = predict(self.cfg, plan, {n: self.costs[n] for n in used}, seq_len=self.seq,
                                       bridge=bridge_for(self.cluster, pairs),
                                       grad_bucket_mb=self.opt.grad_bucket_mb)
            self.evaluated += 1
        pred = self._preds[key]
        if self.fits(pred):
            self.offer(Candidate(plan, pred, kind, tuple(layers), self.mfu(plan, pred)))

    def fits(self, pred: Any) -> bool:
        """Every stage's PREDICTED memory per device is within its group's :attr:`mem_limit` (the
        device's capacity less ``memory_headroom``; ``Prediction.fits`` with headroom 0)."""
        return all(sp.memory.total <= self.mem_limit[sp.island] for sp in pred.stages)

    def mfu(self, plan: Plan, pred: Any) -> float:
        """Predicted model FLOPs utilisation (see :class:`Candidate`)."""
        from hethub_jax.planner import analytic
        from hethub_jax.planner.catalog import get_device
        tokens = self.gbs * self.seq
        flops = 3.0 * (self.L * analytic.layer_flops(self.cfg, tokens, self.seq) + analytic.head_flops(self.cfg, tokens))
        peak = 0.0
        for isl in plan.islands:
            g, c = self.groups[isl.name], self.costs[isl.name]
            spec = getattr(c, "spec", None) or (get_device(g.device) if g.device else None)
            peak += g.num_devices * (spec.peak_flops / self.factor[isl.name] if spec else math.nan)
        return flops / (pred.step_time_s * peak) if pred.step_time_s > 0 else math.nan

    # ---- heterogeneous data parallelism ----------------------------------------------------------
    def replica_of(self, g: str, mbs: int, sched: str, rec: str, M: int):
        """The group's own pipeline for the hetero-DP family: over its choices (layers spread evenly over
        the stages), the one with the least island compute per microbatch (the island runs its stages
        one action at a time; ties to the earlier choice). ``(seconds, skeleton, counts)`` or None. Choices
        are visited in increasing order of a lower bound of that compute (``k x`` :meth:`stage_constant`
        ``+ L x`` :meth:`layer_lb`, as :meth:`hetero_lb`) and skipped once it exceeds the best found."""
        best, key = None, None
        lbs = []
        for i, (k, tp, dp) in enumerate(self.choices(g, mbs)):
            if self.L >= k and self.replica_may_fit(g, k, tp, dp, mbs, rec, M):
                lbs.append((k * self.stage_constant(g, tp, dp, mbs, rec) + self.L * self.layer_lb(g, tp, dp, mbs, rec),
                            i, (k, tp, dp)))
        for lb, i, (k, tp, dp) in sorted(lbs):
            if key is not None and lb > key[0]:
                break
            sk = Skeleton(mbs, sched, rec, (g,), (k,), (tp,), (dp,))
            per_mb = self.group_tables(sk, self.tables(sk, M))[0][self.L]
            if per_mb < math.inf and (key is None or (per_mb, i) < key):
                key, best = (per_mb, i), (per_mb, sk, tuple(balanced(self.L, k)))
        return best

    def hetero(self) -> None:
        """Evaluate the hetero-DP family: per (microbatch size, schedule, recompute), one replica per group."""
        names = list(self.groups)
        for mbs in self.microbatch_sizes():
            M = self.gbs // mbs
            if M < len(names):
                continue
            for sched in self.opt.schedules:
                for rec in self.opt.recompute:
                    self.skeletons += 1
                    if self.prunes(self.hetero_lb(mbs, rec, M)):
                        continue
                    reps = [self.replica_of(g, mbs, sched, rec, M) for g in names]
                    if any(r is None for r in reps):
                        continue
                    units = proportional_shares(M, [mbs / r[0] for r in reps])
                    # bound: replica r computes u_r microbatches on its island; the last stage counted
                    # at the cheaper of fused and unfused (u_r, not M, decides GPipe's fusion)
                    if self.prunes(self.hetero_plan_lb(names, reps, units, M)):
                        continue
                    self.expanded += 1
                    self.consider(self.hetero_plan(reps, units, mbs, sched, rec), "hetero-dp",
                                  [r[2] for r in reps], list(itertools.combinations(names, 2)))

    def hetero_plan_lb(self, names: Sequence[str], reps, units: Sequence[int], M: int) -> float:
        """Lower bound of the step time of the hetero-DP plan of replicas ``reps`` (:meth:`replica_of` per group of
        ``names``) holding ``units`` microbatches each: replica ``r`` computes its ``u_r`` microbatches on its
        island, each at least ``lb_r`` (its pipeline's per-microbatch compute with the last stage counted at
        the cheaper of fused and unfused: ``u_r``, not ``M``, decides GPipe's fusion), so at least
        ``(u_r - d_r) lb_r``, ``d_r`` = :meth:`bucket_slack` for a one-stage replica of >= 2 microbatches (the
        bucketed path's chunked last microbatch may run faster than fused), else 0."""
        lbs = [self.group_tables(r[1], self.tables(r[1], M, "some"))[0][self.L] for r in reps]
        return max((u - (self.bucket_slack(g) if r[1].stages == (1,) and u >= 2 else 0.0)) * lb
                   for g, r, u, lb in zip(names, reps, units, lbs))

    def hetero_lb(self, mbs: int, rec: str, M: int) -> float:
        """Lower bound of every hetero-DP plan's step time for one microbatch size and recompute policy
        (any schedule): replica ``r`` computes its ``u_r`` microbatches (``sum_r u_r = M``) on its island, at
        least ``c_r`` seconds each, ``c_r`` the least over the group's choices that may hold the layers
        (:meth:`replica_may_fit`) of ``k x`` :meth:`stage_constant` ``+ L x`` :meth:`layer_lb`; so the step
        takes at least ``M / sum_r 1/c_r``. When the ranked path may be the bucketed one
        (:meth:`bucket_slack` ``d_r``), replica ``r`` computes at least ``(u_r - d_r) c_r`` and the step takes
        at least ``(M - sum_r d_r) / sum_r 1/c_r`` (``T`` with ``sum_r (T / c_r + d_r) = M``)."""
        inv, slack = 0.0, 0.0
        for g in self.groups:
            slack += self.bucket_slack(g)
            c = min((k * self.stage_constant(g, tp, dp, mbs, rec) + self.L * self.layer_lb(g, tp, dp, mbs, rec)
                     for k, tp, dp in self.choices(g, mbs) if self.replica_may_fit(g, k, tp, dp, mbs, rec, M)),
                    default=math.inf)
            inv += 1.0 / c if c > 0 else math.inf
        return max(0.0, M - slack) / inv if inv > 0 else math.inf

    def bucket_slack(self, g: str) -> float:
        """How many fused microbatches' compute the bucketed gradient all-reduce may save on a replica of group
        ``g``, for the hetero-DP bounds: ``max(0, 1 - rho)``, ``rho`` = ``predict_buckets.min_chunked_last_ratio``
        of the group's costs, when candidates may be ranked by the bucketed path (``grad_bucket_mb`` not None),
        else 0. Why it keeps the bounds valid: on the bucketed path (``predictor._bucketed``,
        ``predict_buckets`` items 1-2) only a chunked replica's LAST compute action changes, to
        ``ratio x`` its seconds ``+ on_core_s`` (>= 0), ``ratio >= rho``; that action is one microbatch's fused
        F+B, at least the per-microbatch bound ``lb`` of :meth:`hetero`, so the replica's compute is at least
        ``(u - 1) lb + min(1, rho) lb = (u - d) lb``; the step is at least that pipeline (the all-reduce tail
        and the update after it are >= 0). ``rho >= 1`` (and catalog costs, no fit: 1.0): 0, the bounds as before."""
        if self.opt.grad_bucket_mb is None:
            return 0.0
        from hethub_jax.planner.predict_buckets import min_chunked_last_ratio
        return max(0.0, 1.0 - min_chunked_last_ratio(self.costs[g]))

    def replica_may_fit(self, g: str, k: int, tp: int, dp: int, mbs: int, rec: str, M: int) -> bool:
        """False when no hetero-DP replica of group ``g`` with ``k`` stages at (tp, dp) can hold the L layers in
        memory, under any schedule: its layers are spread by :func:`balanced` (the first stage takes the
        most), and the first stage holds at least ``min(k, M)`` microbatches in flight under 1F1B (``M`` under
        GPipe, more memory), so at most ``k x`` :meth:`stage_cap` at that count fit (``k = 1``: the single stage
        at 0 in flight, the fused last stage's count); the embedding only adds memory. An upper bound of
        what :meth:`tables` admits, so skipping such choices changes no replica."""
        if k == 1:
            return self.stage_cap(g, tp, dp, mbs, rec, False, False, 0) >= self.L
        return k * self.stage_cap(g, tp, dp, mbs, rec, False, False, min(k, M)) >= self.L

    def hetero_plan(self, reps, units, mbs: int, sched: str, rec: str) -> Plan:
        replicas = []
        for (per_mb, sk, counts), u in zip(reps, units):
            first, stages = 0, []
            for n in counts:
                stages.append({"island": sk.groups[0], "dp": sk.dp[0], "tp": sk.tp[0], "first_layer": first,
                               "last_layer": first + n - 1})
                first += n
            replicas.append({"stages": stages, "batch_share": u * mbs, "throughput": mbs / per_mb})
        return Plan.from_dict({
            "description": f"PREDICTED plan from python -m hethub_jax.plan (cluster {self.cluster.name}): "
                           f"heterogeneous DP, one replica per group, shares {[u * mbs for u in units]}",
            "islands": islands_of(self.cluster), "replicas": replicas, "global_batch_size": self.gbs,
            "microbatch_size": mbs, "schedule": sched, "recompute": rec, "seq_len": self.seq})

    # ---- infeasibility ---------------------------------------------------------------------------
    def runtime_rule_binds(self) -> Optional[str]:
        """When the runtime's stage-size rule (``opt.runnable_stages``) lowered some DP degree and the same
        search without it finds a plan, the sentence naming that rule as the binding constraint; else None."""
        if not self.opt.runnable_stages or not self.restricted:
            return None
        try:
            r = search(self.cfg, self.cluster, self.gbs, self.seq, costs=self.costs,
                       options=dataclasses.replace(self.opt, runnable_stages=False, top_k=1))
        except PlanningError:
            return None
        plan, shown = r.best.plan, []
        for isl in plan.islands:
            keys = plan.island_stages(isl.name)
            if not keys:
                continue
            st = plan.stage(*keys[0])
            shown.append(f"group {isl.name!r}: {len(keys)} stage(s) of dp {st.dp} x tp {st.tp} = {st.dp * st.tp} "
                         f"devices on {isl.devices_per_process}-device nodes")
        lowered = "; ".join(f"group {g!r} at microbatch {m}, {k} stages, tp {t}: dp {a} -> {b}"
                            for (g, m, k, t), (a, b) in list(self.restricted.items())[:4])
        return ("infeasible: the binding constraint is today's runtime's stage-size rule: a node group holding "
                "several stages must give each stage's dp x tp devices inside one node or a whole number of "
                "nodes (a stage that spans nodes partly shares a process with its neighbour, which no split per "
                "stage runs; parallel.rules.uniform_stages_run); it lowers DP, so each device holds more of the "
                f"microbatch ({lowered}{', ...' if len(self.restricted) > 4 else ''}). Without it the best plan "
                f"({r.best.step_time_s:.4g} s PREDICTED, not runnable today) has {'; '.join(shown)}. Try other "
                "stage counts per group (--max-stages-per-group), smaller microbatches (--microbatch-sizes), "
                "recompute, or devices with more memory")

    def memory_text(self, g: str) -> str:
        """``"178.81 GiB per device, 169.87 GiB usable with memory headroom 5%"`` (binary units, as the
        tables; the second part only with a headroom)."""
        cap = self.costs[g].memory_bytes
        h = float(self.opt.memory_headroom)
        usable = f", {self.mem_limit[g] / 2**30:.2f} GiB usable with memory headroom {100 * h:g}%" if h else ""
        return f"{cap / 2**30:.2f} GiB per device{usable}"

    def why_infeasible(self) -> str:
        """The binding constraint when no candidate fits (most memory-friendly settings tried first)."""
        mbs = self.microbatch_sizes()[0] if self.microbatch_sizes() else 1
        rec = "full" if "full" in self.opt.recompute else self.opt.recompute[0]
        lines, total = [], 0
        for g, grp in self.groups.items():
            tps = valid_tp_degrees(self.cfg, grp.devices_per_node, self.opt.tp_degrees)
            if not tps:
                lines.append(f"group {g!r}: no valid TP degree divides its {grp.devices_per_node} devices per node "
                             f"and the model's heads")
                continue
            tp = tps[-1]
            cap = self.stage_cap(g, tp, 1, mbs, rec, False, False, 1)
            lines.append(f"group {g!r} ({grp.device or 'profile'}, {self.memory_text(g)}): at most {cap} decoder "
                         f"layer(s) per stage at TP={tp}, microbatch {mbs}, recompute {rec}")
            total += cap * min(self.opt.max_stages_per_group, grp.num_devices // tp)
        detail = "; ".join(lines)
        rule = self.runtime_rule_binds()
        if rule:
            return f"{rule}; {detail}"
        if self.L < len(self.groups) and (not self.opt.hetero_dp or self.gbs // min(self.microbatch_sizes() or [1])
                                          < len(self.groups)):
            return (f"infeasible: the model has {self.L} layers, fewer than the {len(self.groups)} node groups a "
                    f"pipeline must use (every stage holds >= 1 layer), and the global batch of {self.gbs} is too "
                    f"small for one data-parallel replica per group")
        if total == 0:
            return ("infeasible: one decoder layer's memory exceeds every device type even at the highest TP "
                    f"degree: {detail}")
        if total < self.L:
            return (f"infeasible: the model's {self.L} layers do not fit the cluster's memory: at most {total} "
                    f"fit with max_stages_per_group={self.opt.max_stages_per_group} (more stages per group hold "
                    f"more layers: raise --max-stages-per-group, SearchOptions.max_stages_per_group): {detail}")
        return ("infeasible: no plan of the search space fits device memory (the embedding / LM head stage or "
                f"the microbatch sizes {self.microbatch_sizes()} are the binding constraint): {detail}")


# ---------------------------------------------------------------------------------------------------
# public entry points

def _setup(cfg: Any, cluster: Any, global_batch: int, seq_len: int, costs, options, profiles_dir) -> _Planner:
    options = options or SearchOptions()
    cluster = load_cluster(cluster).resolved()
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer (samples), got {global_batch!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer (tokens), got {seq_len!r}")
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise ValueError(f"seq_len {seq_len} (tokens per sample, --seq-len) exceeds the model's "
                         f"max_position_embeddings {max_pos}: the model has no positions beyond it; give "
                         f"--seq-len <= {max_pos} or a model with a larger max_position_embeddings")
    h = options.memory_headroom
    if isinstance(h, bool) or not isinstance(h, (int, float)) or not (math.isfinite(h) and 0 <= h < 1):
        raise ValueError(f"memory_headroom (--memory-headroom) must be a fraction of device memory in [0, 1), "
                         f"got {h!r}")
    if options.top_k < 1 or options.max_stages_per_group < 1:
        raise ValueError(f"top_k and max_stages_per_group must be >= 1, got {options.top_k}, "
                         f"{options.max_stages_per_group}")
    for s in options.schedules:
        if s not in ("1f1b", "gpipe"):
            raise ValueError(f"schedules must be among ['1f1b', 'gpipe'], got {s!r}")
    for r in options.recompute:
        if r not in ("none", "full"):
            raise ValueError(f"recompute must be among ['none', 'full'], got {r!r}")
    if options.last_group is not None:
        cluster.group(options.last_group)
    gb = options.grad_bucket_mb
    if gb is not None and gb != "auto" and (isinstance(gb, (str, bool)) or not isinstance(gb, (int, float))
                                            or not (math.isfinite(gb) and gb > 0)):
        raise ValueError(f"grad_bucket_mb must be a number of MiB > 0, 'auto' (the runtime's warm-up rule on "
                         f"the PREDICTED steps) or None (all-reduce after the backward), got {gb!r}")
    if options.microbatch_sizes is not None and not any(global_batch % m == 0 for m in options.microbatch_sizes):
        raise ValueError(f"no microbatch size in {list(options.microbatch_sizes)} divides the global batch "
                         f"{global_batch}")
    costs = costs or group_costs(cluster, options.efficiency, profiles_dir)
    missing = [g.name for g in cluster.groups if g.name not in costs]
    if missing:
        raise ValueError(f"no device costs for group(s) {missing}")
    return _Planner(cfg, cluster, global_batch, seq_len, costs, options)


def search(cfg: Any, cluster: Any, global_batch: int, seq_len: int, *, costs: Optional[Mapping[str, Any]] = None,
           options: Optional[SearchOptions] = None, profiles_dir: Optional[str] = None,
           upper_bound: bool = False) -> SearchResult:
    """Find the ``options.top_k`` plans with the least PREDICTED step time that fit memory.

    Args:
      cfg: model config (``LlamaConfig``).
      cluster: a :class:`ClusterSpec`, a YAML path or a dict.
      global_batch: samples per optimizer step; seq_len: tokens per sample.
      costs: per group name, a ``costs.DeviceCosts``; default :func:`group_costs`.
      options: the search space (:class:`SearchOptions`).
      profiles_dir: folder of measured profiles (``<device>.json`` / ``<group>.json``).
      upper_bound: also compute the cluster's upper bound (one homogeneous search per group) and each
        candidate's ``upper_bound_fraction``.

    Returns:
      a :class:`SearchResult`; the same inputs give the same result on any run.
    Raises:
      ValueError: for bad input (naming it), before any search work.
      PlanningError: when no plan fits, naming the binding constraint.
    """
    t0 = time.perf_counter()
    p = _setup(cfg, cluster, global_batch, seq_len, costs, options, profiles_dir)
    best_first(p)
    if p.opt.hetero_dp and len(p.groups) > 1:
        p.hetero()
    if not p.top:
        raise PlanningError(p.why_infeasible())
    ub, note = _upper_bound(p) if upper_bound else (None, None)
    cands = tuple(_with_fraction(c, ub) for _, _, c, _ in p.top)
    return SearchResult(cands, p.skeletons, p.expanded, p.evaluated, time.perf_counter() - t0, ub, note)


def _with_fraction(c: Candidate, ub: Optional[float]) -> Candidate:
    if not ub:
        return c
    return Candidate(c.plan, c.prediction, c.kind, c.layers, c.mfu, c.tokens_per_s / ub)


def upper_bound_missing_note(missing: Sequence[str]) -> str:
    """Why the cluster's upper bound is not computed: the groups that cannot train the model alone."""
    return (f"upper bound not computed: group(s) {', '.join(missing)} cannot train the model alone (the bound "
            f"sums each group's best homogeneous tokens/s; without theirs it would not bound the cluster)")


def _upper_bound(p: _Planner) -> Tuple[Optional[float], Optional[str]]:
    """Sum over groups of the group's best homogeneous tokens/s (a search on that group alone), or
    ``(None, why)`` when a group cannot train the model alone."""
    total, missing = 0.0, []
    opt = SearchOptions(**{**p.opt.__dict__, "top_k": 1, "hetero_dp": False})
    for g in p.cluster.groups:
        sub = ClusterSpec.model_validate({"name": f"{p.cluster.name}/{g.name}", "groups": [g.model_dump()]})
        try:
            r = search(p.cfg, sub, p.gbs, p.seq, costs={g.name: p.costs[g.name]}, options=opt)
        except PlanningError:
            missing.append(g.name)
            continue
        total += r.best.tokens_per_s
    return (None, upper_bound_missing_note(missing)) if missing else (total, None)


def exhaustive_search(cfg: Any, cluster: Any, global_batch: int, seq_len: int, *,
                      costs: Optional[Mapping[str, Any]] = None,
                      options: Optional[SearchOptions] = None) -> SearchResult:
    """Reference for tests: ``predict`` on EVERY plan of :func:`search`'s space (every configuration,
    every split into contiguous stages), no bounds. Only for small models and clusters.

    Raises:
      PlanningError: when no plan fits.
    """
    t0 = time.perf_counter()
    p = _setup(cfg, cluster, global_batch, seq_len, costs, options, None)
    p.dedupe = False
    names = list(p.groups)
    for mbs in p.microbatch_sizes():
        for rec in p.opt.recompute:
            for combo in itertools.product(*(p.choices(g, mbs) for g in names)):
                for sk in p.skeletons_of(mbs, rec, combo):
                    p.skeletons += 1
                    G = len(sk.groups)
                    for cuts in itertools.combinations(range(1, p.L), G - 1):
                        b = (0,) + cuts + (p.L,)
                        per_group = [b[i + 1] - b[i] for i in range(G)]
                        if all(n >= k for n, k in zip(per_group, sk.stages)):
                            p.evaluate(sk, _stage_counts(sk, per_group), bound=False)
    if p.opt.hetero_dp and len(names) > 1:
        p.hetero()
    if not p.top:
        raise PlanningError(p.why_infeasible())
    return SearchResult(tuple(c for _, _, c, _ in p.top), p.skeletons, p.skeletons, p.evaluated,
                        time.perf_counter() - t0)
