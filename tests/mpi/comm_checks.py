"""Contract checks every communicator backend must pass, written SPMD-style.

Each check is ``check_x(comm)`` and is called on every rank of a 4-rank communicator (by threads for
LocalCommunicator, by mpiexec ranks for MPIHostBridge). Expected values are rebuilt independently on
the receiving side from the same recipe (never taken from the communicator). A check raises
AssertionError (or anything) on failure.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from hethub_jax.comm.base import CommError, CommTimeoutError

SIZE = 4
MiB = 1 << 20


def u(a: np.ndarray) -> np.ndarray:
    """Unsigned-int view (bit pattern) of an array, for bit-exact comparison."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bits(got, want, what=""):
    got = np.asarray(got)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.array_equal(u(got), u(want)), f"{what}: bit patterns differ"


def expect_comm_error(call, want: str, what: str) -> None:
    """``call()`` must raise CommError whose message contains ``want``."""
    try:
        call()
    except CommError as e:
        assert want in str(e), str(e)
    else:
        raise AssertionError(what)


def special_arrays() -> dict[str, np.ndarray]:
    """Arrays with -0.0, +-inf, NaNs with payloads, subnormals, and every 16-bit pattern."""
    f32 = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.17e-38, 3.4028235e38,
                    -1.5, 2.0**-149], np.float32)
    f32 = np.concatenate([f32, np.array([0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x00000001],
                                        np.uint32).view(np.float32)])
    every16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    return {
        "float32": f32.reshape(3, 5),
        "bfloat16": every16.view(ml_dtypes.bfloat16).reshape(256, 256),  # incl. NaN payloads
        "float16": every16.view(np.float16),
        "float8_e4m3fn": np.arange(256, dtype=np.uint16).astype(np.uint8).view(
            ml_dtypes.float8_e4m3fn),
        "int32": np.array([0, -1, 2**31 - 1, -(2**31), 12345], np.int32),
        "float64": np.array([-0.0, np.inf, 5e-324, np.nan], np.float64),
        "bool": np.array([[True, False], [False, True]]),
        "scalar": np.array(-0.0, np.float32),
        "empty": np.zeros((0, 3), ml_dtypes.bfloat16),
    }


def check_roundtrip_bits(comm):
    """rank 0 -> 1 every special array, and back from 1 -> 0 (both directions, same tag)."""
    arrays = special_arrays()
    if comm.rank == 0:
        for k, a in arrays.items():
            comm.send(a, 1, tag=1)
        for k, a in arrays.items():
            assert_bits(comm.recv(1, tag=1), a, f"echo {k}")
    elif comm.rank == 1:
        got = [comm.recv(0, tag=1) for _ in arrays]
        for (k, a), g in zip(arrays.items(), got):
            assert_bits(g, a, k)
            assert g.flags.c_contiguous
        for g in got:
            comm.send(g, 0, tag=1)


def check_shapes_same_channel(comm):
    """(2,7,64), (3,7,64) then (2,9,64) on one channel, plus several receives posted at once."""
    shapes = [(2, 7, 64), (3, 7, 64), (2, 9, 64)]

    def make(i, s):
        return (np.arange(math.prod(s), dtype=np.float32).reshape(s) + 1000 * i)

    if comm.rank == 2:
        for i, s in enumerate(shapes):
            comm.send(make(i, s), 3, tag=5)
        reqs = [comm.isend(make(i, s), 3, tag=6) for i, s in enumerate(shapes)]
        for r in reqs:
            r.wait()
    elif comm.rank == 3:
        for i, s in enumerate(shapes):
            g = comm.recv(2, tag=5)
            assert g.shape == s and np.array_equal(g, make(i, s)), (i, g.shape)
        reqs = [comm.irecv(2, tag=6) for _ in shapes]
        for i in reversed(range(len(shapes))):  # wait in reverse: matching stays in post order
            g = reqs[i].wait()
            assert g.shape == shapes[i] and np.array_equal(g, make(i, shapes[i])), i


