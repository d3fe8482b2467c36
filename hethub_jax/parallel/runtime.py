"""The pipeline runtime: executes each local stage's action list (GPipe or 1F1B) and applies the update.

One `PipelineRuntime` runs in every process. In a single process (no communicator) it runs every
stage of every island itself; under MPI each process runs the stages of its island and exchanges
activations and gradients with other islands through the communicator's non-blocking send/recv
(`hethub_jax.comm`). Between two stages in the same process, arrays move device to device
(re-placement onto the next stage's sharding); between islands in the same process they take the
host path, as they would over the bridge. An island of several processes (one `jax.distributed`
runtime, issue 15) runs its stage on all of them: the stage's mesh spans the processes, each feeds
its own DP rows and exchanges only its rows of each activation and gradient with the processes of
the neighbouring stage that hold them (`hethub_jax.parallel.exchange`, docs/multiprocess_islands.md).

Execution: every local stage advances through its list until it reaches a receive whose message has
not arrived; the process then switches to another local stage, and polls when none can advance
(so several stages per process and any schedule in `schedule.py` run without deadlock). One step's
execution is a `_StepExecutor`: its `_forward`, `_backward`, `_send` and `_receive` methods carry out
the four kinds of action.

Loss and gradients (DESIGN.md section 6): the last stage returns the *summed* token cross-entropy of
each microbatch; gradients are accumulated as sums over microbatches, summed over data-parallel
replicas and over the two copies of tied embeddings, divided once by the number of non-pad tokens of
the global batch, clipped by the global norm (squared norms summed over all stages, each parameter
counted once), and applied by each stage's own optax state. The result equals the unsplit model's
step on the whole global batch.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hethub_jax.host_allocator import steady_host_allocator
from hethub_jax.models.config import LlamaConfig
from hethub_jax.models.llama import Llama
from hethub_jax.optim import OptimConfig, make_optimizer
from hethub_jax.parallel import buckets as bk
from hethub_jax.parallel import exchange
from hethub_jax.parallel import multiprocess as mp
from hethub_jax.parallel import zero
from hethub_jax.parallel.plan import Plan, chunks_last_microbatch, zero1_owners
from hethub_jax.parallel.rules import check_runtime_support, check_shares
from hethub_jax.parallel.schedule import Action, ActionKind
from hethub_jax.parallel.stage import Backward, PipelineStage, StageInputs
from hethub_jax.parallel.trace import ActionRecord, bubble_from_terms, bubble_terms

#: The wait that emulates a slower accelerator (DESIGN.md section 9): sleeps ``seconds``. A module-level
#: name so that tests can record the waits instead of timing a shared, noisy machine.
emulated_wait = time.sleep

StageKey = tuple[int, int]  # (replica index, stage index)
_KIND_CODE = {"act": 0, "grad": 1}


@dataclass
class StepResult:
    """Outcome of one training step, identical on every rank.

    Attributes:
      loss: mean token cross-entropy over the non-pad tokens of the global batch (nats).
      num_tokens: non-pad tokens in the global batch.
      grad_norm: global L2 norm of the gradient before clipping.
      step_time_s: wall time of the step on this rank, seconds.
      records: start/end of every action of this rank's stages (`time.perf_counter()` seconds).
      bubble: MEASURED bubble fraction of the step over all stages of the plan, the simulator's
        definition (`trace.bubble_from_terms`: mean over stages of 1 - F and B seconds / the step's
        pipeline time); identical on every rank (its terms travel in the step's world all-reduce of
        the loss, so measuring it adds no synchronisation). None if not measured.
    """

    loss: float
    num_tokens: int
    grad_norm: float
    step_time_s: float
    records: list[ActionRecord] = field(default_factory=list)
    bubble: float | None = None


def stage_param_names(config: LlamaConfig, first_layer: int, last_layer: int) -> list[str]:
    """Global flat parameter names held by the stage [first_layer, last_layer] (no allocation)."""
    return list(stage_param_bytes(config, first_layer, last_layer))


def stage_param_bytes(config: LlamaConfig, first_layer: int, last_layer: int) -> dict[str, int]:
    """Global flat parameter name -> bytes, for the stage [first_layer, last_layer] (no allocation)."""
    abstract = nnx.eval_shape(partial(Llama, config, first_layer=first_layer, last_layer=last_layer))
    values = {n: p.get_value() for n, p in abstract.param_table().items()}
    return {n: int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for n, v in values.items()}


class PipelineRuntime:
    """Runs a validated `Plan` for training and evaluation.

    Args:
      plan: the plan (validated here against `model_config`).
      model_config: the full model's config.
      optim: optimizer settings (AdamW + schedule + global-norm clipping).
      seed: initialisation seed; every stage gets the unsplit model's initial weights.
      comm: None for a single process running every stage; else a communicator of the whole job
        (`hethub_jax.comm` contract) whose rank layout is the plan's (`Plan.island_ranks`).
      rank: this process's rank in `comm` (ignored without a communicator).
      devices: the island's JAX devices in island-global order (default `jax.devices()`; in an
        island of several processes, each process's first `devices_per_process` devices by id, process
        by process: see `_island_devices`).
      debug_nan: fill gradient accumulators and not-yet-written message buffers with NaN, to prove in
        tests that no unwritten buffer reaches the results.
      timeout_s: deadline for waiting on a message from another process, seconds.

    Raises:
      ValueError: if the plan is invalid for the model (the message names the constraint), or asks for
        an island layout this runtime cannot run (an island of several processes with more than one
        stage, or a stage whose TP rows span processes: see `_stage_layout`).
    """

    def __init__(self, plan: Plan, model_config: LlamaConfig, optim: OptimConfig, *, seed: int = 0,
                 comm: Any = None, rank: int = 0, devices: list | None = None, debug_nan: bool = False,
                 timeout_s: float = 300.0):
        plan.validate(model_config)
        self.plan, self.config, self.optim = plan, model_config, optim
        self.comm, self.rank, self.debug_nan, self.timeout_s = comm, (rank if comm is not None else 0), debug_nan, timeout_s
        all_keys = [(r, s) for r in range(plan.num_replicas) for s in range(plan.num_stages(r))]
        # Ranks that run each stage (`owners`; its first one: `owner`) and the samples of a microbatch
        # each of them holds (`rows`, world rank -> [start, stop)): see `_stage_layout`.
        self.owners, self.rows = {}, {}
        for k in all_keys:
            self.owners[k], self.rows[k] = self._stage_layout(k)
        self.owner = {k: o[0] for k, o in self.owners.items()}
        self.local_keys = [k for k in all_keys if self.rank in self.owners[k]]
        if devices is None and jax.process_count() > 1:
            devices = self._island_devices()
        devices = list(jax.devices()) if devices is None else list(devices)
        if any(d.platform == "cpu" for d in devices):  # XLA:CPU buffers: no mmap churn (host_allocator)
            steady_host_allocator()
        tx = make_optimizer(optim)
        self._stages: dict[StageKey, PipelineStage] = {}
        for k in self.local_keys:
            spec = plan.stage(*k)
            devs = [devices[i] for i in plan.stage_devices(*k)]
            self._stages[k] = PipelineStage(
                model_config, spec.first_layer, spec.last_layer, devs, spec.dp, spec.tp, seed=seed,
                recompute=plan.recompute == "full", optimizer=tx, clip_norm=optim.grad_clip_norm,
                debug_nan=debug_nan)
        self.shares = plan.batch_shares()  # samples per replica (see set_batch_shares)
        self.offsets = [sum(self.shares[:r]) for r in range(plan.num_replicas)]
        self.train_actions = {r: plan.actions(r) for r in range(plan.num_replicas)}
        self.eval_actions = {r: _forward_only(plan.num_stages(r), plan.num_microbatches(r))
                             for r in range(plan.num_replicas)}
        # Parameters held by more than one stage (tied embeddings, data-parallel replicas): their
        # gradients are summed over the holders; the first holder counts them in the global norm.
        holders: dict[str, list[StageKey]] = {}
        self._param_bytes: dict[str, int] = {}
        for k in all_keys:
            spec = plan.stage(*k)
            sizes = stage_param_bytes(model_config, spec.first_layer, spec.last_layer)
            self._param_bytes.update(sizes)
            for name in sizes:
                holders.setdefault(name, []).append(k)
        self.shared = {n: h for n, h in holders.items() if len(h) > 1}
        self._holders = holders
        # Sharded update (ZeRO-1, `Plan.optimizer_sharding`): `owner_of` maps each parameter name to
        # the replica that updates it; `norm_owner` (the holder counted in the global norm, and the
        # stage whose value the others receive) is then that replica's first holder. See `_set_owners`.
        self.zero1 = plan.sharded_update()
        self.owner_of: dict[str, int] = {}
        # ZeRO-1 ownership weights (`set_update_weights`); None: the batch shares
        self.update_weights: list[float] | None = None
        # `measure_step_costs`' raw figures of its last call: busy_s (each replica's F/B seconds per
        # step at the shares of that call) and update_s (its whole-update seconds), for
        # `plan.balanced_update_fractions`
        self.last_step_costs: dict[str, list[float]] | None = None
        self._full_reduce = False  # True: every holder gets every gradient sum (`gradients`)
        self._set_owners()
        self._group_comms: dict[tuple[int, ...], Any] = {}
        if comm is not None:
            self._make_group_comms()
            self._warm_up_collectives()
        self.step = 0
        # Last stage: a forward immediately followed by the backward of the same microbatch (1F1B,
        # one-stage replicas) runs as one jitted forward+backward (no vjp residuals leave the jit).
        self.fuse_last_stage = True
        # One-stage, one-replica plan in one process: the stage holds every gradient, so the last
        # microbatch's forward+backward, the global norm, clipping and the update run as one jitted
        # program (`PipelineStage.forward_backward_update`), as a plain single-device step does.
        self.fuse_update = True
        # Heterogeneous DP: the last backward of the step runs in layer buckets whose gradients are
        # all-reduced in the background while the next bucket computes (`hethub_jax.parallel.buckets`;
        # `_bucketing` says when it applies). None (this class's default, see `set_grad_buckets`): off,
        # the all-reduce runs after the whole backward. Training turns it on through
        # `train.grad_bucket_mb` (default ``auto``: bucketed or not, whichever a warm-up measures faster,
        # `choose_grad_buckets`).
        self.grad_bucket_bytes: int | None = None
        self.first_grad_bucket_bytes: int = bk.DEFAULT_FIRST_BUCKET_BYTES
        # ``auto`` (`set_grad_buckets`): True until `choose_grad_buckets` has measured both paths (the
        # first `train_step` measures them if nobody did); the measurement's record afterwards
        self.grad_bucket_auto_pending = False
        self.grad_bucket_choice: dict | None = None
        # each bucket's all-reduce first waits (sleeping) until every replica has the bucket
        # (`buckets.BucketedReduction`, ``arrive``); False: it spins from the start (`spin_s`)
        self.bucket_arrival_sleeps = True
        self.last_exchange_s = 0.0  # ZeRO-1: seconds of the last step's parameter exchange (`_apply_updates`)
        # ZeRO-1 between processes: True runs the parameter gather after the update on a background
        # thread; the step returns without waiting for it and the next step's first action (or any
        # read of the parameters: `wait_params`) waits for it. False (default): the step waits.
        self.overlap_param_gather = False
        self.last_exchange_wait_s = 0.0  # seconds the last `wait_params` waited for a background gather
        self._gather_pool, self._pending_gather = None, None
        self.last_bucket_stats: dict | None = None  # `BucketedReduction.stats` of the last step, + exposed_s
        self._chunks: dict[StageKey, tuple[tuple[int, int], bk.StageChunks]] = {}
        self._bucket_pool, self._pending_buckets, self._bucket_clock = None, None, None

    def _stage_layout(self, k: StageKey) -> tuple[tuple[int, ...], dict[int, tuple[int, int]]]:
        """(world ranks running stage `k`, world rank -> samples [start, stop) of a microbatch it
        holds). One process per island (or no communicator): that process, the whole microbatch.
        An island of several processes (issue 15): the processes holding the stage's devices
        (`exchange.row_processes`), each with its DP rows' samples.

        Raises:
          ValueError: an island of several processes runs more than one stage of the plan (its
            processes would interleave the stages' collectives in different orders), or a stage's
            TP rows span processes (see `exchange.row_processes`).
        """
        plan, spec = self.plan, self.plan.stage(*k)
        isl, mbs = plan.island(spec.island), plan.microbatch_size
        if self.comm is None:
            return (0,), {0: (0, mbs)}
        start = plan.island_ranks(isl.name).start
        if isl.num_processes == 1:
            return (start,), {start: (0, mbs)}
        check_runtime_support(plan)
        procs = exchange.row_processes(plan.stage_devices(*k), spec.dp, spec.tp, isl.devices_per_process)
        rows = exchange.process_rows(mbs, procs)
        return tuple(start + p for p in sorted(rows)), {start + p: r for p, r in rows.items()}

    def _island_devices(self) -> list:
        """The devices of this rank's island runtime in the plan's island-global order: process p's
        first `devices_per_process` devices (by id) are indices p * devices_per_process ...

        Raises:
          ValueError: if a process of the island has fewer devices than the plan gives it.
        """
        isl = self.plan.rank_island(self.rank)
        by_proc: dict[int, list] = {}
        for d in sorted(jax.devices(), key=lambda d: d.id):
            by_proc.setdefault(d.process_index, []).append(d)
        short = {p: len(ds) for p, ds in by_proc.items() if len(ds) < isl.devices_per_process}
        if short or len(by_proc) != isl.num_processes:
            raise ValueError(f"island {isl.name!r}: the plan gives it {isl.num_processes} processes x "
                             f"{isl.devices_per_process} devices; its JAX runtime has processes "
                             f"{ {p: len(ds) for p, ds in sorted(by_proc.items())} } (process: devices)")
        return [d for p in sorted(by_proc) for d in by_proc[p][:isl.devices_per_process]]

    def _counts(self, k: StageKey) -> bool:
        """True on the one rank of stage `k` that contributes its replicated scalars (loss sums,
        squared norms, busy times) to world sums: every process of a multi-process stage holds them."""
        return self.rank == self.owner[k]

    def _split_boundary(self, src: StageKey, dst: StageKey) -> bool:
        """True when messages between `src` and `dst` travel as row parts between matching processes
        (either stage runs on several processes)."""
        return self.comm is not None and (len(self.owners[src]) > 1 or len(self.owners[dst]) > 1)

    def _update_fusable(self) -> bool:
        """True when `fuse_update` applies: one replica of one stage, nothing shared, no other process,
        and the stage's last backward directly follows the forward of the same microbatch (1F1B; not
        GPipe with several microbatches, whose last backward is of the first microbatch)."""
        if not (self.fuse_update and self.fuse_last_stage and self.plan.num_replicas == 1
                and self.plan.num_stages(0) == 1 and not self.shared
                and (self.comm is None or self.comm.size == 1)):
            return False
        compute = [a for a in self.train_actions[0][0] if a.kind in (ActionKind.F, ActionKind.B)]
        return (len(compute) >= 2 and compute[-1].kind == ActionKind.B and compute[-2].kind == ActionKind.F
                and compute[-1].microbatch == compute[-2].microbatch)

    # ------------------------------------------------------------------------------------------
    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    def emulation_lines(self) -> list[str]:
        """One line per island with an emulated slowdown (DESIGN.md section 9)."""
        return [f"island {i.name}: EMULATED {i.slowdown:g}x slowdown on platform {i.platform} "
                "(after each compute action and optimizer update the runtime waits (factor - 1) x its "
                "measured time)"
                for i in self.plan.islands if i.slowdown > 1]

    # ---- batch slicing --------------------------------------------------------------------------
    def _microbatch(self, batch: dict[str, np.ndarray], key: StageKey, mb: int) -> dict[str, np.ndarray]:
        r = key[0]
        mbs = self.plan.microbatch_size
        lo = self.offsets[r] + mb * mbs
        return {k: v[lo:lo + mbs] for k, v in batch.items()}

    @staticmethod
    def _check_batch(batch: dict[str, np.ndarray], gbs: int) -> float:
        for k in ("tokens", "targets", "loss_mask"):
            if k not in batch:
                raise ValueError(f"batch is missing {k!r}")
            if batch[k].shape[0] != gbs:
                raise ValueError(f"batch[{k!r}] has {batch[k].shape[0]} rows, the plan's global_batch_size is {gbs}")
        tokens = float(np.sum(batch["loss_mask"]))
        if tokens <= 0:
            raise ValueError("the global batch has no non-pad tokens (loss_mask sums to 0)")
        return tokens

    # ---- execution ------------------------------------------------------------------------------
    def _run(self, batch: dict[str, np.ndarray], train: bool,
             update_inv_tokens: float | None = None) -> tuple[dict, dict, list[ActionRecord]]:
        """Executes the action lists of this rank's stages (see `_StepExecutor`).

        Returns (acc, loss_sums, records): acc maps each local stage to its token-summed gradient
        accumulator (empty when not `train`); with `update_inv_tokens` (only when `_update_fusable()`)
        the last microbatch also applies the optimizer update and acc maps the stage to the global
        gradient norm (a device scalar) instead. loss_sums: each last stage's summed losses, one per
        microbatch; records: one `ActionRecord` per executed action."""
        return _StepExecutor(self, batch, train, update_inv_tokens).run()

    def _emulate(self, k: StageKey, out: Any, t0: float, bg0: float | None = None) -> None:
        """Waits for the action's (or update's) result; on an emulated slow island also sleeps
        (factor-1) x its own compute time: the wall time since ``t0`` (``time.perf_counter()``)
        less the CPU time the bucket all-reduce thread took since ``bg0`` (`_bg_cpu` at ``t0``).
        That thread (device->host copies, bridge) shares the island's one CPU core with the compute
        here; on a real accelerator it runs on the host beside it, so only the island's own compute
        is stretched by the factor (the interference itself is paid once, as measured)."""
        jax.block_until_ready(out)
        factor = self.plan.island(self.plan.stage(*k).island).slowdown
        if factor > 1:
            busy = time.perf_counter() - t0
            if bg0 is not None:
                busy -= max(0.0, self._bg_cpu() - bg0)
            emulated_wait((factor - 1) * max(busy, 0.0))

    def _bg_cpu(self) -> float:
        """CPU seconds used so far by the bucket all-reduce thread (0.0 before it exists or where
        the platform has no per-thread CPU clock)."""
        clock = getattr(self, "_bucket_clock", None)
        return time.clock_gettime(clock) if clock is not None else 0.0

    def _mark(self) -> tuple[float, float]:
        """(`time.perf_counter()`, `_bg_cpu()`): the start of a compute action for `_emulate`."""
        return time.perf_counter(), self._bg_cpu()

    def _send(self, m: tuple, x: Any, mailbox: dict, pending: list) -> None:
        kind, src, dst, mb = m
        if self._split_boundary(src, dst):  # each process sends its rows to the processes holding them
            lo, hi = self.rows[src][self.rank]
            mine = mp.local_rows(x, lo, hi)
            for p, q, a, b in exchange.routes(self.rows[src], self.rows[dst]):
                if p == self.rank:
                    pending.append(self.comm.isend(mine[a - lo:b - lo], q, self._tag(m)))
            return
        if self.comm is not None and self.owner[dst] != self.rank:
            pending.append(self.comm.isend(np.asarray(jax.device_get(x)), self.owner[dst], self._tag(m)))
            return
        same_island = self.plan.stage(*src).island == self.plan.stage(*dst).island
        mailbox[m] = x if same_island else np.asarray(jax.device_get(x))  # other island: host path

    def _tag(self, m: tuple) -> int:
        kind, src, dst, mb = m
        max_stages = max(self.plan.num_stages(r) for r in range(self.plan.num_replicas))
        max_mb = max(s // self.plan.microbatch_size for s in self.shares)
        return ((dst[0] * max_stages + dst[1]) * max_mb + mb) * 2 + _KIND_CODE[kind]

    def _post_receives(self, lists: dict, batch: dict) -> dict:
        """Posts every receive of the step from other processes up front. Activations and their
        gradients are `[microbatch_size, S, hidden_size]` in the compute dtype, so each receive gets
        its own preallocated `out=` buffer (NaN-filled with `debug_nan`): the communicator posts the
        payload receive at once (a mismatching message raises CommError naming both shapes)."""
        recvs = {}
        shape = (self.plan.microbatch_size, batch["tokens"].shape[1], self.config.hidden_size)
        dtype = jnp.dtype(self.config.dtype)
        for k, acts in lists.items():
            for a in acts:
                if a.is_recv and self._split_boundary((k[0], a.peer), k):
                    recvs[_incoming(k, a)] = self._post_parts(_incoming(k, a), shape, dtype)
                elif a.is_recv and self.owner[(k[0], a.peer)] != self.rank:
                    m = _incoming(k, a)
                    buf = np.full(shape, np.nan, dtype) if self.debug_nan else np.empty(shape, dtype)
                    recvs[m] = self.comm.irecv(self.owner[(k[0], a.peer)], self._tag(m), out=buf)
        return recvs

    def _post_parts(self, m: tuple, shape: tuple, dtype: Any) -> mp.PartsReceive:
        """Posts the receives of message `m`'s row parts from the processes of the sending stage that
        hold this process's rows, each into its slice of one buffer of this process's rows."""
        kind, src, dst, mb = m
        lo, hi = self.rows[dst][self.rank]
        full = (hi - lo,) + tuple(shape[1:])
        buf = np.full(full, np.nan, dtype) if self.debug_nan else np.empty(full, dtype)
        handles = [self.comm.irecv(p, self._tag(m), out=buf[a - lo:b - lo])
                   for p, q, a, b in exchange.routes(self.rows[src], self.rows[dst]) if q == self.rank]
        return mp.PartsReceive(buf, handles)

    def _place_received(self, k: StageKey, x: Any) -> Any:
        """A received activation or gradient on stage `k`'s activation sharding (a multi-process
        stage: `x` holds this process's rows only)."""
        st = self._stages[k]
        if not st.multiprocess:
            return jax.device_put(x, st.act_sharding)
        lo, _ = self.rows[k][self.rank]
        return mp.place_rows(x, lo, (self.plan.microbatch_size,) + tuple(x.shape[1:]), st.act_sharding)

    # ---- cross-stage reductions ----------------------------------------------------------------
    def _warm_up_collectives(self) -> None:
        """Every rank: a barrier, then the gloo communicators of each local stage mesh that spans
        processes (``multiprocess.warm_up_collectives``), so none is first made inside a step."""
        spanning = [k for k in self.local_keys if mp.spans_processes(list(self._stages[k].mesh.devices.flat))]
        if not any(len(o) > 1 for o in self.owners.values()):
            return  # no island of several processes in this plan: nothing to warm up, no barrier
        self.comm.barrier(timeout=self.timeout_s)
        for k in spanning:
            mp.warm_up_collectives(self._stages[k].mesh)

    def _make_group_comms(self) -> None:
        """One sub-communicator per set of ranks that share parameters (created on every rank)."""
        groups = sorted({self._holder_ranks(h) for h in self.shared.values()})
        for g in groups:
            if len(g) < 2:
                continue
            sub = self.comm.split(0 if self.rank in g else None, self.rank)
            if self.rank in g:
                self._group_comms[g] = sub

    def _holder_ranks(self, holders: list[StageKey]) -> tuple[int, ...]:
        """The world ranks running any of `holders` (every process of a multi-process stage)."""
        return tuple(sorted({r for k in holders for r in self.owners[k]}))

    def _allreduce_world(self, x: np.ndarray) -> np.ndarray:
        if self.comm is None:
            return x
        with self._naming_peers(range(self.comm.size)):
            return np.asarray(self.comm.allreduce(x, op="sum"))

    @contextmanager
    def _naming_peers(self, ranks):
        """A collective over ``ranks`` that times out raises TimeoutError naming the other ranks and
        their islands (one of them stopped responding) and ``train.message_timeout_s``."""
        from hethub_jax.comm.base import CommTimeoutError
        try:
            yield
        except CommTimeoutError as e:
            peers = ", ".join(f"rank {r} (island {self.plan.rank_island(r).name})" for r in ranks if r != self.rank)
            raise TimeoutError(f"rank {self.rank}: {e}; waiting on {peers} (train.message_timeout_s "
                               f"{self.timeout_s:g} s)") from None

    def _reduce_shared(self, acc: dict[StageKey, Any]) -> dict[StageKey, Any]:
        """Sums the gradients of parameters held by several stages and gives every holder the sum."""
        done = self._join_buckets()  # names already all-reduced during the backward (buckets)
        if not self.shared:
            return acc
        flats = {k: self._stages[k].flat(acc[k]) for k in self.local_keys}
        by_group: dict[tuple[int, ...], list[str]] = {}
        for name, hs in self.shared.items():
            if name not in done:
                by_group.setdefault(self._holder_ranks(hs), []).append(name)
        new = {k: dict(f) for k, f in flats.items()}
        for name, total in done.items():
            for k in self.shared[name]:
                if k in new and total is not None:  # None: reduced to its owner, another replica
                    new[k][name] = total
        for group, names in by_group.items():
            if self.rank not in group:
                continue
            local_sum = {}
            for name in names:
                parts = [flats[k][name] for k in self.shared[name] if k in flats]  # this rank's copies
                if len(parts) == 1:
                    local_sum[name] = parts[0]
                else:  # summed on the host in float32, in holder order (the same on every rank)
                    local_sum[name] = sum(mp.host_copy(p).astype(np.float32) for p in parts)
            if len(group) > 1:
                sub = self._group_comms[group]
                # every process of a multi-process stage holds the whole sum; only its first counts
                counts = all(self._counts(k) for k in self.local_keys)
                # float32 host arrays; no second copy of one already float32 (both collectives below only
                # read them: they pack the leaves into a fresh buffer first)
                host = {n: np.asarray(mp.host_copy(v), np.float32) for n, v in local_sum.items()}
                host = host if counts else {n: np.zeros_like(v) for n, v in host.items()}
                with self._naming_peers(group):
                    if self._reduce_to_owners():  # ZeRO-1: only the owner needs the sum
                        local_sum = zero.reduce_to_owners(sub, host, self._group_owner(group))
                    else:
                        local_sum = sub.allreduce_tree(host, op="sum")  # one all-reduce for all of them
            for name, total in local_sum.items():
                for k in self.shared[name]:
                    if k in new and total is not None:  # None: summed at its owner only
                        new[k][name] = total
        out = {}
        for k in self.local_keys:
            st = self._stages[k]
            tree = st.unflat(new[k], like=acc[k])
            if st.multiprocess:  # the same host sum on every process: each device takes its slice
                out[k] = jax.tree.map(lambda v, like, s: mp.place_global(np.asarray(v, like.dtype), s),
                                      tree, acc[k], st.param_shardings)
                continue
            out[k] = _place_tree(tree, acc[k], st.param_shardings)
        return out

    # ---- sharded optimizer update (ZeRO-1) ------------------------------------------------------
    def _set_owners(self) -> None:
        """Sets `owner_of` (parameter name -> owning replica: `plan.zero1_owners` of the parameter
        bytes and the current shares, or the `update_weights` when set; empty when the update is
        replicated) and `norm_owner` (the
        first holder, in the owning replica under ZeRO-1). The same on every rank."""
        if self.zero1:
            weights = self.shares if self.update_weights is None else self.update_weights
            self.owner_of = zero1_owners(self._param_bytes, weights)
            self.norm_owner = {n: next(k for k in h if k[0] == self.owner_of[n]) for n, h in self._holders.items()}
        else:
            self.owner_of = {}
            self.norm_owner = {n: h[0] for n, h in self._holders.items()}

    def owned_names(self, key: StageKey) -> frozenset[str]:
        """Parameter names stage ``key`` updates: all of its parameters unless the update is sharded
        (ZeRO-1), then those its replica owns and of which it is the replica's first holder
        (`norm_owner`; a second holder in the owning replica, a tied LM head on another stage, gets
        the updated tensor from that first holder like the other replicas do)."""
        names = self._stages[key].flat(self._stages[key]._abstract_params)
        if not self.zero1:
            return frozenset(names)
        return frozenset(n for n in names if self.norm_owner[n] == key)

    def _update_fn(self, key: StageKey):
        """Stage ``key``'s jitted update (`PipelineStage.update`, or `owned_update` under ZeRO-1)."""
        st = self._stages[key]
        return st.owned_update(self.owned_names(key)) if self.zero1 else st.update

    def _single_process_stages(self) -> bool:
        """Every stage runs on one process (the plan's islands are one process each)."""
        return all(len(o) == 1 for o in self.owners.values())

    def _reduce_to_owners(self) -> bool:
        """True when the shared gradients are summed at their owners only (ZeRO-1 over processes:
        each tensor's sum goes to the process of its `norm_owner` stage, whatever the replicas' stage
        splits; every stage on one process; not while `gradients` asks for every sum)."""
        return self.zero1 and self.comm is not None and not self._full_reduce and self._single_process_stages()

    def _group_owner(self, group: tuple[int, ...]):
        """name -> the group rank (position in ``group``, sorted world ranks) of the process holding
        the name's owning stage: the group communicator's ranks (``split`` keyed by world rank)."""
        return lambda n: group.index(self.owner[self.norm_owner["embed_tokens" if n == "rows" else n]])

    def _apply_updates(self, acc: dict[StageKey, Any], inv: Any, gnorm: Any) -> None:
        """Each local stage's optimizer update (its owned parameters only under ZeRO-1; the emulated
        slowdown applies to the update too); then, under ZeRO-1, the owners' parameters go to the other
        replicas (`_exchange_params`)."""
        for k in self.local_keys:
            st, t_update = self._stages[k], time.perf_counter()
            st.params, st.opt_state = self._update_fn(k)(st.params, st.opt_state, acc[k], inv, gnorm)
            if self.plan.island(self.plan.stage(*k).island).slowdown > 1:
                self._emulate(k, st.params, t_update)  # the update runs on the slow island too
        if self.zero1:
            t0 = time.perf_counter()
            self._exchange_params()
            self.last_exchange_s = time.perf_counter() - t0

    @property
    def stages(self) -> dict[StageKey, PipelineStage]:
        """This rank's pipeline stages by (replica, stage) key, their parameters current (waits for
        a parameter gather still running in the background: `wait_params`)."""
        self.wait_params()
        return self._stages

    def _gather_in_background(self) -> bool:
        """True when the ZeRO-1 parameter gather runs on a background thread (`overlap_param_gather`,
        between processes, and this rank exchanges with another process)."""
        return (self.zero1 and self.overlap_param_gather and self.comm is not None
                and any(self.rank in g and len(g) > 1 for g in self._group_comms))

    def _exchange_params(self) -> None:
        """ZeRO-1: every stage gets the parameters it does not update itself from their owning stages
        (`_from_owners`): at once, or, with `_gather_in_background`, started on a background thread
        and placed by `wait_params` (the next step's first action, or any read of the parameters)."""
        local = {k: self._stages[k].flat() for k in self.local_keys}
        if not self._gather_in_background():
            self._place_params(local, self._from_owners(local, lambda x: x))
            return
        if self._gather_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._gather_pool = ThreadPoolExecutor(1, thread_name_prefix="param-gather")

        def gather():  # host copies of the owned tensors, the bridge; no device placement here
            t0 = time.perf_counter()
            return self._from_owners(local, lambda x: x), time.perf_counter() - t0
        self._pending_gather = (self._gather_pool.submit(gather), local)

    def wait_params(self) -> None:
        """Waits for a ZeRO-1 parameter gather running in the background (`overlap_param_gather`) and
        places the received tensors on the stages; sets `last_exchange_s` (the gather's seconds on its
        thread) and `last_exchange_wait_s` (seconds waited here). No-op when none is pending.

        Raises:
          TimeoutError: naming the peers, if a peer's tensors did not arrive in `timeout_s`; the
            communicator's other errors.
        """
        pending, self._pending_gather = self._pending_gather, None
        if pending is None:
            return
        future, local = pending
        t0 = time.perf_counter()
        got, self.last_exchange_s = future.result()
        self.last_exchange_wait_s = time.perf_counter() - t0
        self._place_params(local, got)

    def _place_params(self, local: dict[StageKey, dict[str, Any]], got: dict[StageKey, dict[str, Any]]) -> None:
        """Each local stage's parameters: ``local`` (flat name -> array) with ``got``'s received
        tensors placed on the stage's shardings."""
        for k, vals in got.items():
            if vals:
                st = self._stages[k]
                flat, shardings = dict(local[k]), st.flat(st.param_shardings)
                names = list(vals)  # one batched transfer (see `_place_tree`)
                flat.update(zip(names, jax.device_put([vals[n] for n in names], [shardings[n] for n in names])))
                st.params = st.unflat(flat)

    def sync_optimizer_state(self) -> None:
        """Makes every stage's optimizer state current for every parameter (collective: every rank
        calls it). Under ZeRO-1 a stage keeps current only the Adam moments of the parameters its
        replica owns; this copies the others from their owners (before a checkpoint is written, and
        before the owners change). No-op when the update is replicated."""
        self.wait_params()
        if not self.zero1:
            return
        local, index = {}, {}
        for k in self.local_keys:
            st = self._stages[k]
            leaves = jax.tree.leaves(st.opt_state)
            index[k] = {f"{slot}|{name}": i for i, (slot, name) in
                        ((i, e) for i, e in enumerate(st.opt_state_names()) if e is not None)}
            local[k] = {x: leaves[i] for x, i in index[k].items()}
        got = self._from_owners(local, lambda x: x.split("|", 1)[1])
        for k, vals in got.items():
            st = self._stages[k]
            leaves, treedef = jax.tree.flatten(st.opt_state)
            for x, v in vals.items():
                i = index[k][x]
                leaves[i] = jax.device_put(np.asarray(v, leaves[i].dtype) if isinstance(v, np.ndarray) else v,
                                           leaves[i].sharding)
            st.opt_state = jax.tree.unflatten(treedef, leaves)

    def _from_owners(self, local: dict[StageKey, dict[str, Any]], name_of) -> dict[StageKey, dict[str, Any]]:
        """For each local stage, key -> the owning stage's value of every key of ``local[stage]``
        whose parameter (``name_of(key)``) the stage does not update itself (its `norm_owner` is
        another stage). ``local``: per local stage, key -> array (the same keys on every holder of a
        parameter). The value comes from the parameter's `norm_owner` stage: in one process directly
        (through the host between islands, as over the bridge); between processes by
        `zero.gather_from_owners` over the holders' group (any stage splits of the replicas: each
        process sends what its stages own to the group's other processes), or, were a stage spread
        over several processes, a sum over the group in which only the owner's first process
        contributes."""
        need = {k: sorted(x for x in d if self.norm_owner[name_of(x)] != k) for k, d in local.items()}
        src = lambda x: self.norm_owner[name_of(x)]
        out: dict[StageKey, dict[str, Any]] = {k: {} for k in local}
        pending: dict[tuple[int, ...], set[str]] = {}
        for k, xs in need.items():
            for x in xs:
                if src(x) in local:
                    v = local[src(x)][x]
                    same = self.plan.stage(*src(x)).island == self.plan.stage(*k).island
                    out[k][x] = v if same else np.asarray(jax.device_get(v))
                else:
                    pending.setdefault(self._holder_ranks(self._holders[name_of(x)]), set()).add(x)
        if self.comm is None:
            return out
        # every rank of a group takes part, owner or not: the keys of each group held here
        for group in sorted({self._holder_ranks(h) for h in self.shared.values()}):
            if self.rank not in group or len(group) < 2:
                continue
            held = {}  # the owner's copy where it is local
            for d in local.values():
                held.update({x: local[src(x)][x] if src(x) in local else v for x, v in d.items()
                             if self._holder_ranks(self._holders[name_of(x)]) == group})
            if not held:
                continue
            sub = self._group_comms[group]
            with self._naming_peers(group):
                if self._single_process_stages():  # point to point from the owner's process
                    owner = lambda x, g=group: g.index(self.owner[src(x)])
                    mine = {x: mp.host_copy(v) for x, v in held.items() if owner(x) == sub.rank}
                    vals = zero.gather_from_owners(sub, mine, held, owner)
                else:
                    host = {x: (mp.host_copy(v) if self.rank == self.owner[src(x)] else
                                np.zeros(v.shape, v.dtype)) for x, v in held.items()}
                    vals = sub.allreduce_tree(host, op="sum")  # x + 0: exact
            for k, xs in need.items():
                out[k].update({x: vals[x] for x in xs if x in pending.get(group, ()) and x in vals})
        return out

    # ---- bucketed gradient all-reduce overlapped with the backward (heterogeneous DP) ----------
    def set_grad_buckets(self, bucket_mb: float | str | None) -> None:
        """Bucket size of the overlapped gradient all-reduce, MiB (``None``: off); the first bucket
        is `buckets.DEFAULT_FIRST_BUCKET_BYTES` or the bucket size if smaller. ``"auto"``: buckets of
        `plan.AUTO_GRAD_BUCKET_MB` (25) or off, whichever `choose_grad_buckets` measures faster (it runs
        before the first `train_step` if not called earlier); until then the bucketed path is set (what
        `measure_step_costs` measures).

        Raises:
          ValueError: if ``bucket_mb`` is not None, ``"auto"`` or a number > 0.
        """
        from hethub_jax.parallel.plan import AUTO_GRAD_BUCKET_MB

        self.grad_bucket_auto_pending, self.grad_bucket_choice = False, None
        if bucket_mb is None:
            self.grad_bucket_bytes = None
            return
        if isinstance(bucket_mb, str) and bucket_mb == "auto":
            self.grad_bucket_auto_pending = True
            bucket_mb = AUTO_GRAD_BUCKET_MB
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0 \
                or not math.isfinite(bucket_mb):
            raise ValueError(f"grad_bucket_mb must be a number of MiB > 0, 'auto' or None (off), got {bucket_mb!r}")
        self.grad_bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.first_grad_bucket_bytes = min(bk.DEFAULT_FIRST_BUCKET_BYTES, self.grad_bucket_bytes)

    def choose_grad_buckets(self, batch: dict[str, np.ndarray], steps: int = 3,
                            timer: Callable[[], float] = time.perf_counter) -> dict | None:
        """``grad_bucket_mb: auto`` (`set_grad_buckets`): time the step's forward/backward with the
        gradient all-reduce (no update is applied; parameters and optimizer state are not changed) on
        ``batch`` with buckets and without, keep the faster (`plan.keeps_bucketed_allreduce`), and
        return the record (also `grad_bucket_choice`). Collective: every rank calls it with the same
        batch; every rank gets the same choice (the seconds are shared). No-op returning the earlier
        record (None if never auto) unless ``auto`` is pending. When bucketing cannot apply
        (`grad_bucket_off_reason`: one replica, several stages, ...) nothing is timed.

        Measurement: each path runs once untimed (compiles), then ``steps`` times, the two paths
        interleaved (the order alternates); a step's seconds are the slowest rank's (the ranks end
        together at the all-reduce), a path's the fastest of its steps (a load spike lengthens a step,
        never shortens it). Emulated slowdowns (`PipelineRuntime._emulate`) are included, as in
        training. Costs 2 (``steps`` + 1) forward/backward passes, i.e. a few warm-up steps.

        Returns:
          None or ``{"path": "bucketed" | "unbucketed", "bucketed_s": float | None, "unbucketed_s":
          float | None, "bucket_mb": float, "steps": int, "reason": str | None}`` (seconds per step,
          MEASURED; ``reason``: why nothing was timed).

        Raises:
          ValueError: if ``steps`` < 1; as `train_step` for a bad batch.
        """
        from hethub_jax.parallel.plan import keeps_bucketed_allreduce

        if not self.grad_bucket_auto_pending:
            return self.grad_bucket_choice
        if steps < 1:
            raise ValueError(f"choose_grad_buckets needs steps >= 1, got {steps}")
        self.grad_bucket_auto_pending = False
        caps = self.grad_bucket_bytes
        rec = {"path": None, "bucketed_s": None, "unbucketed_s": None, "bucket_mb": caps / 2**20,
               "steps": steps, "reason": self.grad_bucket_off_reason()}
        if rec["reason"] is not None:
            self.grad_bucket_choice = rec
            return rec
        self.wait_params()
        size, me = (1, 0) if self.comm is None else (self.comm.size, self.rank)
        paths = (caps, None)
        secs = np.zeros((len(paths), steps, size))
        try:
            for caps_now in paths:  # compiles each path's programs
                self.grad_bucket_bytes = caps_now
                self._forward_backward(batch)
            for i in range(steps):
                for j in (range(len(paths)) if i % 2 == 0 else reversed(range(len(paths)))):
                    self.grad_bucket_bytes = paths[j]
                    t0 = timer()
                    self._forward_backward(batch)
                    secs[j, i, me] = timer() - t0
        finally:
            self.grad_bucket_bytes = caps
            self.last_bucket_stats = None
        secs = self._allreduce_world(secs.reshape(-1)).reshape(secs.shape)  # each rank fills its own slot
        bucketed_s, unbucketed_s = (float(secs[j].max(axis=1).min()) for j in range(len(paths)))
        keep = keeps_bucketed_allreduce(bucketed_s, unbucketed_s)
        self.grad_bucket_bytes = caps if keep else None
        if not keep:  # nothing of the bucketed path stays: its thread, compiled buckets and arrival bridge
            self._release_buckets()
        rec.update(path="bucketed" if keep else "unbucketed", bucketed_s=bucketed_s, unbucketed_s=unbucketed_s)
        self.grad_bucket_choice = rec
        return rec

    def _release_buckets(self) -> None:
        """Ends the bucket all-reduce thread and drops the compiled bucket programs (`_step_buckets`
        makes them again if bucketing is turned back on)."""
        if self._bucket_pool is not None:
            self._bucket_pool.shutdown(wait=True)
        self._bucket_pool, self._bucket_clock = None, None
        self._chunks.clear()
        self.__dict__.pop("_bucket_arrive", None)

    def _bucketing(self) -> bool:
        """True when the step's last backward runs in buckets (`hethub_jax.parallel.buckets`):
        `grad_bucket_bytes` set, several replicas, each one stage on one process (every parameter is
        then held by every replica: one group), and every replica's last two compute actions are F
        and B of one microbatch. The same on every rank (it depends on the plan and shares only).
        `grad_bucket_off_reason` says which condition fails."""
        return self.grad_bucket_off_reason() is None

    def grad_bucket_off_reason(self) -> str | None:
        """None when the bucketed all-reduce applies (`_bucketing`), else why not, in words (printed
        by training and the benchmarks instead of a bare "0 buckets"). By design the bucketed path
        runs the LAST microbatch's forward and backward together in layer buckets
        (`_StepExecutor._bucketed`), so it needs them adjacent: 1F1B on one-stage replicas has them
        (F(m) B(m) at the end); GPipe has them only with one microbatch per replica (its order is all
        F, then all B: the last backward's forward ran long before, its residuals saved whole)."""
        plan = self.plan
        if self.grad_bucket_bytes is None:
            c = self.grad_bucket_choice
            if c is not None and c["path"] == "unbucketed":
                return (f"off: train.grad_bucket_mb auto measured the all-reduce after the backward faster "
                        f"(MEASURED {c['unbucketed_s']:.4g} s/step against {c['bucketed_s']:.4g} s/step bucketed)")
            return "off (train.grad_bucket_mb null)"
        if plan.num_replicas < 2 or not self.shared:
            return "no heterogeneous-DP gradients to all-reduce (one replica)"
        if any(plan.num_stages(r) != 1 for r in range(plan.num_replicas)) or any(
                len(o) > 1 for o in self.owners.values()):
            return "replicas of several stages or processes (bucketing needs one stage on one process each)"
        for r in range(plan.num_replicas):
            comp = [a for a in self.train_actions[r][0] if a.kind in (ActionKind.F, ActionKind.B)]
            if not (len(comp) >= 2 and comp[-1].kind == ActionKind.B and comp[-2].kind == ActionKind.F
                    and comp[-1].microbatch == comp[-2].microbatch):
                return (f"replica {r}'s last backward (microbatch {comp[-1].microbatch if comp else '?'}) does not "
                        f"follow its own forward under schedule {plan.schedule} ({len(comp) // 2} microbatches: "
                        f"GPipe runs all forwards, then all backwards); the all-reduce runs after the backward")
        return None

    def grad_bucket_line(self) -> str | None:
        """One line on the heterogeneous-DP gradient all-reduce for the start-up banner: bucketed (size)
        or not, and why not; None for a plan of one replica."""
        if self.plan.num_replicas < 2:
            return None
        why = self.grad_bucket_off_reason()
        if why is None:
            c = self.grad_bucket_choice
            how = (" (train.grad_bucket_mb auto: chosen by the first step's warm-up measurement)"
                   if self.grad_bucket_auto_pending else
                   f" (train.grad_bucket_mb auto: MEASURED {c['bucketed_s']:.4g} s/step against "
                   f"{c['unbucketed_s']:.4g} s/step after the backward)" if c is not None and c["bucketed_s"] is not None else "")
            return (f"gradient all-reduce across replicas: in buckets of {self.grad_bucket_bytes / 2**20:g} MiB "
                    f"(first {self.first_grad_bucket_bytes / 2**20:g} MiB) overlapped with the last backward{how}")
        return f"gradient all-reduce across replicas: NOT bucketed: {why}"

    def _step_buckets(self, batch: dict[str, np.ndarray]) -> bk.BucketedReduction | None:
        """This step's bucket reductions (None when `_bucketing` is False); compiles each local
        stage's buckets on first use (again when the bucket sizes change)."""
        if not self._bucketing():
            return None
        caps = (int(self.grad_bucket_bytes), int(self.first_grad_bucket_bytes))
        for k in self.local_keys:
            if self._chunks.get(k, (None,))[0] != caps:
                self._chunks[k] = (caps, bk.StageChunks(self._stages[k], *caps))
        if self._bucket_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._bucket_pool = ThreadPoolExecutor(1, thread_name_prefix="grad-allreduce")
            self._bucket_clock = _thread_cpu_clock(self._bucket_pool)
        mbs, R = self.plan.microbatch_size, self.plan.num_replicas
        last = [batch["tokens"][self.offsets[r] + self.shares[r] - mbs:self.offsets[r] + self.shares[r]] for r in range(R)]
        rows = np.unique(np.concatenate([t.ravel() for t in last]))
        comm = self._group_comms.get(self._bucket_group())
        owners = self._group_owner(self._bucket_group()) if self._reduce_to_owners() and comm is not None else None
        if comm is not None and self.bucket_arrival_sleeps and hasattr(comm, "with_spin"):
            if getattr(self, "_bucket_arrive", (None,))[0] is not comm:
                self._bucket_arrive = (comm, comm.with_spin(0.0))
            return bk.BucketedReduction(self._bucket_pool, self.local_keys, comm, rows, self._bucket_arrive[1],
                                        owners=owners)
        return bk.BucketedReduction(self._bucket_pool, self.local_keys, comm, rows, owners=owners)

    def chunked_replica(self, r: int) -> bool:
        """True when replica ``r`` runs its last microbatch in layer buckets (`buckets.StageChunks`)
        while the bucketed all-reduce applies (`_bucketing`); otherwise it runs it fused and hands the
        whole gradient to the same bucket collectives at the end of its backward. The rule is
        `plan.chunks_last_microbatch` of its microbatches per step (its current share)."""
        return chunks_last_microbatch(self.shares[r] // self.plan.microbatch_size)

    def _bucket_group(self) -> tuple[int, ...]:
        return self._holder_ranks(next(iter(self.shared.values())))

    def _join_buckets(self) -> dict[str, np.ndarray]:
        """Waits for the step's bucket all-reduces: flat name -> host float32 total ({} if none);
        sets `last_bucket_stats` (with exposed_s: seconds waited here, after the backward)."""
        b, self._pending_buckets = self._pending_buckets, None
        if b is None:
            return {}
        t0 = time.perf_counter()
        with self._naming_peers(self._bucket_group()):
            totals = b.join()
        self.last_bucket_stats = dict(b.stats(), exposed_s=time.perf_counter() - t0)
        return totals

    def _forward_backward(self, batch: dict[str, np.ndarray], t0: float | None = None):
        """F and B of the step, shared gradients summed, loss and gradient norm over the world. Returns
        ``(acc, loss, num_tokens, grad_norm, records, bubble)``; ``t0``: the step's start
        (`time.perf_counter()`) for the measured bubble (None: not measured)."""
        num_tokens = self._check_batch(batch, self.plan.global_batch_size)
        acc, loss_sums, records = self._run(batch, train=True)
        counted = [k for k in self.local_keys if self._counts(k)]
        terms = bubble_terms(records, t0, counted) if t0 is not None else (0.0, 0.0, 0)
        acc = self._reduce_shared(acc)
        inv = jnp.float32(1.0 / num_tokens)
        sq = 0.0
        for k in self.local_keys:
            st = self._stages[k]
            counted = {n: v for n, v in st.flat(acc[k]).items() if self.norm_owner[n] == k}
            if counted:
                v = st.sq_norm(counted, inv)  # run by every process of the stage (SPMD)
                sq += mp.scalar(v) if self._counts(k) else 0.0
        loss_sum = self._loss_sum(loss_sums)
        # the bubble's terms ride in the loss all-reduce: summed busy seconds and stage counts, and each
        # rank's pipeline time in its own slot (a sum of one-hot vectors = every rank's value)
        size = self.comm.size if self.comm is not None else 1
        pipeline = np.zeros(size)
        pipeline[self.rank if self.comm is not None else 0] = terms[0]
        out = self._allreduce_world(np.concatenate([[loss_sum, sq, terms[1], terms[2]], pipeline]).astype(np.float64))
        loss_sum, sq, busy, n = out[:4]
        bubble = bubble_from_terms([(float(out[4:].max()), float(busy), int(round(n)))]) if t0 is not None else None
        return acc, float(loss_sum) / num_tokens, num_tokens, math.sqrt(sq), records, bubble

    def _loss_sum(self, loss_sums: dict[StageKey, list]) -> float:
        """This rank's share of the summed token losses (one rank per multi-process stage)."""
        return sum(mp.scalar(x) for k, xs in loss_sums.items() if self._counts(k) for x in xs)

    # ---- public API -----------------------------------------------------------------------------
    def train_step(self, batch: dict[str, np.ndarray]) -> StepResult:
        """One optimizer step on the global batch.

        Args:
          batch: `tokens`, `targets` `[global_batch_size, S] int32` and `loss_mask`
            `[global_batch_size, S] float32` (0 on pads and across document boundaries); the same on
            every rank (each rank takes its replica's rows).

        Raises:
          ValueError: if the batch does not match the plan or has no non-pad tokens.
          TimeoutError: if a message from another process does not arrive within `timeout_s`.
        """
        if self.grad_bucket_auto_pending:  # ``grad_bucket_mb: auto`` and nobody measured yet: measure now
            self.choose_grad_buckets(batch)
        t0 = time.perf_counter()
        if self._update_fusable():  # one stage holds everything: the update runs inside the last F+B
            num_tokens = self._check_batch(batch, self.plan.global_batch_size)
            norms, loss_sums, records = self._run(batch, train=True, update_inv_tokens=1.0 / num_tokens)
            loss = sum(float(x) for xs in loss_sums.values() for x in xs) / num_tokens
            self.step += 1
            return StepResult(loss, int(num_tokens), float(norms[self.local_keys[0]]),
                              time.perf_counter() - t0, records, bubble_from_terms([bubble_terms(records, t0)]))
        acc, loss, num_tokens, norm, records, bubble = self._forward_backward(batch, t0)
        self._apply_updates(acc, jnp.float32(1.0 / num_tokens), jnp.float32(norm))
        jax.block_until_ready([self._stages[k].params for k in self.local_keys])
        self.step += 1
        return StepResult(loss, int(num_tokens), norm, time.perf_counter() - t0, records, bubble)

    def gradients(self, batch: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        """(loss, gradients of the mean loss) without updating; flat global names of this rank's
        stages (a tied embedding or a replicated parameter appears once, holding the total)."""
        self._full_reduce = True  # every holder gets every sum (ZeRO-1 sums at the owners only)
        try:
            acc, loss, num_tokens, _, _, _ = self._forward_backward(batch)
        finally:
            self._full_reduce = False
        out = {}
        for k in self.local_keys:
            for n, v in self._stages[k].flat(acc[k]).items():
                out[n] = mp.host_copy(v).astype(np.float32) / np.float32(num_tokens)
        return loss, out

    def measure_throughputs(self, batch: dict[str, np.ndarray], steps: int = 2) -> list[float]:
        """Warm-up measurement for heterogeneous DP: samples/s of each replica, from forward/backward
        passes on `batch` under the current shares (no update is applied; the first pass, which
        compiles, is not timed). A replica's time is its busiest stage's compute time per step
        (emulated slowdowns included); identical on every rank."""
        self._forward_backward(batch)
        busy = np.zeros((self.plan.num_replicas, max(self.plan.num_stages(r) for r in range(self.plan.num_replicas))))
        for _ in range(steps):
            for rec in self._forward_backward(batch)[4]:
                if rec.action[0] in "FB" and self._counts((rec.replica, rec.stage)):
                    busy[rec.replica, rec.stage] += rec.end_s - rec.start_s
        busy = self._allreduce_world(busy)
        return [self.shares[r] * steps / float(busy[r].max()) for r in range(self.plan.num_replicas)]

    def measure_step_costs(self, batch: dict[str, np.ndarray], steps: int = 2) -> tuple[list[float], list[float]]:
        """Warm-up measurement for heterogeneous DP shares (`plan.balanced_shares`): per replica, the
        seconds per sample of its step and its fixed seconds per step; identical on every rank.

        Runs `steps` forward/backward passes on `batch` under the current shares, with the gradient
        all-reduce as in training (bucketed and overlapped when `_bucketing` applies), after one
        untimed pass that compiles. Per sample: the replica's busiest stage's compute time (F and B
        actions, emulated slowdowns included) / its share; the device->host copies and bridge
        traffic of the buckets that overlap the backward run on the same cores, so what they cost the
        replica is in that time. Fixed: the optimizer update of that stage, timed twice after a
        compiling run on copies of the parameters and optimizer state (the real ones are not changed;
        the copies cost their memory for the duration), emulated slowdown included; the faster of the
        two (a load spike lengthens one run, never shortens it). The all-reduce's
        exposed tail, after the last replica's last bucket, is the same for every replica and so does
        not move the balance: it is not counted. Under the sharded update (ZeRO-1) a replica updates
        the parameters it owns, in proportion to its share (`plan.zero1_owners`): its update then
        costs per sample, not per step, so the whole update's time (timed likewise) / the global batch
        is added to its seconds per sample and its fixed seconds are 0 (the parameter exchange that
        follows is the same for every replica, like the all-reduce's tail).

        The raw figures (each replica's F/B seconds per step at the current shares, the median over
        the steps, and its whole update's seconds) are kept in `last_step_costs` for `plan.balanced_update_fractions`
        (`set_update_weights`).

        Returns:
          (unit_s, fixed_s): seconds per sample and seconds per step, one per replica.
        """
        self._forward_backward(batch)
        R = self.plan.num_replicas
        S = max(self.plan.num_stages(r) for r in range(R))
        busy, fixed = np.zeros((steps, R, S)), np.zeros((R, S))
        for i in range(steps):
            acc, _, num_tokens, norm, records, _ = self._forward_backward(batch)
            for rec in records:
                if rec.action[0] in "FB" and self._counts((rec.replica, rec.stage)):
                    busy[i, rec.replica, rec.stage] += rec.end_s - rec.start_s
        inv, gnorm = jnp.float32(1.0 / num_tokens), jnp.float32(norm)
        for k in self.local_keys:
            st, runs = self._stages[k], []
            for _ in range(3):  # the first run compiles; the faster of the other two (load spikes)
                p, o = jax.tree.map(jnp.copy, (st.params, st.opt_state))
                t0 = time.perf_counter()
                out = st.update(p, o, acc[k], inv, gnorm)  # the whole update (ZeRO-1: per sample below)
                self._emulate(k, out, t0)
                runs.append(time.perf_counter() - t0)
                del p, o, out
            fixed[k] = min(runs[1:]) if self._counts(k) else 0.0
        busy = self._allreduce_world(busy.reshape(-1)).reshape(busy.shape)
        fixed = self._allreduce_world(fixed)
        per_step = busy.max(axis=2)  # [step, replica]: each replica's busiest stage
        self.last_step_costs = {"busy_s": [float(np.median(per_step[:, r])) for r in range(R)],
                                "update_s": [float(fixed[r].max()) for r in range(R)]}
        total = busy.sum(axis=0)  # [replica, stage] over the steps
        unit = [float(total[r].max()) / (steps * self.shares[r]) for r in range(R)]
        if self.zero1:  # each replica updates a share of the parameters proportional to its batch share
            gbs = self.plan.global_batch_size
            return [u + float(fixed[r].max()) / gbs for r, u in enumerate(unit)], [0.0] * R
        return unit, [float(fixed[r].max()) for r in range(R)]

    def set_update_weights(self, weights: list[float] | None) -> None:
        """ZeRO-1: the replicas' weights for the ownership of the update (`plan.zero1_owners`: replica
        ``r`` owns about a fraction ``weights[r] / sum(weights)`` of the parameter bytes). None (the
        default): the batch shares. Measured weights, `plan.balanced_update_fractions` of
        `last_step_costs` at the final shares, put the update where the replicas would otherwise idle
        (the whole-microbatch shares rarely balance the step exactly); the result does not change
        (every parameter is updated once, by its owner, with the same arithmetic). No-op for a
        replicated update. Collective under ZeRO-1 after steps (the moments are synchronised first,
        `sync_optimizer_state`): every rank calls it with the same weights.

        Raises:
          ValueError: if not one weight per replica, each finite and > 0.
        """
        if weights is not None:
            if len(weights) != self.plan.num_replicas or not all(
                    math.isfinite(w) and w > 0 for w in weights):
                raise ValueError(f"update weights must be {self.plan.num_replicas} finite values > 0 "
                                 f"(one per replica), got {weights}")
            weights = [float(w) for w in weights]
        self.wait_params()
        if self.zero1 and self.step > 0:
            self.sync_optimizer_state()  # the owners change: every moment must be current first
        self.update_weights = weights
        self._set_owners()

    def set_batch_shares(self, shares: list[int]) -> None:
        """Changes the replicas' shares of the global batch (samples). Each share must be a multiple
        of the microbatch size, at least one microbatch, and the shares must sum to the global batch.

        Raises:
          ValueError: naming the constraint that failed.
        """
        mbs, gbs = self.plan.microbatch_size, self.plan.global_batch_size
        if len(shares) != self.plan.num_replicas or sum(shares) != gbs:
            raise ValueError(f"batch shares {shares} must be {self.plan.num_replicas} values summing to "
                             f"global_batch_size {gbs}")
        check_shares(shares, gbs, mbs)
        from hethub_jax.parallel.schedule import get_schedule

        self.wait_params()
        if self.zero1 and self.step > 0:
            self.sync_optimizer_state()  # the owners change: every moment must be current first
        self.shares = list(shares)
        self._set_owners()
        self.offsets = [sum(self.shares[:r]) for r in range(self.plan.num_replicas)]
        for r in range(self.plan.num_replicas):
            m = self.shares[r] // mbs
            self.train_actions[r] = get_schedule(self.plan.schedule)(self.plan.num_stages(r), m)
            self.eval_actions[r] = _forward_only(self.plan.num_stages(r), m)

    def eval_loss(self, batch: dict[str, np.ndarray]) -> tuple[float, float]:
        """(summed token cross-entropy in nats, number of non-pad tokens) of a batch of
        `global_batch_size` rows, forward only; identical on every rank."""
        num_tokens = self._check_batch(batch, self.plan.global_batch_size)
        _, loss_sums, _ = self._run(batch, train=False)
        loss_sum = self._loss_sum(loss_sums)
        return float(self._allreduce_world(np.array([loss_sum], np.float64))[0]), num_tokens

    def params(self) -> dict[str, np.ndarray]:
        """Flat global names -> host arrays of this rank's stages' parameters."""
        self.wait_params()
        out = {}
        for k in self.local_keys:
            out.update({n: mp.host_copy(v) for n, v in self._stages[k].flat().items()})
        return out

    def stage_params(self, key: StageKey) -> dict[str, np.ndarray]:
        self.wait_params()
        return {n: mp.host_copy(v) for n, v in self._stages[key].flat().items()}

    def checkpoint_state(self) -> dict[str, Any]:
        """{"r{replica}s{stage}": {"params": ..., "opt_state": ...}} for this rank's stages, every
        optimizer-state leaf current (under ZeRO-1 a collective: `sync_optimizer_state`)."""
        self.sync_optimizer_state()
        return {f"r{r}s{s}": {"params": self._stages[(r, s)].params, "opt_state": self._stages[(r, s)].opt_state}
                for r, s in self.local_keys}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Inverse of `checkpoint_state`; arrays are placed onto each stage's shardings."""
        self.wait_params()  # a gather still running would overwrite the restored tensors
        for r, s in self.local_keys:
            st, item = self._stages[(r, s)], state[f"r{r}s{s}"]
            st.params = jax.device_put(item["params"], st.param_shardings)
            st.opt_state = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                                        item["opt_state"], st.opt_state)


def _place_tree(tree: Any, like: Any, shardings: Any) -> Any:
    """``tree`` (leaves: host arrays or device arrays) with every leaf on its sharding in ``shardings``
    and in the dtype of ``like``'s leaf (the same tree structure). Host leaves go in ONE batched
    ``jax.device_put`` (measured on `tiny`'s 56 gradient tensors, one CPU core, LOADED machine: 1.3-1.4 ms
    CPU against 4.6-4.8 ms for one ``device_put(jnp.asarray(...))`` per leaf, which also copied each
    leaf twice); a device leaf already in that dtype and sharding is kept as it is (no copy)."""
    leaves, treedef = jax.tree.flatten(tree)
    likes, shs = jax.tree.leaves(like), jax.tree.leaves(shardings)
    out, host = list(leaves), []
    for i, (v, l, s) in enumerate(zip(leaves, likes, shs, strict=True)):
        if isinstance(v, jax.Array):
            if v.dtype != l.dtype or v.sharding != s:
                out[i] = jax.device_put(jnp.asarray(v, l.dtype), s)
        else:
            host.append(i)
    if host:
        placed = jax.device_put([np.asarray(leaves[i], l.dtype) for i, l in ((i, likes[i]) for i in host)],
                                [shs[i] for i in host])
        for i, v in zip(host, placed):
            out[i] = v
    return jax.tree.unflatten(treedef, out)


def _thread_cpu_clock(pool: Any) -> int | None:
    """The CPU-time clock id of a one-thread executor's thread (`time.pthread_getcpuclockid`), or
    None where the platform has none."""
    import threading
    if not hasattr(time, "pthread_getcpuclockid"):
        return None
    return time.pthread_getcpuclockid(pool.submit(threading.get_ident).result())


_SELF_TIMED = object()  # `_forward`'s result when the action already waited on and emulated itself


def _incoming(key: StageKey, a: Action) -> tuple:
    """The message that receive action `a` of stage `key` waits for: (kind, src, dst, microbatch)."""
    kind = "act" if a.kind == ActionKind.RECV_ACT else "grad"
    return (kind, (key[0], a.peer), key, a.microbatch)


class _StepExecutor:
    """One step's execution of the action lists of a runtime's local stages.

    Every local stage advances through its list until it reaches a receive whose message has not
    arrived; the executor then moves on to the next local stage, and polls when none can advance.
    Each action kind is one method: `_forward`, `_backward`, `_send` and `_receive`.

    Values between actions of a stage travel through `outbox`, keyed (box, stage, microbatch) with
    box "in" (received activation), "out" (activation to send), "gout" (received gradient of the
    output) or "gin" (gradient of the input to send); messages from other stages arrive in
    `mailbox`, keyed (kind, src stage, dst stage, microbatch) with kind "act" or "grad".
    """

    def __init__(self, rt: PipelineRuntime, batch: dict[str, np.ndarray], train: bool,
                 update_inv_tokens: float | None):
        self.rt, self.batch, self.train = rt, batch, train
        self.fuse_update, self.inv_tokens = update_inv_tokens is not None, update_inv_tokens
        keys = rt.local_keys
        actions = rt.train_actions if train else rt.eval_actions
        self.lists = {k: actions[k[0]][k[1]] for k in keys}
        self.ptr = {k: 0 for k in keys}
        self.mailbox: dict[tuple, Any] = {}
        self.outbox: dict[tuple, Any] = {}
        self.saved: dict[tuple, Any] = {}    # forward residuals (or inputs, with recompute) per (stage, mb)
        self.fused: dict[tuple, Backward] = {}  # backward results computed with the forward
        self.num_b = {k: sum(a.kind == ActionKind.B for a in self.lists[k]) for k in keys}
        self.n_acc = {k: 0 for k in keys}
        self.buckets = rt._step_buckets(batch) if train else None
        # no accumulator for a one-microbatch step (its backward's gradients ARE the accumulator: no
        # zero-filled buffer, no first write), unless it runs chunked (`StageChunks` takes the buffer)
        self.chunked = {k: self.buckets is not None and rt.chunked_replica(k[0]) for k in keys}
        self.acc = {k: (None if self.num_b[k] == 1 and not self.chunked[k] else rt._stages[k].new_grad_buffer())
                    for k in keys} if train else {}
        self.norms: dict[StageKey, Any] = {}
        self.loss_sums: dict[StageKey, list] = {k: [] for k in keys}
        self.records: list[ActionRecord] = []
        self.pending_sends: list = []
        self.recvs = rt._post_receives(self.lists, batch) if rt.comm is not None else {}

    def run(self) -> tuple[dict, dict, list[ActionRecord]]:
        """Executes every action; returns what `PipelineRuntime._run` documents. First waits for a
        ZeRO-1 parameter gather of the previous step still running in the background (the receives
        are already posted)."""
        self.rt.wait_params()
        deadline = None
        while any(self.ptr[k] < len(self.lists[k]) for k in self.rt.local_keys):
            if self._advance():
                deadline = None
            else:
                deadline = self._wait(deadline)
        for h in self.pending_sends:
            h.wait()
        self.rt._pending_buckets = self.buckets  # joined by `_reduce_shared`
        return (self.norms if self.fuse_update else self.acc), self.loss_sums, self.records

    def _advance(self) -> bool:
        """Runs every local stage as far as its messages allow; True if any action ran."""
        progressed = False
        for k in self.rt.local_keys:
            acts = self.lists[k]
            while self.ptr[k] < len(acts) and self._ready(k, acts[self.ptr[k]]):
                i = self.ptr[k]
                self._execute(k, acts[i], acts[i + 1] if i + 1 < len(acts) else None)
                self.ptr[k] += 1
                progressed = True
        return progressed

    def _wait(self, deadline: float | None) -> float:
        """Nothing can advance: sleeps briefly and returns the deadline for the awaited messages.

        Raises:
          RuntimeError: in a single process (no message can arrive: the schedule deadlocks).
          TimeoutError: no message from another process arrived within the runtime's `timeout_s`.
        """
        rt = self.rt
        if rt.comm is None:
            raise RuntimeError(f"pipeline deadlock: every stage waits on a message: {self._stuck()}")
        deadline = deadline or time.monotonic() + rt.timeout_s
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rt.rank}: no message for {rt.timeout_s:g} s (train.message_timeout_s) "
                               f"from {self._peers()}; waiting on {self._stuck()}")
        time.sleep(0.0002)
        return deadline

    def _peers(self) -> str:
        """The ranks and islands that the stuck receives wait on, e.g. ``rank 1 (island slow)``."""
        peers = set()
        for k in self.rt.local_keys:
            if self.ptr[k] < len(self.lists[k]) and self.lists[k][self.ptr[k]].is_recv:
                src = (k[0], self.lists[k][self.ptr[k]].peer)
                peers.add((self.rt.owner[src], self.rt.plan.stage(*src).island))
        return ", ".join(f"rank {r} (island {i})" for r, i in sorted(peers)) or "no peer"

    def _stuck(self) -> dict:
        return {k: str(self.lists[k][self.ptr[k]]) for k in self.rt.local_keys if self.ptr[k] < len(self.lists[k])}

    def _ready(self, k: StageKey, a: Action) -> bool:
        """False only for a receive whose message has not arrived (a completed receive from another
        process moves its payload into the mailbox)."""
        if not a.is_recv:
            return True
        m = _incoming(k, a)
        if m in self.mailbox:
            return True
        h = self.recvs.get(m)
        if h is not None and h.test():
            self.mailbox[m] = h.wait()
            return True
        return False

    def _execute(self, k: StageKey, a: Action, nxt: Action | None) -> None:
        """Runs action `a` of stage `k` (`nxt`: the stage's next action) and records its times."""
        t0, bg0 = self.rt._mark()
        if a.kind == ActionKind.F:
            out = self._forward(k, a.microbatch, nxt)
            if out is not _SELF_TIMED:
                self.rt._emulate(k, out, t0, bg0)
        elif a.kind == ActionKind.B:
            self.rt._emulate(k, self._backward(k, a.microbatch), t0, bg0)
        elif a.is_send:
            self._send(k, a)
        else:  # receive: the message is in the mailbox (_ready checked)
            self._receive(k, a)
        self.records.append(ActionRecord(k[1], str(a), t0, time.perf_counter(),
                                         island=self.rt.plan.stage(*k).island, replica=k[0]))

    def _inputs(self, k: StageKey, mb: int) -> StageInputs:
        """Microbatch `mb`'s inputs of stage `k`, placed on the stage's mesh: token ids (first stage)
        or the received activation, positions, and targets and loss mask on the last stage."""
        st, data = self.rt._stages[k], self.rt._microbatch(self.batch, k, mb)
        tokens = data["tokens"]
        x = st.place_tokens(tokens) if st.is_first else self.outbox.pop(("in", k, mb))
        pos = st.place_tokens(np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape))
        if not st.is_last:
            return StageInputs(x, pos)
        return StageInputs(x, pos, st.place_tokens(data["targets"]),
                           st.place_tokens(data["loss_mask"].astype(np.float32)))

    def _forward(self, k: StageKey, mb: int, nxt: Action | None) -> Any:
        """F: the stage's forward on microbatch `mb` (with the backward when it comes next on the last
        stage, see `PipelineRuntime.fuse_last_stage`). Returns what to wait for."""
        st, inputs = self.rt._stages[k], self._inputs(k, mb)
        bucketed = (self.chunked.get(k, False) and nxt is not None and nxt.kind == ActionKind.B
                    and nxt.microbatch == mb and self.n_acc[k] == self.num_b[k] - 1)
        if not self.train:
            out = st.forward(st.params, inputs)
        elif bucketed:
            out = self._bucketed(k, mb, inputs)
        elif (st.is_last and self.rt.fuse_last_stage and nxt is not None and nxt.kind == ActionKind.B
              and nxt.microbatch == mb):
            out = self._forward_backward(k, mb, inputs)
        elif st.recompute:
            out = st.forward(st.params, inputs)
            self.saved[(k, mb)] = inputs
        else:
            out, self.saved[(k, mb)] = st.forward_saving(st.params, inputs)
        if st.is_last:
            self.loss_sums[k].append(out)
        else:
            self.outbox[("out", k, mb)] = out
        if bucketed:
            return _SELF_TIMED  # `_bucketed` waited on (and emulated) each bucket itself
        return out, self.fused.get((k, mb))

    def _bucketed(self, k: StageKey, mb: int, inputs: StageInputs) -> Any:
        """The step's last microbatch of a heterogeneous-DP replica: forward and backward in layer
        buckets, each bucket's gradients handed to the background all-reduce as soon as they are
        final (`hethub_jax.parallel.buckets`). The backward's result waits in `fused` for the B
        action. Returns the summed loss."""
        first = np.bool_(self.n_acc[k] == 0)
        out, acc = self.rt._chunks[k][1].forward_backward(
            inputs, self.acc[k], first, wait=lambda x, m: self.rt._emulate(k, x, *m), mark=self.rt._mark,
            ready=lambda chunk, flat, raw: self.buckets.ready(k, chunk, flat, raw))
        self.fused[(k, mb)] = Backward(acc, None)
        self.acc[k] = acc
        return out

    def _forward_backward(self, k: StageKey, mb: int, inputs: StageInputs) -> Any:
        """Last stage: forward and backward in one jit; the last one applies the update too when the
        step fuses it. The backward's result waits in `fused` for the B action. Returns the loss."""
        st, first = self.rt._stages[k], np.bool_(self.n_acc[k] == 0)
        if self.fuse_update and self.n_acc[k] == self.num_b[k] - 1:  # the last backward, and the update
            out, self.norms[k], st.params, st.opt_state = st.forward_backward_update(
                st.params, st.opt_state, inputs, self.acc[k], first, jnp.float32(self.inv_tokens))
            grads = Backward(None, None)
        else:
            out, grads = st.forward_backward(st.params, inputs, self.acc[k], first)
        self.fused[(k, mb)] = grads
        self.acc[k] = grads.acc  # the donated buffer is replaced at once
        return out

    def _backward(self, k: StageKey, mb: int) -> Any:
        """B: accumulates microbatch `mb`'s parameter gradients and, past the first stage, puts the
        input's gradient in the outbox. Returns what to wait for."""
        st = self.rt._stages[k]
        g = jnp.ones((), jnp.float32) if st.is_last else self.outbox.pop(("gout", k, mb))
        first = np.bool_(self.n_acc[k] == 0)
        if (k, mb) in self.fused:  # computed with the forward
            grads = self.fused.pop((k, mb))
        elif st.recompute:
            grads = st.backward_recompute(st.params, self.saved.pop((k, mb)), g, self.acc[k], first)
        else:
            grads = st.backward_saved(self.saved.pop((k, mb)), g, self.acc[k], first)
        self.acc[k] = grads.acc
        self.n_acc[k] += 1
        if self.buckets is not None and not self.chunked[k] and self.n_acc[k] == self.num_b[k]:
            # a replica not chunked (`chunked_replica`): its whole gradient goes to the same bucket
            # collectives as the chunked replicas', at the end of its backward
            chunks = self.rt._chunks[k][1]
            chunks.hand_over_whole(jax.block_until_ready(self.acc[k]),
                                   lambda chunk, flat, raw: self.buckets.ready(k, chunk, flat, raw))
        if not st.is_first:
            self.outbox[("gin", k, mb)] = grads.dx
        return self.acc[k] if self.acc[k] is not None else self.norms.get(k)

    def _send(self, k: StageKey, a: Action) -> None:
        """SEND_ACT / SEND_GRAD: hands the outbox's activation or input gradient to the runtime."""
        kind, box = ("act", "out") if a.kind == ActionKind.SEND_ACT else ("grad", "gin")
        x = self.outbox.pop((box, k, a.microbatch))
        self.rt._send((kind, k, (k[0], a.peer), a.microbatch), x, self.mailbox, self.pending_sends)

    def _receive(self, k: StageKey, a: Action) -> None:
        """RECV_ACT / RECV_GRAD: places the arrived message on the stage's activation sharding."""
        box = "in" if a.kind == ActionKind.RECV_ACT else "gout"
        x = self.mailbox.pop(_incoming(k, a))
        self.outbox[(box, k, a.microbatch)] = self.rt._place_received(k, x)


def _forward_only(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Forward-only action lists for evaluation: per stage, [RECV_ACT] F [SEND_ACT] per microbatch."""
    out = []
    for s in range(num_stages):
        acts = []
        for mb in range(num_microbatches):
            if s > 0:
                acts.append(Action(ActionKind.RECV_ACT, mb, s - 1))
            acts.append(Action(ActionKind.F, mb))
            if s < num_stages - 1:
                acts.append(Action(ActionKind.SEND_ACT, mb, s + 1))
        out.append(acts)
    return out
