"""Bucketed cross-replica gradient all-reduce overlapped with the backward (heterogeneous DP).

As PyTorch DDP does (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020, section 3.2.3: gradient bucketing, default ``bucket_cap_mb=25`` with a smaller
first bucket), a replica's last backward of the step runs in *layer buckets*, last layers first
(head + last layers, ..., first layers + embedding). As soon as a bucket's gradients are final, a
background thread copies them to the host and all-reduces them over the replicas' group
communicator, while the main thread computes the next bucket's backward. The update waits for every
bucket (`BucketedReduction.join`).

Each bucket is one `chunk`: a contiguous layer range of the stage, instantiated as its own `Llama`
range (same graph as a pipeline stage of those layers) with its own jitted forward (saving the
`jax.vjp` residuals) and backward; the head chunk of the last stage (last layers, norm, LM head and
loss, first in backward order) runs its forward and backward in one jit, so that its residuals (the
`[mb, S, vocab]` logits: most of a small model's activation memory) never leave the program
(measured on `tiny`, one CPU core: the chunked microbatch then costs the same CPU time as the fused
forward+backward, against +20 % with the logits saved between two jits). Only the last microbatch
of the step runs chunked; earlier microbatches run the stage's own functions and accumulate as before.
Which replicas chunk: `hethub_jax.parallel.plan.chunks_last_microbatch` (replicas of two or more
microbatches per step); a replica of one microbatch runs it fused and hands its whole gradient to the
same bucket collectives at the end of its backward (`StageChunks.hand_over_whole`).

Each bucket's all-reduce first waits, sleeping, in a barrier until every replica has the bucket
(``arrive``), and only then polls without sleeping while the data moves: the thread shares the CPU
core of a CPU island with its compute.

The embedding matrix: its gradient is final only after the first layers' backward, and it is most of
a small model's parameters. It is split in two exact parts:
  - *dense part*, reduced with the first bucket: the accumulator of the earlier microbatches plus,
    with tied embeddings, the LM head's contribution of the last microbatch;
  - *sparse part*, reduced last: the embedding lookup's gradient of the last microbatch, which is
    zero outside the rows of the token ids of that microbatch. Every rank holds the global batch, so
    every rank knows the union of those rows over all replicas without communicating; only those
    rows travel. The total is dense + scatter-add(rows, sparse): the same sum in another order
    (float32 rounding only).

Scope: used by `PipelineRuntime` for heterogeneous DP whose replicas are each one stage on one
process, when every replica's last two compute actions are F and B of one microbatch (1F1B);
otherwise the runtime all-reduces after the whole backward, as before.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hethub_jax.models.llama import Llama
from hethub_jax.models.loss import token_cross_entropy
from hethub_jax.parallel.bucket_layout import layer_chunks  # noqa: F401  (the cut, JAX-free; re-exported)
from hethub_jax.parallel.stage import PipelineStage, StageInputs, flat_name

#: Default bucket size, bytes (PyTorch DDP's ``bucket_cap_mb=25``).
DEFAULT_BUCKET_BYTES = 25 * 2**20
#: Default size of the first bucket, bytes (DDP's first bucket, 1 MiB): it starts communicating early.
DEFAULT_FIRST_BUCKET_BYTES = 1 * 2**20


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


class StageChunks:
    """The compiled layer buckets of one `PipelineStage` (a whole-model stage in today's use).

    Attributes:
      chunks: inclusive global layer ranges in backward order (see `layer_chunks`).
      split_embed: True when the embedding gradient is split into a dense and a sparse part (the
        embedding and the head or earlier microbatches sit in different buckets: several chunks).
    """

    def __init__(self, st: PipelineStage, bucket_bytes: int, first_bucket_bytes: int):
        self.st, cfg = st, st.config
        self.num_layers = cfg.num_hidden_layers
        ab = st._abstract_params
        layer_bytes = [_nbytes(ab["layers"][i]) for i in range(st.last_layer - st.first_layer + 1)]
        head = {n: ab[n] for n in ("norm", "lm_head", "embed_tokens") if n in ab}
        self.chunks = layer_chunks(layer_bytes, st.first_layer, _nbytes(head), bucket_bytes, first_bucket_bytes)
        self.split_embed = st.is_first and len(self.chunks) > 1
        self._fwd, self._bwd = {}, {}
        # the last stage's head chunk (last layers, norm, LM head, loss) runs its forward and backward
        # in one jit: its residuals (the [mb, S, vocab] logits) never leave it
        self.head = self.chunks[0] if st.is_last else None
        for a, b in self.chunks:
            gd = nnx.split(nnx.eval_shape(partial(Llama, cfg, first_layer=a, last_layer=b)))[0]
            raw = self.split_embed and a == 0
            if (a, b) == self.head:
                self._fwd_bwd = jax.jit(partial(self._forward_backward, gd, a, b, raw), donate_argnames="acc")
                continue
            self._fwd[(a, b)] = jax.jit(partial(self._vjp, gd, a, b))
            self._bwd[(a, b)] = jax.jit(partial(self._backward, a, b, raw), donate_argnames="acc")
        self.zero_if_first = jax.jit(lambda acc, first: jnp.where(first, jnp.zeros_like(acc), acc))

    # ---- trees ---------------------------------------------------------------------------------
    def part(self, tree: dict, a: int, b: int, *, accumulator: bool = False) -> dict:
        """The sub-tree of a stage tree (params or gradients) that chunk [a, b] holds. With
        ``accumulator`` the embedding is left out of the embedding chunk when `split_embed` (its
        accumulated part travels in the first bucket)."""
        f = self.st.first_layer
        out = {"layers": {i - a: tree["layers"][i - f] for i in range(a, b + 1)}}
        head = b == self.num_layers - 1
        if (a == 0 and not (accumulator and self.split_embed)) or (
                head and self.st.config.tie_word_embeddings):
            out["embed_tokens"] = tree["embed_tokens"]
        if head:
            out["norm"] = tree["norm"]
            if not self.st.config.tie_word_embeddings:
                out["lm_head"] = tree["lm_head"]
        return out

    def merge(self, parts: dict[tuple[int, int], dict], embed: Any) -> dict:
        """A stage tree from the chunks' trees; ``embed`` is used for the embedding when given."""
        f, out = self.st.first_layer, {"layers": {}}
        for (a, b), t in parts.items():
            for i in range(a, b + 1):
                out["layers"][i - f] = t["layers"][i - a]
            out.update({n: v for n, v in t.items() if n != "layers"})
        if embed is not None:
            out["embed_tokens"] = embed
        return out

    def flat(self, tree: dict, a: int) -> dict[str, Any]:
        """Global flat names -> leaves of chunk tree ``tree`` whose first layer is ``a``."""
        return {flat_name(p, a): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}

    # ---- compiled functions --------------------------------------------------------------------
    def _vjp(self, graphdef, a: int, b: int, params: dict, inputs: StageInputs):
        """(chunk output, vjp function): output as `PipelineStage._stage_fn` (hidden or summed loss)."""
        st = self.st

        def fn(p, x):
            out = nnx.merge(graphdef, p)(x, inputs.positions)
            if b < self.num_layers - 1:
                return jax.lax.with_sharding_constraint(out, st.act_sharding)
            return token_cross_entropy(out, inputs.targets, inputs.mask)[0]
        if a == 0:
            return jax.vjp(lambda p: fn(p, inputs.x), params)
        return jax.vjp(fn, params, inputs.x)

    def _backward(self, a: int, b: int, raw_embed: bool, residuals, g, acc: dict, first):
        """-> (acc + this microbatch's parameter gradients, input gradient or None, raw embedding
        gradient or None). ``where`` on the first microbatch: a NaN-filled buffer never leaks."""
        grads = residuals(g)
        gp = dict(grads[0])
        raw = gp.pop("embed_tokens") if raw_embed else None
        new = jax.tree.map(lambda x, y: jnp.where(first, y, x + y), acc, gp)
        shard = self.part(self.st.param_shardings, a, b, accumulator=True)
        new = jax.lax.with_sharding_constraint(new, shard)
        return new, (grads[1] if a > 0 else None), raw

    def _forward_backward(self, graphdef, a: int, b: int, raw_embed: bool, params: dict, inputs: StageInputs,
                          acc: dict, first):
        """The head chunk's forward and backward in one program -> (summed loss f32, acc + its
        parameter gradients, input gradient or None, raw embedding gradient or None)."""
        loss, f = self._vjp(graphdef, a, b, params, inputs)
        return (loss,) + self._backward(a, b, raw_embed, f, jnp.ones((), jnp.float32), acc, first)

    def forward_backward(self, inputs: StageInputs, acc: dict, first, wait: Callable[[Any, Any], None],
                         ready: Callable[[tuple[int, int] | None, dict[str, Any], Any], None],
                         mark: Callable[[], Any] = time.perf_counter):
        """Last microbatch of the step: chunked forward (saving residuals) and backward, last layers
        first. ``wait(x, m)`` blocks on a result (and emulates a slower island), ``m`` being what
        ``mark()`` returned before the computation was dispatched; ``ready(chunk, flat_grads,
        raw_embed)`` hands each bucket's final gradients over as soon as they exist (``chunk`` None:
        the dense embedding part, before the first chunk).
        -> (summed loss f32, the stage's gradient accumulator: a full tree, donated parts replaced)."""
        params, t0 = self.st.params, mark()
        h, saved = inputs.x, []
        for a, b in reversed(self.chunks):
            if (a, b) == self.head:
                break
            x_in = inputs._replace(x=h) if b == self.num_layers - 1 else StageInputs(h, inputs.positions)
            h, res = self._fwd[(a, b)](self.part(params, a, b), x_in)
            saved.append(res)
        if saved:
            wait(h, t0)
        loss, g, parts, embed = h, jnp.ones((), jnp.float32), {}, None
        if self.split_embed and not self.st.config.tie_word_embeddings:
            embed = self.zero_if_first(acc["embed_tokens"], first)  # earlier microbatches' lookups
            ready(None, {"embed_tokens": embed}, None)
        for a, b in self.chunks:
            t, part = mark(), self.part(acc, a, b, accumulator=True)
            if (a, b) == self.head:
                x_in = inputs if a == self.st.first_layer else inputs._replace(x=h)
                loss, parts[(a, b)], g, raw = self._fwd_bwd(self.part(params, a, b), x_in, part, first)
            else:
                parts[(a, b)], g, raw = self._bwd[(a, b)](saved.pop(), g, part, first)
            wait(parts[(a, b)], t)
            if self.split_embed and b == self.num_layers - 1 and "embed_tokens" in parts[(a, b)]:
                embed = parts[(a, b)]["embed_tokens"]  # tied: accumulator + the head's contribution
            ready((a, b), self.flat(parts[(a, b)], a), raw)
        return loss, self.merge(parts, embed)

    def hand_over_whole(self, grads: dict, ready: Callable[[tuple[int, int] | None, dict[str, Any], Any], None]
                        ) -> None:
        """A replica that ran its last microbatch fused (not chunked: `plan.chunks_last_microbatch`)
        hands its whole gradient accumulator ``grads`` (a full stage tree, token sums) to the same
        bucket collectives as a chunked replica, in the same order, at the end of its backward:
        ``ready`` is called exactly as `forward_backward` calls it. With `split_embed` the embedding's
        whole gradient travels as the dense part (first bucket) and its sparse part as `ZeroRows` (the
        last microbatch's lookups are already in the dense part): dense + scatter-add(rows, 0) is the
        same total."""
        embed = grads.get("embed_tokens")
        if self.split_embed and not self.st.config.tie_word_embeddings:
            ready(None, {"embed_tokens": embed}, None)
        for a, b in self.chunks:
            raw = ZeroRows(embed.shape[-1]) if self.split_embed and a == 0 else None
            ready((a, b), self.flat(self.part(grads, a, b, accumulator=True), a), raw)


class ZeroRows:
    """The sparse embedding part of a replica that handed its whole gradient over
    (`StageChunks.hand_over_whole`): zero rows of width ``width`` (the embedding dimension)."""

    def __init__(self, width: int):
        self.width = int(width)


class BucketedReduction:
    """One step's bucket all-reduces, run in order by one background thread.

    Args:
      pool: the runtime's one-thread executor (keeps the order of collectives the same on every rank).
      holders: local stage keys that hold the gradients, in holder order (their copies are summed on
        the host in float32 in this order first, as `PipelineRuntime._reduce_shared` does).
      comm: the replicas' group communicator, or None when every holder is local.
      rows: embedding rows (token ids) of every replica's last microbatch, sorted, for the sparse part.
      arrive: None, or a communicator over the same group whose waits sleep (``with_spin(0)`` of an
        `MPIHostBridge`): each bucket first waits there in a barrier until every replica has it, so
        that the thread spins (``comm.spin_s``) only while the data moves, not while a slower peer
        still computes and this replica's compute needs the same CPU core.
      owners: None (all-reduce: every rank gets every sum), or, under the sharded update (ZeRO-1),
        flat name -> group rank of its owner (``"rows"``: the embedding's): each bucket is then
        reduced to the owners only (`zero.reduce_to_owners`); `join` gives None for the others.
    """

    def __init__(self, pool: ThreadPoolExecutor, holders: list, comm: Any, rows: np.ndarray, arrive: Any = None,
                 owners: Callable[[str], int] | None = None):
        self.pool, self.holders, self.comm, self.rows, self.arrive = pool, list(holders), comm, rows, arrive
        self.owners = owners
        self.pending: dict[Any, dict] = {}
        self.futures: list[Future] = []
        self.jobs: list[tuple[float, float]] = []  # (start, end) perf_counter of each bucket's reduction
        self.backward_end = 0.0
        self.num_buckets = 0

    def ready(self, key: Any, chunk: Any, flat: dict[str, Any], raw: Any) -> None:
        """Stage ``key`` has the final gradients of bucket ``chunk``; once every local holder has
        them, the bucket's reduction is queued."""
        slot = self.pending.setdefault(chunk, {})
        slot[key] = (flat, raw)
        self.backward_end = time.perf_counter()
        if len(slot) < len(self.holders):
            return
        del self.pending[chunk]
        copies = [slot[k] for k in self.holders]
        self.num_buckets += 1
        self.futures.append(self.pool.submit(self._reduce, [c[0] for c in copies], [c[1] for c in copies]))

    def _sum(self, tree: dict) -> dict:
        if self.comm is None:
            return tree
        if self.owners is not None:
            from hethub_jax.parallel.zero import reduce_to_owners
            return reduce_to_owners(self.comm, tree, self.owners)
        return self.comm.allreduce_tree(tree, op="sum")

    def _reduce(self, flats: list[dict], raws: list) -> tuple[dict, Any]:
        t0 = time.perf_counter()
        if len(flats) == 1:  # one local holder: its float32 host copy itself (no summing copies)
            local = {n: np.asarray(v, np.float32) for n, v in flats[0].items()}
        else:
            local = {n: sum(np.asarray(f[n]).astype(np.float32) for f in flats) for n in flats[0]}
        if self.arrive is not None and self.comm is not None:
            self.arrive.barrier()
        total = self._sum(local)
        sparse = None
        if raws[0] is not None:  # the bucket holding layer 0 with a split embedding: on every holder
            width = next(r.width if isinstance(r, ZeroRows) else r.shape[-1] for r in raws)
            part = np.zeros((len(self.rows), width), np.float32)
            for r in raws:  # holder order; a `ZeroRows` adds nothing
                if not isinstance(r, ZeroRows):
                    part = part + np.asarray(r)[self.rows].astype(np.float32)
            sparse = self._sum({"rows": part})["rows"]
        self.jobs.append((t0, time.perf_counter()))
        return total, sparse

    def join(self) -> dict[str, np.ndarray]:
        """Waits for every bucket; returns flat name -> host float32 total over all replicas (None
        for a name reduced to another rank, its owner, with ``owners``).

        Raises:
          whatever a bucket's reduction raised (e.g. the communicator's timeout error).
        """
        totals, sparse = {}, None
        for f in self.futures:
            t, s = f.result()
            totals.update(t)
            sparse = s if s is not None else sparse
        if sparse is not None and totals.get("embed_tokens") is not None:
            emb = np.array(totals["embed_tokens"], np.float32, copy=True)
            np.add.at(emb, self.rows, sparse)  # rows are unique: a plain indexed add
            totals["embed_tokens"] = emb
        return totals

    def stats(self) -> dict[str, float]:
        """num_buckets; reduce_s: time the background thread spent on the buckets (seconds);
        overlapped_s: the part of it before the backward's last bucket was ready."""
        total = sum(e - s for s, e in self.jobs)
        over = sum(max(0.0, min(e, self.backward_end) - s) for s, e in self.jobs)
        return {"num_buckets": self.num_buckets, "reduce_s": total, "overlapped_s": over}