def layouts():
    base = np.arange(6 * 10 * 3, dtype=np.float32).reshape(6, 10, 3) * 0.5 - 7
    bf = base.astype(ml_dtypes.bfloat16)
    return [base.transpose(2, 0, 1), base[::2, 1::3, :], np.asfortranarray(base), base[::-1],
            bf.T, bf[:, ::-2], base.astype(">f4"), base[1, :, 2]]


def check_layouts(comm):
    """Transposed, strided, Fortran, reversed, big-endian inputs arrive as their C-order values."""
    if comm.rank == 1:
        for a in layouts():
            comm.send(a, 2, tag=7)
    elif comm.rank == 2:
        for i, a in enumerate(layouts()):
            want = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("="))
            g = comm.recv(1, tag=7)
            assert g.flags.c_contiguous, i
            assert_bits(g, want, f"layout {i}")


def check_odd_sized_large(comm):
    """An odd-sized ~3.3 MiB bfloat16 message (chunked when chunk_bytes is 1 MiB) bit-exact."""
    n = (3 * MiB + 12345) // 2 * 2 + 1  # odd element count
    if comm.rank in (0, 3):
        bits = np.random.default_rng(77).integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
        want = bits.view(ml_dtypes.bfloat16)
        if comm.rank == 0:
            comm.send(want, 3, tag=8)
            comm.send(want, 3, tag=8)
        else:
            assert_bits(comm.recv(0, tag=8), want, "odd large")
            out = np.full(n, np.nan, ml_dtypes.bfloat16)  # chunked into a preallocated buffer
            assert comm.recv(0, tag=8, out=out) is out
            assert_bits(out, want, "odd large into out=")


def check_ring_16mib(comm):
    """Every rank sends 16 MiB to both neighbours at once and receives both (no deadlock)."""
    n, r = comm.size, comm.rank
    left, right = (r - 1) % n, (r + 1) % n

    def payload(src, direction):  # direction 0: to the right, 1: to the left
        return np.random.default_rng(1000 * src + direction).integers(
            0, 256, 16 * MiB, dtype=np.uint8)

    recv_from_left = comm.irecv(left, tag=9)
    recv_from_right = comm.irecv(right, tag=9)
    sends = [comm.isend(payload(r, 0), right, tag=9), comm.isend(payload(r, 1), left, tag=9)]
    for s in sends:
        s.wait()
    assert np.array_equal(recv_from_left.wait(), payload(left, 0)), "from left"
    assert np.array_equal(recv_from_right.wait(), payload(right, 1)), "from right"
    # the same with blocking sendrecv, both directions
    got = comm.sendrecv(payload(r, 2)[:MiB], right, left, sendtag=10)
    assert np.array_equal(got, payload(left, 2)[:MiB])
    got = comm.sendrecv(payload(r, 3)[:MiB], left, right, sendtag=11)
    assert np.array_equal(got, payload(right, 3)[:MiB])


