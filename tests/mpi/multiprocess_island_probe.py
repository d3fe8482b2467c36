"""Spike for issue 15 parts 1-2: a two-stage pipeline between two multi-process CPU islands.

Launch (hydra MPMD, 2 CPU devices per process)::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 mpiexec \
        -n 2 -env HETHUB_ISLAND a python tests/mpi/multiprocess_island_probe.py : \
        -n 2 -env HETHUB_ISLAND b python tests/mpi/multiprocess_island_probe.py

(island "b" may also have 1 process, or 4 with 1 device each, ...). Island "a" is stage 0
(``h = x @ W1``), island "b" stage 1 (``loss = sum((h @ W2 - y)**2) / B``). Each island is one
``jax.distributed`` runtime (``cluster.start``: coordinator, process count and id from the island
communicator, gloo CPU collectives) with a ``Mesh(('dp', 'tp'))`` of all its devices: one DP row
per process, TP inside the process. Every process feeds only its own rows of the global batch
(``jax.make_array_from_process_local_data``). Activations go forward and their gradients backward
over the MPI bridge between *matching processes*: each process sends the rows it holds to the
process(es) of the other island that hold them (``routes``), so stages of different DP degrees
re-slice. The DP gradient all-reduce inside each island is XLA's (the jitted gradient has a
replicated output sharding). Loss and both gradients are checked against float64 numpy on the
unsplit batch (rtol 1e-5). Each rank prints ``PROBE OK rank R island X processes N``.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from hethub_jax import cluster  # noqa: E402  (jax is imported after start)

cluster.install_abort_on_exception()
isl = cluster.start(platform="cpu", timeout=120)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

B, D_IN, D_H, D_OUT = 8, 6, 4, 3
TAG_ACT, TAG_GRAD = 11, 12


def blocks(n_rows: int, n_procs: int) -> list[tuple[int, int]]:
    """Contiguous row range [start, stop) of the global batch held by each process of a stage."""
    if n_rows % n_procs:
        raise ValueError(f"global batch {n_rows} not divisible by {n_procs} processes")
    k = n_rows // n_procs
    return [(p * k, (p + 1) * k) for p in range(n_procs)]


def routes(n_rows: int, n_src: int, n_dst: int) -> list[tuple[int, int, int, int]]:
    """(source process, destination process, start, stop) for every non-empty overlap of the
    source's rows with the destination's: the matching-process exchange of one stage boundary."""
    out = []
    for p, (a0, a1) in enumerate(blocks(n_rows, n_src)):
        for q, (b0, b1) in enumerate(blocks(n_rows, n_dst)):
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                out.append((p, q, lo, hi))
    return out


def island_mesh() -> Mesh:
    """('dp', 'tp') mesh: row i = the devices of island process i (DP across processes)."""
    devs = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    for i, row in enumerate(devs):
        assert {d.process_index for d in row} == {i}, devs
    return Mesh(devs, ("dp", "tp"))


def local_rows(arr: jax.Array, n_rows_local: int) -> np.ndarray:
    """This process's rows of a ('dp', None)-sharded array (its addressable shards, deduplicated)."""
    start = min(s.index[0].start or 0 for s in arr.addressable_shards)
    out = np.empty((n_rows_local,) + arr.shape[1:], arr.dtype)
    for s in arr.addressable_shards:
        r = s.index[0]
        out[(r.start or 0) - start:(r.stop or arr.shape[0]) - start] = np.asarray(s.data)
    return out


def replicated(arr: jax.Array) -> np.ndarray:
    return np.asarray(arr.addressable_data(0))


rng = np.random.default_rng(0)  # same draws on every rank: the unsplit reference data
x = rng.standard_normal((B, D_IN)).astype(np.float32)
y = rng.standard_normal((B, D_OUT)).astype(np.float32)
w1 = (rng.standard_normal((D_IN, D_H)) / 3).astype(np.float32)
w2 = (rng.standard_normal((D_H, D_OUT)) / 3).astype(np.float32)
h_ref = x.astype(np.float64) @ w1
r_ref = h_ref @ w2 - y
loss_ref = (r_ref ** 2).sum() / B
dh_ref = 2 * r_ref @ w2.T / B
dw2_ref = h_ref.T @ (2 * r_ref / B)
dw1_ref = x.T.astype(np.float64) @ dh_ref

