"""The validity rules that more than one part of the package checks, each written once (pure Python).

* :func:`check_tp`: may a pipeline stage of a model use TP degree ``tp``? Called by
  :meth:`hethub_jax.parallel.plan.Plan.validate` and by ``hethub_jax.parallel.stage.PipelineStage``, so
  a plan that validates builds.
* :func:`check_batch` and :func:`check_shares`: global batch, microbatch, DP degree and per-replica
  batch shares. Called by the plan, the training config (``train.*``), ``train.py`` and the runtime.
* :func:`check_runtime_support`: does today's runtime run a valid plan? (an island of several
  processes runs one stage; ``parallel.split`` splits such islands per stage). Called by the runtime
  and by ``python -m hethub_jax.plan``.
* :func:`uniform_stages_run`: do ``k`` stages of ``d`` devices each, laid out one after another on an
  island of processes of ``p`` devices, run once the island is split per stage? The planner's level-2
  choice (``planner.search``) keeps only such layouts, so every plan it emits runs.

Every function raises ``ValueError`` naming the constraint and the offending values.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["check_tp", "check_batch", "check_shares", "check_runtime_support", "uniform_stages_run"]


def check_tp(config: Any, tp: int, where: str = "the stage") -> None:
    """Raise if TP degree ``tp`` does not fit the model (Megatron-LM layout, Shoeybi et al. 2019, sec. 3).

    The rules: ``tp`` divides the attention heads (q/o are split by heads); ``tp`` divides the KV heads
    or is a multiple of them (then the KV projections are replicated, DESIGN.md section 5); ``tp``
    divides ``intermediate_size`` (gate/up/down are split along it). The vocabulary is no constraint:
    the embedding and LM head are split over the vocabulary when ``tp`` divides it and replicated
    otherwise (``hethub_jax.parallel.stage.logical_rules``); nothing is padded.

    Args:
      config: any object with ``num_attention_heads``, ``num_key_value_heads`` (``None``: equal to the
        attention heads) and optionally ``intermediate_size`` (not checked when absent), e.g. a
        :class:`hethub_jax.models.config.LlamaConfig`.
      tp: TP degree (>= 1).
      where: the stage, for the message (``"replicas[0].stages[1]"``).

    Raises:
      ValueError: for ``tp < 1`` or the first rule above that fails.
    """
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    ffn = getattr(config, "intermediate_size", None)
    if tp < 1:
        raise ValueError(f"TP degree must be >= 1: {where} has tp={tp}")
    if heads % tp:
        raise ValueError(f"TP degree must divide the number of attention heads: {where} has tp={tp}, "
                         f"model has {heads} heads")
    if kv % tp and tp % kv:
        raise ValueError(f"TP degree must divide the number of KV heads or be a multiple of it (KV heads "
                         f"then replicated): {where} has tp={tp}, model has {kv} KV heads")
    if ffn is not None and ffn % tp:
        raise ValueError(f"TP degree must divide intermediate_size (the MLP is split along it): {where} "
                         f"has tp={tp}, model has intermediate_size {ffn}")


def check_batch(global_batch_size: int, microbatch_size: int, dp: Mapping[str, int] | None = None,
                prefix: str = "") -> None:
    """Raise unless the global batch splits into whole microbatches and every microbatch into equal
    DP slices.

    Args:
      global_batch_size: samples per optimizer step (>= 1).
      microbatch_size: samples per microbatch (>= 1); must divide ``global_batch_size``.
      dp: stage location -> DP degree of that stage's mesh; each must divide ``microbatch_size``
        (the microbatch is split over ``dp`` on its batch dimension).
      prefix: prefix of the field names in messages (``"train."``).

    Raises:
      ValueError: naming the first rule that fails and the values.
    """
    g, m = global_batch_size, microbatch_size
    if g < 1 or m < 1:
        raise ValueError(f"{prefix}global_batch_size and {prefix}microbatch_size must be >= 1, got {g} and {m}")
    if g % m:
        raise ValueError(f"{prefix}global_batch_size must be divisible by {prefix}microbatch_size: "
                         f"{g} % {m} = {g % m}")
    for where, d in (dp or {}).items():
        if m % d:
            raise ValueError(f"{prefix}microbatch_size must be divisible by each stage's dp: "
                             f"microbatch_size {m}, {where} has dp={d}")


def check_shares(shares: Sequence[int], global_batch_size: int, microbatch_size: int) -> None:
    """Raise unless per-replica batch shares (samples) are each at least one microbatch and a multiple
    of ``microbatch_size``, and sum to ``global_batch_size``.

    Raises:
      ValueError: naming the replica (``replicas[r]``) and the rule.
    """
    for r, share in enumerate(shares):
        if share < microbatch_size:
            raise ValueError(f"each replica's batch share must be at least one microbatch: replicas[{r}] "
                             f"has batch_share {share} < microbatch_size {microbatch_size}")
        if share % microbatch_size:
            raise ValueError(f"each replica's batch share must be divisible by microbatch_size: "
                             f"replicas[{r}] has batch_share {share}, microbatch_size {microbatch_size}")
    if sum(shares) != global_batch_size:
        raise ValueError(f"batch shares must sum to global_batch_size: {list(shares)} sums to {sum(shares)}, "
                         f"global_batch_size is {global_batch_size}")


def check_runtime_support(plan: Any) -> None:
    """Raise if today's runtime cannot run ``plan`` although it is valid: an island of several
    processes may run only one stage (its processes run every stage of the island and could order
    several stages' collectives differently; docs/multiprocess_islands.md). When the island's stages
    hold disjoint processes (or share one process each), :func:`hethub_jax.parallel.split.split_islands`
    gives the equivalent plan with one island per stage, which runs; the message says so.

    Args:
      plan: a :class:`hethub_jax.parallel.plan.Plan` (``islands``, ``island_stages(name)``).

    Raises:
      ValueError: naming the first island of several processes that runs more than one stage, and
        either the split that runs it or the stages that share a process (no split runs those).
    """
    from hethub_jax.parallel.split import island_components  # split imports plan, which imports us
    for isl in plan.islands:
        stages = plan.island_stages(isl.name)
        if isl.num_processes > 1 and len(stages) > 1:
            head = (f"island {isl.name!r} has {isl.num_processes} processes and runs stages {stages}: "
                    f"today's runtime runs one stage on an island of several processes, as its processes "
                    f"could order several stages' collectives differently")
            shared = [(ks, ps) for ks, ps in island_components(plan, isl.name) if len(ks) > 1 and len(ps) > 1]
            if shared:
                ks, ps = shared[0]
                raise ValueError(f"{head}; stages {ks} hold processes {ps} of it, sharing some, so no split into one "
                                 f"island per stage runs them (give each stage whole processes of its own, "
                                 f"or put them on an island of one process; docs/multiprocess_islands.md)")
            raise ValueError(f"{head}; its stages hold disjoint processes: split it into one island per stage "
                             f"(`python -m hethub_jax.parallel.split PLAN.json OUT.json`, or "
                             f"hethub_jax.parallel.split.split_islands; docs/multiprocess_islands.md)")


def uniform_stages_run(num_stages: int, stage_devices: int, devices_per_process: int) -> bool:
    """Whether ``num_stages`` stages of ``stage_devices`` devices each, taking an island's devices one
    after another from device 0 (``Plan.stage_devices``' default assignment: the planner's layout of a
    node group, one process per node), pass :func:`check_runtime_support` once the island is split per
    stage (``parallel.split.split_islands``).

    The rule: one stage; or each stage is a whole number of processes (``p | d``: the stages hold
    disjoint processes); or each stage fits inside one process without crossing a process boundary
    (``d | p``); or all stages fit in the first process (``k d <= p``: one island of one process runs
    them). Otherwise some stage spans two processes and shares one with its neighbour (e.g. 12 devices
    per stage on 8-device processes: stages 0 and 1 share process 1), and no split runs the plan.
    Tested against ``split_islands`` + :func:`check_runtime_support` on every small layout
    (tests/test_split.py).

    Args:
      num_stages: ``k >= 1``; stage_devices: ``d = dp x tp >= 1``; devices_per_process: ``p >= 1``.

    Raises:
      ValueError: for a non-positive argument.
    """
    k, d, p = num_stages, stage_devices, devices_per_process
    if min(k, d, p) < 1:
        raise ValueError(f"stages, devices per stage and devices per process must be >= 1, got {k}, {d}, {p}")
    return k == 1 or d % p == 0 or p % d == 0 or k * d <= p