def check_collectives(comm):
    r, n = comm.rank, comm.size
    x = np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1)
    want = np.arange(12, dtype=np.float32).reshape(3, 4) * sum(range(1, n + 1))
    assert_bits(comm.allreduce(x), want, "allreduce sum f32")
    assert_bits(comm.allreduce(x, "max"), np.arange(12, dtype=np.float32).reshape(3, 4) * n,
                "allreduce max")
    assert_bits(comm.allreduce(np.array([r - 2], np.int32), "min"), np.array([-2], np.int32), "min")
    # bfloat16: reduced in float32, rounded once at the end
    vals = np.array([1.0, 1 / 3, 1e-3], np.float32)
    xb = (vals * (r + 1)).astype(ml_dtypes.bfloat16)
    acc = np.zeros(3, np.float32)
    for k in range(n):
        acc += (vals * (k + 1)).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert_bits(comm.allreduce(xb), acc.astype(ml_dtypes.bfloat16), "allreduce bf16")
    assert_bits(comm.allreduce(np.array([r == 1, False])), np.array([True, False]), "bool or")
    for dt in (np.int8, np.int16, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.float64,
               np.complex64, np.complex128, np.float16):  # every plain dtype reduces (MPI datatype lookup)
        got, want = comm.allreduce(np.array([r + 1, 2 * r], dt)), np.array([n * (n + 1) // 2, n * (n - 1)], dt)
        assert got.dtype == want.dtype and np.array_equal(got, want), (np.dtype(dt).name, got, want)
        if np.dtype(dt).kind != "c":  # MPI_MAX is not defined on complex types
            assert_bits(comm.allreduce(np.array([r], dt), "max"), np.array([n - 1], dt), f"max {np.dtype(dt).name}")
    g = comm.allgather(np.array([r, -r], np.int64))
    assert_bits(g, np.array([[k, -k] for k in range(n)], np.int64), "allgather")
    b = comm.broadcast(np.arange(5, dtype=np.float16) + 0.5 if r == 2 else None, root=2)
    assert_bits(b, np.arange(5, dtype=np.float16) + 0.5, "broadcast")
    b = comm.broadcast(special_arrays()["bfloat16"] if r == 0 else None, root=0)
    assert_bits(b, special_arrays()["bfloat16"], "broadcast bf16 bits")
    comm.barrier()
    try:
        comm.allreduce(np.zeros(3 if r == 1 else 2, np.float32))
    except CommError as e:
        assert "rank 1" in str(e) and "float32[3]" in str(e), str(e)
    else:
        raise AssertionError("allreduce with different shapes did not raise")
    comm.barrier()


# dtypes the all-reduce contract names (base.reduction_dtype): numpy's, and ml_dtypes' floats
RANK_ORDER_DTYPES = ("float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "int8", "int16",
                     "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "complex64",
                     "complex128")


def rank_order_inputs(dtype_name: str, rank: int, n: int = 64) -> np.ndarray:
    """Rank ``rank``'s input for the rank-order checks, rebuilt from a seed on every rank: floats of
    magnitudes 2**-20 .. 2**20 with signs (so the order of a sum changes its rounding), plus -0.0,
    +-inf and NaNs in the first places for the float types."""
    rng = np.random.default_rng(1000 + rank)
    dt = np.dtype(getattr(ml_dtypes, dtype_name, dtype_name))
    if dt == np.bool_:
        return rng.random(n) < 0.3
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)  # sums wrap
    x = rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-20, 20, n)
    if dt.kind == "c":
        x = x + 1j * rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-20, 20, n)
    with np.errstate(over="ignore"):  # float16 / float8: the large magnitudes become inf or NaN
        x = x.astype(dt)
    if rank == 1:
        x[:4] = np.array([-0.0, np.inf, np.nan, -np.inf]).astype(dt)
    return x


def rank_order_reference(xs: list, op: str) -> np.ndarray:
    """numpy's reduction of ``xs`` in rank order, written out here (not base.reduce_arrays): ints
    and float32/64/complex in their own dtype, float16/bfloat16/float8 in float32 rounded once at
    the end, bool sum as logical or (max: or, min: and)."""
    dt = xs[0].dtype
    if dt == np.bool_:
        fn = {"sum": np.logical_or, "max": np.logical_or, "min": np.logical_and}[op]
        acc = xs[0].copy()
        for x in xs[1:]:
            acc = fn(acc, x)
        return acc
    wide = np.float32 if dt.itemsize < 4 and dt.kind not in "iub" else dt
    fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    acc = xs[0].astype(wide)
    for x in xs[1:]:
        acc = fn(acc, x.astype(wide))
    return acc.astype(dt)