others = tuple(r for r in range(isl.world.size) if r not in isl.world_ranks)  # other island
n_self, n_other = isl.size, len(others)
mesh = island_mesh()
rows = NamedSharding(mesh, P("dp", None))
lo, hi = blocks(B, n_self)[isl.rank]
w_tp = NamedSharding(mesh, P(None, "tp"))
every = NamedSharding(mesh, P())


def exchange(block: np.ndarray, n_src: int, n_dst: int, src_ranks, dst_ranks, me_src: bool,
             tag: int) -> np.ndarray | None:
    """Send my rows to the processes of the other stage that hold them; or receive mine."""
    if me_src:
        my0 = blocks(B, n_src)[isl.rank][0]
        reqs = [isl.world.isend(np.ascontiguousarray(block[a - my0:b - my0]), dst_ranks[q], tag)
                for p, q, a, b in routes(B, n_src, n_dst) if p == isl.rank]
        for q in reqs:
            q.wait(60)
        return None
    my0, my1 = blocks(B, n_dst)[isl.rank]
    parts = [isl.world.recv(src_ranks[p], tag, timeout=60)
             for p, q, a, b in routes(B, n_src, n_dst) if q == isl.rank]
    out = np.concatenate(parts)
    assert out.shape[0] == my1 - my0, (out.shape, my0, my1)
    return out


if isl.name == "a":  # stage 0
    xs = jax.make_array_from_process_local_data(rows, x[lo:hi], (B, D_IN))
    W1 = jax.device_put(w1, w_tp)
    fwd = jax.jit(lambda w, a: a @ w, out_shardings=rows)
    h = fwd(W1, xs)
    exchange(local_rows(h, hi - lo), n_self, n_other, None, others, True, TAG_ACT)
    dh = exchange(None, n_other, n_self, others, None, False, TAG_GRAD)
    dhs = jax.make_array_from_process_local_data(rows, dh, (B, D_H))
    bwd = jax.jit(lambda w, a, g: jax.vjp(lambda w_: a @ w_, w)[1](g)[0], out_shardings=every)
    dw1 = replicated(bwd(W1, xs, dhs))  # DP all-reduce across the island's processes (XLA)
    np.testing.assert_allclose(dw1, dw1_ref, rtol=1e-5, atol=1e-6)
else:  # stage 1
    h_mine = exchange(None, n_other, n_self, others, None, False, TAG_ACT)
    np.testing.assert_allclose(h_mine, h_ref[lo:hi], rtol=1e-5, atol=1e-6)
    hs = jax.make_array_from_process_local_data(rows, h_mine, (B, D_H))
    ys = jax.make_array_from_process_local_data(rows, y[lo:hi], (B, D_OUT))
    W2 = jax.device_put(w2, NamedSharding(mesh, P("tp", None)))  # row-parallel (Megatron)

    def loss_fn(w, a, t):
        return ((a @ w - t) ** 2).sum() / B

    step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)),
                   out_shardings=(every, (every, rows)))
    loss, (dw2, dh) = step(W2, hs, ys)
    np.testing.assert_allclose(float(replicated(loss)), loss_ref, rtol=1e-5)
    np.testing.assert_allclose(replicated(dw2), dw2_ref, rtol=1e-5, atol=1e-6)
    dh_mine = local_rows(dh, hi - lo)
    np.testing.assert_allclose(dh_mine, dh_ref[lo:hi], rtol=1e-5, atol=1e-6)
    exchange(dh_mine, n_self, n_other, None, others, True, TAG_GRAD)

isl.world.barrier(timeout=60)
print(f"PROBE OK rank {isl.world.rank} island {isl.name} processes {n_self} "
      f"devices {len(jax.devices())} rows {lo}:{hi}", flush=True)
if n_self > 1:
    jax.distributed.shutdown()
