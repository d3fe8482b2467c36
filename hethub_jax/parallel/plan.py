"""The plan: islands, pipeline stages, data-parallel replicas, batch and schedule (pure Python, no JAX).

A plan is plain data (DESIGN.md section 2), saved as JSON (format: ``docs/plan_format.md``), produced
by the planner or written by hand, and consumed by the runtime, the predictor and the simulator.
Loading (:meth:`Plan.from_json` / :meth:`Plan.from_dict`) checks keys and types only; :meth:`Plan.validate`
checks every constraint, before anything is compiled, and raises a ``ValueError`` naming the constraint
and the offending values.

Conventions:
  * layer ranges are inclusive: ``first_layer..last_layer``;
  * a replica is a full pipeline over all layers; several replicas are heterogeneous data parallelism
    (DESIGN.md section 6), each with an integer share of the global batch (in samples);
  * islands get consecutive MPI ranks in the order they are listed;
  * device indices are local to the island: positions in that island runtime's ``jax.devices()``.
"""
from __future__ import annotations

import json
import math
import numbers
import os
from fractions import Fraction
from typing import Annotated, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from pydantic import Field, PrivateAttr, StringConstraints, model_validator

from hethub_jax.parallel.rules import check_batch, check_shares, check_tp
from hethub_jax.typed import Float, StrictModel, TupleOf, validate_model

__all__ = ["IslandSpec", "StageSpec", "ReplicaSpec", "Plan", "proportional_shares", "SCHEDULE_NAMES",
           "RECOMPUTE_POLICIES", "OPTIMIZER_SHARDINGS", "zero1_owners",
           "balanced_update_fractions", "chunks_last_microbatch"]

SCHEDULE_NAMES = ("gpipe", "1f1b")
RECOMPUTE_POLICIES = ("none", "full")
#: ``Plan.optimizer_sharding`` values: ``"replicated"`` (every data-parallel replica updates every
#: parameter), ``"zero1"`` (each replica updates its own subset, ZeRO stage 1), ``"auto"`` (zero1
#: where it applies, see :meth:`Plan.sharded_update`).
OPTIMIZER_SHARDINGS = ("auto", "replicated", "zero1")
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]


class IslandSpec(StrictModel):
    """One island: the processes of one accelerator type sharing one JAX runtime.

    Attributes:
      name: unique island name, referred to by stages.
      platform: JAX platform of the island (``"cpu"``, ``"cuda"``, ``"rocm"``, ...).
      num_processes: processes (MPI ranks) of the island, >= 1.
      devices_per_process: accelerator devices per process, >= 1.
      slowdown: emulated slowdown factor >= 1, only for ``platform == "cpu"`` (DESIGN.md section 9):
        after each compute action and optimizer update the runtime waits (slowdown - 1) x its measured
        duration.
    """

    name: NonEmptyStr
    platform: NonEmptyStr
    num_processes: int = 1
    devices_per_process: int = 1
    slowdown: Float = 1.0

    @property
    def num_devices(self) -> int:
        """Devices of the island: ``num_processes * devices_per_process``."""
        return self.num_processes * self.devices_per_process


class StageSpec(StrictModel):
    """One pipeline stage: an inclusive layer range on a ``Mesh(('dp', 'tp'))`` of one island.

    Attributes:
      island: name of the island that runs the stage.
      dp, tp: data- and tensor-parallel degree of the stage mesh (mesh shape ``(dp, tp)``).
      first_layer, last_layer: inclusive range of decoder layers. The first stage also holds the
        embedding, the last stage the final norm, LM head and loss.
      devices: optional explicit island-local device indices, ``dp * tp`` of them, in mesh order
        (row-major over ``(dp, tp)``); ``None``: assigned by :meth:`Plan.stage_devices`.
      index, num_stages: position of the stage in its replica's pipeline and that pipeline's length.
        Set by :class:`ReplicaSpec` (not part of the JSON; 0 and 1 for a stage on its own).
    """

    island: NonEmptyStr
    dp: int = 1
    tp: int = 1
    first_layer: int
    last_layer: int
    devices: Optional[TupleOf[int]] = Field(None, exclude_if=lambda v: v is None)
    _index: int = PrivateAttr(0)
    _num_stages: int = PrivateAttr(1)

    @property
    def index(self) -> int:
        return self._index

    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp

    @property
    def is_first(self) -> bool:
        """Holds the embedding (first pipeline stage)."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm, LM head and loss (last pipeline stage)."""
        return self.index == self.num_stages - 1