def assert_rank_order_allreduce(comm, what: str) -> None:
    """allreduce on ``comm`` gives numpy's rank-ordered reduction, bitwise the same on every rank
    (checked by an all-gather of the result's bytes), for every dtype of RANK_ORDER_DTYPES and op."""
    for name in RANK_ORDER_DTYPES:
        xs = [rank_order_inputs(name, r) for r in range(comm.size)]
        for op in ("sum", "max", "min"):
            if op != "sum" and xs[0].dtype.kind == "c":
                continue  # no order on complex numbers in MPI (MPI_MAX is not defined there)
            got = np.asarray(comm.allreduce(xs[comm.rank], op))
            want = rank_order_reference(xs, op)
            assert got.dtype == want.dtype and got.shape == want.shape, (what, op, name, got.dtype, got.shape)
            bits = np.ascontiguousarray(got).view(np.uint8)  # complex128: 16-byte items
            assert np.array_equal(bits, want.view(np.uint8)), f"{what}: allreduce({op}) {name}: bit patterns differ"
            every = comm.allgather(bits)
            assert all(np.array_equal(every[0], e) for e in every), f"{what}: {op} {name} differs between ranks"


def check_allreduce_rank_order_2(comm):
    """Two ranks (sub-communicators {0, 1} and {2, 3}): numpy's rank-ordered reduction, the same bits
    on both ranks, every contract dtype."""
    sub = comm.split(comm.rank // 2, key=comm.rank)
    assert sub.size == 2
    assert_rank_order_allreduce(sub, "2 ranks")
    # disagreeing arrays make both ranks raise, naming both (a larger, a smaller, another dtype)
    for mine, want in (((np.zeros(3 if sub.rank == 1 else 2, np.float32)), "rank 1: float32[3]"),
                       ((np.zeros(2, np.float32) if sub.rank == 0 else np.zeros(2, ml_dtypes.bfloat16)),
                        "rank 1: bfloat16[2]"),
                       ((np.zeros(2, np.int32) if sub.rank == 0 else np.zeros(2, np.float32)), "rank 0: int32[2]")):
        expect_comm_error(lambda: sub.allreduce(mine), want, f"allreduce with {want} did not raise")
    assert_bits(sub.allreduce(np.array([sub.rank + 1], np.int64)), np.array([3], np.int64), "after errors")
    comm.barrier()


def check_split(comm):
    r = comm.rank
    sub = comm.split(r % 2, key=-r)  # reversed order inside each group
    assert sub.size == 2
    members = [k for k in sorted(range(comm.size), key=lambda k: -k) if k % 2 == r % 2]
    assert sub.rank == members.index(r), (sub.rank, members)
    assert_bits(sub.allreduce(np.array([r], np.int64)), np.array([sum(members)], np.int64), "sub")
    peer = members[1 - sub.rank]
    assert int(sub.sendrecv(np.array(r), 1 - sub.rank, 1 - sub.rank, sendtag=3)) == peer
    none = comm.split(None if r == 3 else 0, key=r)
    if r == 3:
        assert none is None
    else:
        assert none.size == 3 and none.rank == r
        assert int(none.allreduce(np.array(1))) == 3
    comm.barrier()


def check_pytree(comm):
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3),
            "b": [np.array([1, 2], ml_dtypes.bfloat16), np.array(7, np.int32)]}
    if comm.rank == 0:
        comm.send_tree(tree, 1, tag=12)
        comm.send_tree([np.zeros(2)], 1, tag=13)
    elif comm.rank == 1:
        like = {"w": np.zeros((2, 3), np.float32), "b": [0, 0]}
        got = comm.recv_tree(like, 0, tag=12)
        assert_bits(got["w"], tree["w"], "tree w")
        assert_bits(got["b"][0], tree["b"][0], "tree b0")
        assert_bits(got["b"][1], tree["b"][1], "tree b1")
        try:
            comm.recv_tree([0, 0], 0, tag=13)
        except CommError as e:
            assert "leaf" in str(e), str(e)
        else:
            raise AssertionError("pytree leaf-count mismatch not detected")
    red = comm.allreduce_tree({"a": np.ones((2, 2), np.float32) * comm.rank,
                               "c": np.full(3, comm.rank, np.int32),
                               "d": np.ones(2, ml_dtypes.bfloat16)})
    s = sum(range(comm.size))
    assert_bits(red["a"], np.full((2, 2), s, np.float32), "tree allreduce a")
    assert_bits(red["c"], np.full(3, s, np.int32), "tree allreduce c")
    assert_bits(red["d"], np.full(2, comm.size, ml_dtypes.bfloat16), "tree allreduce d")
    comm.barrier()


def check_repeated_channel(comm):
    """The same dtype and shape again and again on one tag (the MPI bridge's fast paths), empty and
    0-d arrays included, each received fresh and into out=; then a transposed (non-contiguous) array
    of the same dtype and shape on that tag, which must arrive as its C-order values."""
    cases = [np.zeros((0,), np.float32), np.array(3.5, np.float32),
             np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3), np.arange(5000, dtype=np.int64)]
    if comm.rank == 1:
        for rep in range(3):
            for i, a in enumerate(cases):
                comm.send(a + rep, 2, tag=40 + i)
                comm.send(a + rep, 2, tag=40 + i)
        for k in range(3):
            comm.send(np.full((4, 4), k, np.float32), 2, tag=45)
        comm.send(np.arange(16, dtype=np.float32).reshape(4, 4).T, 2, tag=45)
    elif comm.rank == 2:
        for rep in range(3):
            for i, a in enumerate(cases):
                want = a + rep
                assert_bits(comm.recv(1, tag=40 + i), want, f"repeat {rep} case {i}")
                out = np.empty_like(want)
                got = comm.recv(1, tag=40 + i, out=out)
                assert_bits(got, want, f"repeat {rep} case {i} into out=")
        out = np.empty((4, 4), np.float32)
        for k in range(3):
            assert comm.recv(1, tag=45, out=out) is out and np.all(out == k)
        assert_bits(comm.recv(1, tag=45, out=out), np.arange(16, dtype=np.float32).reshape(4, 4).T,
                    "transposed after contiguous ones")
    comm.barrier()


def check_same_tag_other_kinds(comm):
    """After float32[4, 4] messages have warmed a tag (the MPI bridge's fast paths, in C where
    built), messages that must not take those paths arrive right or fail with the message named:
    another dtype of the same shape, another shape of the same size, a read-only array, an ndarray
    subclass, a numpy integer as tag; a receive into an out= of another shape or a read-only one."""
    base = np.arange(16, dtype=np.float32).reshape(4, 4)
    sent = [base, base.astype(np.int32), (base + 1).reshape(2, 8), base.reshape(2, 8) + 2,
            base + 3]
    if comm.rank == 3:
        for _ in range(3):  # warm the tag
            comm.send(base, 0, tag=60)
        for a in sent:
            comm.send(a, 0, tag=60)
        ro = base + 4
        ro.flags.writeable = False
        comm.send(ro, 0, tag=60)
        comm.send((base + 5).view(type("Sub", (np.ndarray,), {})), 0, tag=60)
        comm.send(base + 6, 0, tag=np.int64(60))
        comm.send(base + 7, 0, tag=60)
    elif comm.rank == 0:
        out = np.empty((4, 4), np.float32)
        for _ in range(3):
            assert comm.recv(3, tag=60, out=out) is out and np.array_equal(out, base)
        assert_bits(comm.recv(3, tag=60, out=np.empty((4, 4), np.float32)), base, "new out=")
        for want in ("int32[4, 4]", "float32[2, 8]"):  # out= of the warmed kind: a mismatch
            expect_comm_error(lambda: comm.recv(3, tag=60, out=out), want,
                              f"out= float32[4, 4] accepted a message {want}")
        o28 = np.empty((2, 8), np.float32)  # an out= of the message's shape works
        assert comm.recv(3, tag=60, out=o28) is o28 and np.array_equal(o28, base.reshape(2, 8) + 2)
        expect_comm_error(lambda: comm.recv(3, tag=60, out=o28), "float32[4, 4]",  # same size
                          "out= float32[2, 8] accepted a message float32[4, 4]")
        for k in (4, 5, 6):
            assert_bits(comm.recv(3, tag=60, out=out), base + k, f"message {k}")
        ro = np.empty((4, 4), np.float32)
        ro.flags.writeable = False
        expect_comm_error(lambda: comm.recv(3, tag=60, out=ro), "writeable",
                          "a read-only out= was accepted")
    comm.barrier()