class ReplicaSpec(StrictModel):
    """One data-parallel replica: a pipeline of stages over all layers.

    Attributes:
      stages: the pipeline stages in order (their ``index``/``num_stages`` are set here, on copies).
      batch_share: samples of the global batch this replica processes per step, or ``None``.
      throughput: relative throughput (any positive unit, e.g. samples/s) used to compute the share
        when no replica gives ``batch_share``; ``None`` when not known.
    """

    stages: TupleOf[StageSpec]
    batch_share: Optional[int] = None
    throughput: Optional[Float] = None

    @model_validator(mode="after")
    def _number_stages(self) -> "ReplicaSpec":
        staged = []
        for i, st in enumerate(self.stages):
            st = st.model_copy()
            st._index, st._num_stages = i, len(self.stages)
            staged.append(st)
        self.__dict__["stages"] = tuple(staged)  # frozen: set once, while validating
        return self

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def proportional_shares(global_units: int, throughputs: Sequence[float]) -> List[int]:
    """Split ``global_units`` (microbatches) over replicas of the given throughputs.

    Returns integer shares, each >= 1, summing to ``global_units``, that minimise the slowest
    replica's time ``max_i(share_i / throughput_i)`` (the step time of heterogeneous data parallelism,
    DESIGN.md section 6). Method: start from ``max(1, floor(global_units * t_i / sum(t)))`` (no optimal
    split gives a replica less), then hand out the remaining units one at a time to the replica whose
    time after taking it is smallest. Each step keeps the maximum as small as possible, so the result is
    optimal. Ties go to the faster replica, then to the lower index. Times are compared exactly
    (``fractions.Fraction``), so the result is deterministic.

    Example: 10 units at throughputs (3, 1) -> [8, 2] (slowest time 8/3, against 3 for [7, 3]);
    10 units at (1, 1) -> [5, 5].

    Raises:
      ValueError: if there are no replicas, a throughput is not finite and > 0, or
        ``global_units < len(throughputs)`` (each replica needs at least one unit).
    """
    n = len(throughputs)
    if n == 0:
        raise ValueError("proportional_shares needs at least one replica")
    for i, t in enumerate(throughputs):
        if not (isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t) and t > 0):
            raise ValueError(f"throughput of replica {i} must be finite and > 0, got {t!r}")
    if global_units < n:
        raise ValueError(f"global batch of {global_units} units is smaller than the number of replicas ({n}): "
                         f"every replica needs at least one")
    thr = [Fraction(float(t)) for t in throughputs]
    total = sum(thr)
    shares = [max(1, math.floor(global_units * t / total)) for t in thr]
    if sum(shares) > global_units:  # only when many replicas are raised to 1; start from the minimum
        shares = [1] * n
    for _ in range(global_units - sum(shares)):
        i = min(range(n), key=lambda j: (Fraction(shares[j] + 1) / thr[j], -thr[j], j))
        shares[i] += 1
    return shares


def balanced_shares(global_units: int, unit_s: Sequence[float], fixed_s: Sequence[float]) -> List[int]:
    """Split ``global_units`` (microbatches) over replicas whose step takes ``fixed_s[i] + unit_s[i] *
    share_i`` seconds.

    Heterogeneous DP's step ends when the slowest replica is done, so the shares minimise
    ``max_i(fixed_i + unit_i * share_i)`` (each share >= 1, summing to ``global_units``). A replica's
    per-step fixed cost (its optimizer update, stretched on an emulated slow island; the part of the
    gradient all-reduce it pays alone) moves samples to the others; with all fixed costs equal (or
    zero) the result is :func:`proportional_shares` of the throughputs ``1 / unit_s``. Method: every
    replica starts at one unit, then each remaining unit goes to the replica whose time after taking it
    is smallest; for non-decreasing per-replica costs this greedy keeps the maximum minimal at every
    count, so the result is optimal. Ties go to the replica with the smaller ``unit_s``, then the lower
    index; times are compared exactly (``fractions.Fraction``).

    Example: 4 units, unit_s (1, 3), fixed_s (0, 0) -> [3, 1]; fixed_s (0, 2) -> [3, 1] (times 3 and
    5; [2, 2] gives 8); 8 units at unit_s (1, 1), fixed_s (0, 2) -> [5, 3].

    Raises:
      ValueError: if the lists differ in length or are empty, a ``unit_s`` is not finite and > 0, a
        ``fixed_s`` is not finite and >= 0, or ``global_units < len(unit_s)``.
    """
    n = len(unit_s)
    if n == 0 or len(fixed_s) != n:
        raise ValueError(f"balanced_shares needs one unit_s and one fixed_s per replica, got {n} and {len(fixed_s)}")
    for i, (u, f) in enumerate(zip(unit_s, fixed_s)):
        if not (isinstance(u, numbers.Real) and math.isfinite(u) and u > 0):
            raise ValueError(f"unit_s of replica {i} must be finite and > 0 seconds, got {u!r}")
        if not (isinstance(f, numbers.Real) and math.isfinite(f) and f >= 0):
            raise ValueError(f"fixed_s of replica {i} must be finite and >= 0 seconds, got {f!r}")
    if global_units < n:
        raise ValueError(f"global batch of {global_units} units is smaller than the number of replicas ({n}): "
                         f"every replica needs at least one")
    unit = [Fraction(float(u)) for u in unit_s]
    fixed = [Fraction(float(f)) for f in fixed_s]
    shares = [1] * n
    for _ in range(global_units - n):
        i = min(range(n), key=lambda j: (fixed[j] + unit[j] * (shares[j] + 1), unit[j], j))
        shares[i] += 1
    return shares


def balanced_update_fractions(busy_s: Sequence[float], update_s: Sequence[float],
                              min_fraction: float = 0.01) -> List[float]:
    """Fractions of the optimizer update (of the parameter bytes) each replica should own under ZeRO-1
    so that the replicas finish their step together: water-filling of the update into the replicas'
    idle time.

    Replica ``r`` is busy ``busy_s[r]`` seconds before its update (its forward/backward at its batch
    share, emulated slowdown included) and would take ``update_s[r]`` seconds to update ALL parameters
    (AdamW is elementwise: its time is about proportional to the bytes updated). Owning a fraction
    ``x_r`` of the bytes it finishes at ``busy_s[r] + x_r * update_s[r]``; the fractions minimise the
    latest finish: ``x_r = clip((T - busy_s[r]) / update_s[r], min_fraction, 1)`` with the level ``T``
    chosen so that they sum to 1 (found by bisection to 1e-12 relative). A replica whose batch share
    already makes it the last to finish keeps ``min_fraction`` (a positive weight for
    :func:`zero1_owners`: it may then own no tensor at all). The whole-batch shares themselves come in
    whole microbatches (:func:`balanced_shares`); the update, cut at tensor granularity, fills what that
    coarse split leaves idle (ZeRO-1 needs no equal partitions: Rajbhandari et al. 2020, section 5.1,
    partition the states; which replica holds which partition is free).

    Example: busy (0.40, 0.44) s, update (0.02, 0.06) s, min_fraction 0.01: replica 0 takes 0.99 and
    finishes at 0.40 + 0.99 * 0.02 = 0.4198 s, replica 1 keeps 0.01 (0.44 + 0.01 * 0.06 = 0.4406 s,
    against 0.44 + 0.25 * 0.06 = 0.455 s with the shares' 1/4): -> (0.99, 0.01). Busy (0.40, 0.40), update (0.02, 0.06) -> T with
    (T - 0.4) / 0.02 + (T - 0.4) / 0.06 = 1: T = 0.415, (0.75, 0.25).

    Returns:
      one fraction per replica, each in [min_fraction, 1], summing to 1 (to float rounding).

    Raises:
      ValueError: if the lists differ in length or are empty, a ``busy_s`` is not finite and >= 0, an
        ``update_s`` is not finite and > 0, or ``min_fraction`` is not in (0, 1 / number of replicas].
    """
    n = len(busy_s)
    if n == 0 or len(update_s) != n:
        raise ValueError(f"balanced_update_fractions needs one busy_s and one update_s per replica, got "
                         f"{n} and {len(update_s)}")
    for i, (b, u) in enumerate(zip(busy_s, update_s)):
        if not (isinstance(b, numbers.Real) and math.isfinite(b) and b >= 0):
            raise ValueError(f"busy_s of replica {i} must be finite and >= 0 seconds, got {b!r}")
        if not (isinstance(u, numbers.Real) and math.isfinite(u) and u > 0):
            raise ValueError(f"update_s of replica {i} must be finite and > 0 seconds, got {u!r}")
    if not (0 < min_fraction <= 1.0 / n):
        raise ValueError(f"min_fraction must be in (0, 1/{n}], got {min_fraction!r}")

    def fractions(level: float) -> List[float]:
        return [min(1.0, max(min_fraction, (level - b) / u)) for b, u in zip(busy_s, update_s)]
    lo, hi = min(busy_s), max(b + u for b, u in zip(busy_s, update_s))
    for _ in range(200):  # sum(fractions) is continuous and non-decreasing in the level
        mid = 0.5 * (lo + hi)
        if sum(fractions(mid)) < 1.0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(hi, 1e-30):
            break
    x = fractions(hi)
    total = sum(x)
    return [v / total for v in x]


def chunks_last_microbatch(num_microbatches: int) -> bool:
    """Whether a heterogeneous-DP replica with ``num_microbatches`` microbatches per step runs its last
    microbatch in layer buckets (`hethub_jax.parallel.buckets.StageChunks`: one jitted forward + backward
    per bucket, each bucket's gradients all-reduced in the background while the next one computes) when
    the bucketed all-reduce is on (`PipelineRuntime.grad_bucket_off_reason` is None). The ONE place of
    this rule: the runtime follows it (`PipelineRuntime.chunked_replica`) and a predictor of the
    bucketed step should call it too.

    Rule: only a replica of two or more microbatches. A replica of ONE microbatch runs the fused forward
    + backward (one jitted program, as without buckets) and hands its whole gradient to the same bucket
    collectives at the end of its backward (the embedding's sparse part as zero rows, so the sums are
    those of the bucketed path: `buckets.StageChunks.hand_over_whole`). Why: chunking costs CPU on the chunked
    microbatch (three programs instead of one, the layers' `jax.vjp` residuals leaving the jit, the
    bucket thread's host copies on the same core of a CPU island), and a one-microbatch replica would
    run ALL of its compute that way; on an EMULATED slow island every millisecond of it is stretched by
    the slowdown, while the all-reduce it hides is not. Measured (docs/benchmarks.md, heterogeneous data
    parallelism, quiet reruns after session 13): with shares 12/4 of microbatches of 4 the all-chunked run
    was 3-4 % slower than the unbucketed one in each of three quiet runs, its slow replica being the
    one-microbatch one.

    Args:
      num_microbatches: the replica's microbatches per step (its batch share / the microbatch size).

    Raises:
      ValueError: if ``num_microbatches`` < 1.
    """
    if num_microbatches < 1:
        raise ValueError(f"a replica has at least one microbatch per step, got {num_microbatches}")
    return num_microbatches >= 2