def check_timeout_and_errors(comm):
    r = comm.rank
    if r == 1:
        try:
            comm.recv(0, tag=99, timeout=0.3)
        except CommTimeoutError as e:
            assert isinstance(e, TimeoutError)
            assert "rank 0" in str(e) and "tag 99" in str(e), str(e)
        else:
            raise AssertionError("recv without a sender did not time out")
    for bad in (lambda: comm.send(np.zeros(1), comm.size, tag=0),
                lambda: comm.send(np.zeros(1), 0, tag=-1),
                lambda: comm.irecv(0, tag=comm.max_tag + 1)):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("bad rank/tag accepted")
    try:
        comm.send(np.array(["a"], object), (r + 1) % comm.size, tag=0)
    except TypeError:
        pass
    else:
        raise AssertionError("object array accepted")
    # out= receives: right buffer filled in place, wrong one raises and the channel stays usable
    if r == 2:
        comm.send(np.arange(4, dtype=np.int16), 0, tag=14)
        comm.send(np.arange(4, dtype=np.int16) + 10, 0, tag=14)  # the same header again
        comm.send(np.arange(5, dtype=np.int16), 0, tag=14)
        comm.send(np.arange(3, dtype=np.int16), 0, tag=14)   # smaller than out=
        comm.send(np.arange(4, dtype=np.uint16), 0, tag=14)  # same size, other dtype
        comm.send(np.arange(3, dtype=np.int16), 0, tag=14)
        comm.send(np.arange(4, dtype=np.int16) + 20, 0, tag=14)
    elif r == 0:
        buf = np.zeros(4, np.int16)
        assert comm.recv(2, tag=14, out=buf) is buf and np.array_equal(buf, np.arange(4))
        assert comm.recv(2, tag=14, out=buf) is buf and np.array_equal(buf, np.arange(4) + 10)
        for want in ("int16[5]", "int16[3]", "uint16[4]"):
            expect_comm_error(lambda: comm.recv(2, tag=14, out=buf), want,
                              f"out= int16[4] accepted a message {want}")
        assert np.array_equal(comm.recv(2, tag=14), np.arange(3))
        assert comm.recv(2, tag=14, out=buf) is buf and np.array_equal(buf, np.arange(4) + 20)
    comm.barrier()


def check_jax_arrays(comm):
    """JAX arrays in; device= and sharding= placement out."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    bf = special_arrays()["bfloat16"]
    if comm.rank == 3:
        comm.send(jnp.asarray(bf), 0, tag=15)
        comm.send(jnp.arange(8, dtype=jnp.float32).reshape(4, 2), 0, tag=15)
    elif comm.rank == 0:
        dev = jax.devices()[-1]
        g = comm.recv(3, tag=15, device=dev)
        assert isinstance(g, jax.Array) and g.devices() == {dev}
        assert_bits(np.asarray(g), bf, "jax bf16")
        mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
        sh = NamedSharding(mesh, P("dp"))
        g = comm.recv(3, tag=15, sharding=sh)
        assert g.sharding == sh and np.array_equal(np.asarray(g), np.arange(8).reshape(4, 2))
    comm.barrier()


CHECKS = {name[len("check_"):]: fn for name, fn in sorted(globals().items())
          if name.startswith("check_") and callable(fn)}