#: the bucket size (MiB) that ``train.grad_bucket_mb: auto`` measures against the unbucketed all-reduce
#: (PyTorch DDP's ``bucket_cap_mb`` default, 25: https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html)
AUTO_GRAD_BUCKET_MB = 25.0

#: The fraction of the unbucketed step by which the bucketed path must be FASTER to be kept
#: (`keeps_bucketed_allreduce`). Source: session 15's quiet `benchmarks/hetero_dp.py` runs
#: (docs/benchmarks.md, heterogeneous data parallelism): the warm-up measured the bucketed path 1.3%
#: faster in one run (0.4808 s against 0.4871 s) and the timed steps of that run then ran it 1.8 points of
#: the upper bound SLOWER (0.944 against 0.962); in all three runs the timed bucketed step was 1-2% slower
#: while the warm-up's two figures were within 1.5% of each other either way. The warm-up times the
#: forward/backward and the all-reduce only (no update, no next step), so a gain under 2% is not evidence.
BUCKETED_MIN_GAIN = 0.02


def keeps_bucketed_allreduce(bucketed_step_s: float, unbucketed_step_s: float) -> bool:
    """Whether a heterogeneous-DP run keeps the bucketed gradient all-reduce (layer buckets overlapped
    with the last backward, `hethub_jax.parallel.buckets`) rather than the all-reduce after the whole
    backward, given the step time of each path. The ONE place of this rule: the runtime applies it to
    seconds MEASURED in its warm-up (`PipelineRuntime.choose_grad_buckets`, ``train.grad_bucket_mb:
    auto``), and a predictor should apply it to its PREDICTED step times of the two paths.

    Rule: bucketed only when faster by more than :data:`BUCKETED_MIN_GAIN` (2%) of the unbucketed
    step: ``bucketed_step_s < unbucketed_step_s * (1 - BUCKETED_MIN_GAIN)``; a tie or a smaller gain keeps
    the unbucketed path (one program per microbatch, no background thread; the margin's source is in
    :data:`BUCKETED_MIN_GAIN`). Both paths give the same sums (exact), so only time decides.
    Why measured, not fixed: on CPU islands the chunked last microbatch costs CPU on the same core
    that computes, and which side wins depends on the shares (docs/benchmarks.md, heterogeneous data
    parallelism: unbucketed ahead in sessions 13-14's quiet runs at 12/4 shares, bucketed ahead in
    session 8's).

    Args:
      bucketed_step_s: seconds per step (or any common unit) of the bucketed path, >= 0.
      unbucketed_step_s: the same for the all-reduce after the whole backward, >= 0.

    Raises:
      ValueError: if either is negative or not finite.
    """
    for name, v in (("bucketed_step_s", bucketed_step_s), ("unbucketed_step_s", unbucketed_step_s)):
        if isinstance(v, bool) or not (isinstance(v, numbers.Real) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
    return bool(bucketed_step_s < unbucketed_step_s * (1.0 - BUCKETED_MIN_GAIN))


def zero1_owners(sizes: Mapping[str, int], shares: Sequence[float]) -> Dict[str, int]:
    """The replica that updates each parameter tensor under ZeRO-1 (``optimizer_sharding``).

    Whole tensors, never parts of one. Replica ``r`` should own a fraction ``shares[r] / sum(shares)``
    of the bytes, so that its update time (proportional to the bytes it owns) scales with its batch
    share, as its compute does: a replica k times slower gets k times fewer samples and parameters.
    ``shares`` may also be other positive weights, e.g. the measured fractions of
    :func:`balanced_update_fractions` (``PipelineRuntime.set_update_weights``); the default everywhere is
    the batch shares.
    Greedy (largest tensor first, ties by name): each tensor goes to the replica whose owned bytes
    after taking it, divided by its share, are smallest (ties: lower index). The same on every rank.

    Example: sizes {a: 6, b: 3, c: 1}, shares (3, 1) -> a, b to replica 0, c to replica 1 (owned / share:
    9 / 3 = 3 and 1 / 1 = 1; b to replica 1 would also give 3, the tie goes to the lower index).

    Args:
      sizes: flat parameter name -> size (bytes or elements: only ratios matter), >= 0.
      shares: batch share of each replica (samples), each >= 1; or weights, each finite and > 0
        (any float; compared exactly as ``fractions.Fraction``).

    Returns:
      name -> owning replica index.

    Raises:
      ValueError: if there are no shares, an integer share is < 1, or a weight is not finite and > 0.
    """
    if not shares or any((isinstance(s, numbers.Integral) and s < 1)
                         or not (isinstance(s, numbers.Real) and math.isfinite(s) and s > 0) for s in shares):
        raise ValueError(f"zero1_owners needs one share >= 1 (or weight > 0) per replica, got {list(shares)}")
    weights = [Fraction(s) if isinstance(s, numbers.Integral) else Fraction(float(s)) for s in shares]
    owned = [0] * len(shares)
    out: Dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(len(shares)), key=lambda j: (Fraction(owned[j] + sizes[name]) / weights[j], j))
        owned[r] += sizes[name]
        out[name] = r
    return out


# ---------------------------------------------------------------------------------------------------

class Plan(StrictModel):
    """A full parallel plan (JSON format in ``docs/plan_format.md``).

    Attributes:
      islands: the islands, in MPI rank order.
      replicas: the data-parallel replicas (one for plain pipeline parallelism).
      global_batch_size: samples per optimizer step, over all replicas.
      microbatch_size: samples per microbatch of a whole stage (every replica, every stage), split over
        the stage's DP ranks (``microbatch_size / dp`` samples each; unlike Megatron-LM's per-rank
        ``--micro-batch-size``: ``microbatch_size`` 8 at ``dp`` 8 is Megatron's 1 at DP 8).
      schedule: pipeline schedule name, one of :data:`SCHEDULE_NAMES` (``hethub_jax.parallel.schedule``).
      recompute: activation recompute policy, ``"none"`` (backward applies saved ``jax.vjp`` residuals)
        or ``"full"`` (backward recomputes the stage forward from the saved stage input).
      optimizer_sharding: how data-parallel replicas apply the optimizer update, one of
        :data:`OPTIMIZER_SHARDINGS`: ``"replicated"``: every replica all-reduces every gradient and
        updates every parameter; ``"zero1"``: optimizer-state partitioning (ZeRO stage 1, Rajbhandari
        et al. 2020, section 5.1, P_os): each parameter tensor is updated by one replica, its owner
        (:func:`zero1_owners`: parameter bytes in proportion to the replicas' batch shares, or to
        measured weights set with ``PipelineRuntime.set_update_weights``), which
        receives the gradient sum (a reduce to the owner instead of an all-reduce where the runtime
        can) and then sends the updated tensor to the other replicas; ``"auto"`` (default): zero1
        where it applies (:meth:`sharded_update`). The result is the same as replicated (float32
        rounding of the sums only). Omitted from the JSON when ``"auto"``.
      description: free text for humans.
      seq_len: tokens per sample the plan was made for (the planner writes the ``--seq-len`` it
        searched with; its memory and time predictions hold for this length), >= 1, at most the
        model's ``max_position_embeddings``; ``None`` (hand-written plans, plans written by older
        versions): not recorded. ``python -m hethub_jax.train --plan`` refuses a longer training
        ``data.seq_len`` (activation memory grows with it, so the plan's memory check no longer holds)
        and warns for a shorter one (the plan fits but may not be the fastest); see docs/plan_format.md.
    """

    description: str = Field("", exclude_if=lambda v: not v)
    islands: TupleOf[IslandSpec]
    replicas: TupleOf[ReplicaSpec]
    global_batch_size: int
    microbatch_size: int
    schedule: str = Field("1f1b", json_schema_extra={"enum": list(SCHEDULE_NAMES)})
    recompute: str = Field("none", json_schema_extra={"enum": list(RECOMPUTE_POLICIES)})
    seq_len: Optional[int] = Field(None, exclude_if=lambda v: v is None)
    optimizer_sharding: str = Field("auto", exclude_if=lambda v: v == "auto",
                                    json_schema_extra={"enum": list(OPTIMIZER_SHARDINGS)})

    @model_validator(mode="before")
    @classmethod
    def _stages_shorthand(cls, d: Any) -> Any:
        if isinstance(d, Mapping) and "stages" in d:
            if "replicas" in d:
                raise ValueError("plan needs exactly one of 'replicas' (list of pipelines) or 'stages' "
                                 "(shorthand for one replica)")
            d = {k: v for k, v in d.items() if k != "stages"} | {"replicas": [{"stages": d["stages"]}]}
        elif isinstance(d, Mapping) and "replicas" not in d:
            raise ValueError("plan needs exactly one of 'replicas' (list of pipelines) or 'stages' "
                             "(shorthand for one replica)")
        return d

    # ---- loading and saving ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        """Build a plan from its JSON object. Top-level ``"stages"`` is shorthand for one replica
        (``"replicas": [{"stages": ...}]``). Checks keys and types only; call :meth:`validate`.

        Raises:
          ValueError: for an unknown or missing key, or a value of the wrong type, naming the key and
            where it is (e.g. ``replicas[0].stages[1].tp must be an integer, got '2'``).
        """
        return validate_model(cls, d, container="plan")

    @classmethod
    def from_json(cls, source: Union[str, os.PathLike, Mapping[str, Any]]) -> "Plan":
        """Load a plan from a JSON file path, a JSON text (a string starting with ``{``) or a dict.

        Raises:
          ValueError: as :meth:`from_dict`, or for invalid JSON.
          OSError: if the file cannot be read.
        """
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, str) and source.lstrip().startswith("{"):
            text, where = source, "JSON text"
        else:
            with open(source) as f:
                text, where = f.read(), os.fspath(source)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid plan JSON in {where}: {e}") from None
        return cls.from_dict(data)

    def to_dict(self) -> Dict[str, Any]:
        """The canonical JSON object (always the ``"replicas"`` form; ``devices`` only where given,
        ``description`` only when not empty, ``seq_len`` only when recorded)."""
        return self.model_dump(mode="json")

    def replace(self, **changes: Any) -> "Plan":
        """A copy with ``changes`` (field name -> value, e.g. ``global_batch_size=32``), checked as
        :meth:`from_dict` checks (keys and types). Raises ValueError as :meth:`from_dict`."""
        return Plan.from_dict(self.model_dump() | changes)

    def to_json(self, path: Union[str, os.PathLike, None] = None, indent: int = 2) -> str:
        """The canonical JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent) + "\n"
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    # ---- lookups -----------------------------------------------------------------------------------

    def island(self, name: str) -> IslandSpec:
        """The island called ``name``. Raises ValueError if there is none."""
        for isl in self.islands:
            if isl.name == name:
                return isl
        raise ValueError(f"unknown island {name!r}; islands: {[i.name for i in self.islands]}")

    def stage(self, replica_idx: int, stage_idx: int) -> StageSpec:
        return self.replicas[replica_idx].stages[stage_idx]

    def num_stages(self, replica_idx: int = 0) -> int:
        return self.replicas[replica_idx].num_stages

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def num_global_microbatches(self) -> int:
        """``global_batch_size // microbatch_size``."""
        return self.global_batch_size // self.microbatch_size

    # ---- ranks -------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """MPI ranks of the job: the sum of the islands' ``num_processes``."""
        return sum(i.num_processes for i in self.islands)

    def island_ranks(self, name: str) -> range:
        """The consecutive MPI ranks of island ``name`` (islands are laid out in the order listed)."""
        start = 0
        for isl in self.islands:
            if isl.name == name:
                return range(start, start + isl.num_processes)
            start += isl.num_processes
        raise ValueError(f"unknown island {name!r}; islands: {[i.name for i in self.islands]}")

    def rank_island(self, rank: int) -> IslandSpec:
        """The island that MPI rank ``rank`` belongs to. Raises ValueError if out of range."""
        for isl in self.islands:
            if rank in self.island_ranks(isl.name):
                return isl
        raise ValueError(f"rank {rank} out of range for world size {self.world_size}")

    def process_index(self, rank: int) -> int:
        """Index of ``rank`` inside its island (``jax.distributed`` process id)."""
        return rank - self.island_ranks(self.rank_island(rank).name).start

    def island_stages(self, name: str) -> List[Tuple[int, int]]:
        """``(replica_idx, stage_idx)`` of every stage run by island ``name``, in plan order. All
        processes of a multi-process island run all of its stages (one SPMD program per stage)."""
        self.island(name)
        return [(r, s) for r, rep in enumerate(self.replicas) for s, st in enumerate(rep.stages)
                if st.island == name]

    def rank_stages(self, rank: int) -> List[Tuple[int, int]]:
        """``(replica_idx, stage_idx)`` of every stage MPI rank ``rank`` takes part in."""
        return self.island_stages(self.rank_island(rank).name)

    # ---- devices -----------------------------------------------------------------------------------

    def _device_assignment(self) -> Dict[Tuple[int, int], Tuple[int, ...]]:
        taken: Dict[str, int] = {}
        out: Dict[Tuple[int, int], Tuple[int, ...]] = {}
        for r, rep in enumerate(self.replicas):
            for s, st in enumerate(rep.stages):
                where = f"replicas[{r}].stages[{s}]"
                isl = self.island(st.island)
                n, avail = st.dp * st.tp, isl.num_devices
                if n > avail:
                    raise ValueError(f"devices requested must exist on the island: {where} asks for "
                                     f"dp*tp = {st.dp}*{st.tp} = {n} devices but island {isl.name!r} has "
                                     f"{avail} ({isl.num_processes} processes x {isl.devices_per_process})")
                if st.devices is not None:
                    if len(st.devices) != n:
                        raise ValueError(f"{where}.devices lists {len(st.devices)} devices but dp*tp = {n}")
                    bad = [i for i in st.devices if not 0 <= i < avail]
                    if bad:
                        raise ValueError(f"devices requested must exist on the island: {where}.devices has "
                                         f"indices {bad} outside 0..{avail - 1} of island {isl.name!r}")
                    if len(set(st.devices)) != n:
                        raise ValueError(f"{where}.devices lists a device twice: {list(st.devices)}")
                    out[(r, s)] = st.devices
                else:
                    first = taken.get(isl.name, 0)
                    if first + n > avail:
                        raise ValueError(
                            f"devices requested must exist on the island: island {isl.name!r} has {avail} "
                            f"devices; stages before {where} took {first}, and it needs {n} more (dp*tp); "
                            f"give explicit 'devices' to let stages share devices")
                    taken[isl.name] = first + n
                    out[(r, s)] = tuple(range(first, first + n))
        return out

    def stage_devices(self, replica_idx: int, stage_idx: int) -> List[int]:
        """Island-local device indices of a stage, ``dp * tp`` of them, in mesh order (row-major over
        ``(dp, tp)``: ``np.array(devs).reshape(dp, tp)``). Explicit ``devices`` are used as given;
        otherwise each stage of an island takes the next ``dp * tp`` devices of that island, in plan
        order (replica by replica, stage by stage; explicit lists do not advance this counter).

        Raises:
          ValueError: if the island lacks the devices (see :meth:`validate`).
        """
        return list(self._device_assignment()[(replica_idx, stage_idx)])

    # ---- batch -------------------------------------------------------------------------------------

    def batch_shares(self) -> List[int]:
        """Samples of the global batch per replica: the given ``batch_share`` s if every replica gives
        one; else :func:`proportional_shares` of the global microbatches by ``throughput`` if every
        replica gives one; else equal shares (the extra microbatches go to the lowest indices).
        Always a multiple of ``microbatch_size``.

        Raises:
          ValueError: if only some replicas give a share (or a throughput), a throughput is not
            positive, or the global batch is too small for the replicas.
        """
        reps, mbs, gbs = self.replicas, self.microbatch_size, self.global_batch_size
        if gbs < len(reps):
            raise ValueError(f"global batch smaller than the number of replicas: global_batch_size {gbs} < "
                             f"{len(reps)} replicas; every replica needs at least one sample")
        given = [r.batch_share for r in reps]
        if all(s is not None for s in given):
            return list(given)
        if any(s is not None for s in given):
            raise ValueError(f"batch_share must be given for all replicas or none, got {given}")
        units = self.num_global_microbatches
        if units < len(reps):
            raise ValueError(f"global batch smaller than the number of replicas in microbatches: "
                             f"global_batch_size {gbs} / microbatch_size {mbs} = {units} microbatches < "
                             f"{len(reps)} replicas; every replica needs at least one microbatch")
        thr = [r.throughput for r in reps]
        if any(t is not None for t in thr) and not all(t is not None for t in thr):
            raise ValueError(f"throughput must be given for all replicas or none, got {thr}")
        if thr[0] is None:
            thr = [1.0] * len(reps)
        return [u * mbs for u in proportional_shares(units, thr)]

    def num_microbatches(self, replica_idx: int = 0) -> int:
        """Microbatches replica ``replica_idx`` runs per step: its batch share / ``microbatch_size``."""
        return self.batch_shares()[replica_idx] // self.microbatch_size

    def actions(self, replica_idx: int = 0):
        """The schedule's action lists of a replica: ``get_schedule(schedule)(num_stages, num_microbatches)``
        (``hethub_jax.parallel.schedule``; index them by stage index)."""
        from hethub_jax.parallel.schedule import get_schedule
        return get_schedule(self.schedule)(self.num_stages(replica_idx), self.num_microbatches(replica_idx))

    # ---- validation --------------------------------------------------------------------------------

    def validate(self, model_config: Any = None) -> "Plan":
        """Check every constraint of the plan; return ``self``.

        ``model_config`` is any object with ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads`` (``None`` means equal to the attention heads) and optionally
        ``intermediate_size`` (a :class:`hethub_jax.models.config.LlamaConfig`). Without it, the layer
        count L is taken from the first replica's last stage and the TP checks are skipped. With it, a
        plan that validates builds: the TP rule is the one ``PipelineStage`` applies
        (:func:`hethub_jax.parallel.rules.check_tp`).

        Raises:
          ValueError: for the first violated constraint, naming it and the offending values:
            islands (at least one, unique names, ``num_processes``/``devices_per_process`` >= 1,
            ``slowdown`` >= 1 and != 1 only on platform ``cpu``, every island runs a stage);
            ``schedule`` in :data:`SCHEDULE_NAMES`; ``recompute`` in :data:`RECOMPUTE_POLICIES`;
            stages (island exists, ``dp``, ``tp`` >= 1, no empty stage, each replica's layer ranges
            cover 0..L-1 exactly once and in order; TP degree divides the attention heads and
            ``intermediate_size`` and divides or is a multiple of the KV heads; devices exist on the island, see :meth:`stage_devices`);
            batch (sizes >= 1, ``global_batch_size`` divisible by ``microbatch_size``, global batch
            not smaller than the number of replicas, each share >= 1 microbatch and a multiple of
            ``microbatch_size``, shares sum to ``global_batch_size``, ``microbatch_size`` divisible
            by every stage's ``dp``); ``seq_len`` >= 1 and, with ``model_config``, at most its
            ``max_position_embeddings``.
        """
        self._validate_islands()
        if self.seq_len is not None:
            if self.seq_len < 1:
                raise ValueError(f"seq_len (tokens per sample the plan was made for) must be >= 1, got {self.seq_len}")
            max_pos = getattr(model_config, "max_position_embeddings", None)
            if max_pos is not None and self.seq_len > max_pos:
                raise ValueError(f"seq_len {self.seq_len} (tokens per sample the plan was made for) exceeds the "
                                 f"model's max_position_embeddings {max_pos}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"schedule must be one of {list(SCHEDULE_NAMES)}, got {self.schedule!r}")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"recompute must be one of {list(RECOMPUTE_POLICIES)}, got {self.recompute!r}")
        if self.optimizer_sharding not in OPTIMIZER_SHARDINGS:
            raise ValueError(f"optimizer_sharding must be one of {list(OPTIMIZER_SHARDINGS)}, got "
                             f"{self.optimizer_sharding!r}")
        if not self.replicas:
            raise ValueError("plan needs at least one replica (pipeline of stages)")
        if model_config is not None:
            num_layers = model_config.num_hidden_layers
        else:
            num_layers = self.replicas[0].stages[-1].last_layer + 1 if self.replicas[0].stages else 0
        names = {i.name for i in self.islands}
        for r, rep in enumerate(self.replicas):
            if not rep.stages:
                raise ValueError(f"replicas[{r}] has no stages")
            nxt = 0
            for s, st in enumerate(rep.stages):
                where = f"replicas[{r}].stages[{s}]"
                if st.island not in names:
                    raise ValueError(f"stage island must exist: {where} names island {st.island!r}; "
                                     f"islands: {sorted(names)}")
                if st.dp < 1 or st.tp < 1:
                    raise ValueError(f"dp and tp must be >= 1: {where} has dp={st.dp}, tp={st.tp}")
                if st.last_layer < st.first_layer:
                    raise ValueError(f"no empty stage: {where} has first_layer {st.first_layer} > "
                                     f"last_layer {st.last_layer}")
                if st.first_layer != nxt:
                    what = "gap" if st.first_layer > nxt else "overlap"
                    raise ValueError(f"layer ranges must cover layers 0..{num_layers - 1} exactly once, in "
                                     f"order: {where} starts at layer {st.first_layer}, expected {nxt} ({what})")
                nxt = st.last_layer + 1
                if model_config is not None:
                    check_tp(model_config, st.tp, where)
            if nxt != num_layers:
                raise ValueError(f"layer ranges must cover layers 0..{num_layers - 1} exactly once, in order: "
                                 f"replicas[{r}] ends at layer {nxt - 1}, the model has {num_layers} layers")
        used = {st.island for rep in self.replicas for st in rep.stages}
        for isl in self.islands:
            if isl.name not in used:
                raise ValueError(f"every island must run a stage: island {isl.name!r} runs none")
        self._device_assignment()
        self._validate_batch()
        if self.optimizer_sharding == "zero1":
            multi = [i.name for i in self.islands if i.num_processes > 1]
            if multi and self.num_replicas > 1:
                raise ValueError(f"optimizer_sharding 'zero1' needs every island to be one process (today's "
                                 f"runtime exchanges the owners' parameters between single processes); islands "
                                 f"{multi} have several: use 'replicated' or 'auto'")
        return self

    def sharded_update(self) -> bool:
        """True when the optimizer update is sharded over the data-parallel replicas (ZeRO-1):
        ``optimizer_sharding`` is ``"zero1"``, or ``"auto"`` and the plan has several replicas and
        every island is one process; then the replicas own their parameters as :func:`zero1_owners`
        of :meth:`batch_shares` says. A plan with one replica: False (nothing to shard)."""
        if self.num_replicas < 2 or self.optimizer_sharding == "replicated":
            return False
        return self.optimizer_sharding == "zero1" or all(i.num_processes == 1 for i in self.islands)

    def _validate_islands(self) -> None:
        if not self.islands:
            raise ValueError("plan needs at least one island")
        seen = set()
        for isl in self.islands:
            if isl.name in seen:
                raise ValueError(f"island names must be unique: {isl.name!r} appears twice")
            seen.add(isl.name)
            if isl.num_processes < 1 or isl.devices_per_process < 1:
                raise ValueError(f"island {isl.name!r}: num_processes and devices_per_process must be >= 1, "
                                 f"got {isl.num_processes} and {isl.devices_per_process}")
            if not (math.isfinite(isl.slowdown) and isl.slowdown >= 1):
                raise ValueError(f"slowdown must be >= 1: island {isl.name!r} has slowdown {isl.slowdown}")
            if isl.slowdown != 1 and isl.platform != "cpu":
                raise ValueError(f"slowdown (speed emulation, DESIGN.md section 9) applies only to platform "
                                 f"'cpu': island {isl.name!r} has platform {isl.platform!r} and slowdown "
                                 f"{isl.slowdown}")

    def _validate_batch(self) -> None:
        gbs, mbs = self.global_batch_size, self.microbatch_size
        check_batch(gbs, mbs)
        check_shares(self.batch_shares(), gbs, mbs)  # batch_shares raises for too few samples
        check_batch(gbs, mbs, {f"replicas[{r}].stages[{s}]": st.dp for r, rep in enumerate(self.replicas)
                               for s, st in enumerate(rep.stages)})
