"""The communicator contract shared by every backend.

A communicator connects ``size`` ranks numbered ``0 .. size-1``. Point-to-point messages are
addressed by (peer rank, tag); messages on one channel (same sender, receiver and tag) arrive in the
order they were sent, and receives posted on one channel are matched in the order they were posted.
Every message carries a :class:`Header` (dtype name, shape, tag, byte count) so the receiver never
has to know the shape in advance.

Arrays in may be numpy arrays, JAX arrays (fetched to host with ``np.asarray``) or anything
``np.asarray`` accepts. Arrays out are C-contiguous numpy arrays unless ``device`` or ``sharding`` is
given, in which case they are placed with ``jax.device_put``. jax is imported lazily, so importing
this package does not import jax (islands must set ``JAX_PLATFORMS`` first, see ``hethub_jax.cluster``).

Collectives are called by every rank of the communicator in the same order. ``split`` makes
sub-communicators (island, cross-island data-parallel group, pipeline neighbours).

Deadlines: every blocking call takes ``timeout`` in seconds (``None``: the communicator's default,
``math.inf``: wait forever) and raises :class:`CommTimeoutError` when it passes. After a timeout the
communicator is in an undefined state (the peer may still deliver); the job should end, which
``hethub_jax.cluster.install_abort_on_exception`` arranges.
"""

from __future__ import annotations

import abc
import math
import os
import struct
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import ml_dtypes
import numpy as np

__all__ = [
    "CommError", "CommTimeoutError", "Header", "Request", "Communicator", "REDUCE_OPS",
    "as_host_array", "dtype_from_name", "place", "reduction_dtype",
]

REDUCE_OPS = ("sum", "max", "min")

# Wire format of a header (little-endian): magic, tag, nbytes, chunk_bytes, part, parts, ndim,
# dtype-name length, then the dtype name (ASCII) and ndim int64 extents. Always < HEADER_MAX bytes.
_MAGIC = b"HJC1"
_FIXED = struct.Struct("<4sqQQIIHH")
HEADER_MAX = 512
MAX_NDIM = 48
_MAX_DTYPE_NAME = 32


class CommError(RuntimeError):
    """A communication failed (bad header, peers disagreeing on a collective, ...)."""


class CommTimeoutError(CommError, TimeoutError):
    """A blocking communication did not complete before its deadline."""


_BY_NAME: dict[str, np.dtype] = {}
_NAME_OF: dict[np.dtype, str] = {}  # validated dtypes -> wire name


def dtype_from_name(name: str) -> np.dtype:
    """numpy dtype for a header's dtype name; ml_dtypes names (bfloat16, float8_e4m3fn, ...) too.

    Raises:
      CommError: the name is neither a numpy nor an ml_dtypes type.
    """
    d = _BY_NAME.get(name)
    if d is not None:
        return d
    try:
        d = np.dtype(name)
    except TypeError:
        t = getattr(ml_dtypes, name, None)
        if t is None:
            raise CommError(f"unknown dtype name {name!r} in message header") from None
        d = np.dtype(t)
    _BY_NAME[name] = d
    return d


def dtype_name(dtype: np.dtype) -> str:
    """Wire name of a sendable dtype (cached). Raises TypeError for unsupported dtypes."""
    name = _NAME_OF.get(dtype)
    if name is None:
        _check_dtype(dtype)
        name = _NAME_OF[dtype] = dtype.name
    return name


def _check_dtype(dtype: np.dtype) -> None:
    ml = getattr(ml_dtypes, dtype.name, None)
    if not (dtype.kind in "biufc" and dtype.fields is None and dtype.subdtype is None
            or ml is not None and np.dtype(ml) == dtype):
        raise TypeError(f"cannot send arrays of dtype {dtype}: only plain numeric, bool and "
                        "ml_dtypes arrays travel as raw bytes")
    if dtype_from_name(dtype.name) != dtype:
        raise TypeError(f"dtype {dtype} does not round-trip through its name {dtype.name!r}")


def as_host_array(x: Any) -> np.ndarray:
    """Host, C-contiguous, native-byte-order numpy view (or copy) of ``x``.

    JAX arrays are fetched with ``np.asarray`` (a device-to-host copy); contiguous numpy arrays are
    returned without a copy; transposed, strided or Fortran-order arrays are copied to C order.

    Raises:
      TypeError: unsupported dtype (object, string, structured) or a JAX array that is not fully
        addressable from this process (a multi-process sharded array).
    """
    if type(x) is np.ndarray and x.flags.c_contiguous and x.dtype in _NAME_OF:
        return x  # fast path: already a sendable host buffer (validated dtypes are native)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            raise TypeError("cannot send a JAX array that is not fully addressable from this process "
                            f"(sharding {x.sharding}); send each process's addressable shards instead")
        x = np.asarray(x)
    arr = np.asarray(x)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    dtype_name(arr.dtype)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")  # keeps 0-d arrays 0-d


def place(arr: np.ndarray, device: Any = None, sharding: Any = None) -> Any:
    """Return ``arr`` as is, or ``jax.device_put`` onto ``device`` or ``sharding``.

    Raises:
      ValueError: both ``device`` and ``sharding`` are given.
    """
    if device is not None and sharding is not None:
        raise ValueError("give at most one of device= and sharding=")
    target = device if device is not None else sharding
    if target is None:
        return arr
    import jax

    return jax.device_put(arr, target)


def reduction_dtype(dtype: np.dtype) -> np.dtype:
    """dtype in which a reduction of ``dtype`` is computed.

    float16, bfloat16 and the other ml_dtypes floats (float8, float4, ...) reduce in float32 and are
    cast back (round to nearest even) afterwards; ml_dtypes integers (int4, ...) and bool reduce in
    int32 (bool sum is then logical or); other dtypes reduce in themselves.
    """
    if dtype == np.bool_:
        return np.dtype(np.int32)
    if dtype == np.float16:
        return np.dtype(np.float32)
    if getattr(ml_dtypes, dtype.name, None) is not None:
        try:
            ml_dtypes.finfo(dtype)
            return np.dtype(np.float32)
        except ValueError:
            return np.dtype(np.int32)
    return dtype


def widen(a: np.ndarray) -> np.ndarray:
    """``a`` in ``reduction_dtype(a.dtype)`` (exact: every float16 / bfloat16 / float8 value is a
    float32); ``a`` itself when that is its own dtype."""
    return a.astype(reduction_dtype(a.dtype), copy=False)


def reduce_arrays(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    """Reduction in rank order: ``((a_0 op a_1) op a_2) ...`` elementwise in
    ``reduction_dtype(a_0.dtype)``, cast back once at the end (bool: nonzero, so a sum is logical or).

    The in-process backend's collectives and the MPI bridge's exchange all-reduce use it, so every
    rank computes bitwise the same result. ``max`` / ``min`` are numpy's ``maximum`` / ``minimum``
    (a NaN wins). The inputs are not modified; the result is a new array.

    Args:
      arrays: one or more arrays of one dtype and shape, in rank order.
      op: "sum", "max" or "min".

    Raises:
      ValueError: unknown op.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    dtype = arrays[0].dtype
    red = reduction_dtype(dtype)
    fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    if len(arrays) == 1:
        acc = arrays[0].astype(red, copy=True)
    else:  # the first two into a new array: no copy of a_0 first (one pass fewer over the data)
        acc = fn(widen(arrays[0]), widen(arrays[1]), out=np.empty(arrays[0].shape, red))  # out=: 0-d too
        for a in arrays[2:]:
            fn(acc, widen(a), out=acc)
    if red == dtype:
        return acc
    return acc != 0 if dtype == np.bool_ else acc.astype(dtype)


_SHAPES = [struct.Struct(f"<{n}q") for n in range(MAX_NDIM + 1)]
_NAME_BYTES: dict[str, bytes] = {}


def encode_header(arr: np.ndarray, tag: int, chunk_bytes: int = 0, part: int = 0,
                  parts: int = 1) -> bytes:
    """Wire header of ``arr`` (C-contiguous, sendable dtype), without building a Header."""
    ndim = arr.ndim
    if ndim > MAX_NDIM:
        raise ValueError(f"arrays of at most {MAX_NDIM} dimensions can be sent, got {ndim}")
    name = dtype_name(arr.dtype)
    nb = _NAME_BYTES.get(name)
    if nb is None:
        nb = _NAME_BYTES[name] = name.encode("ascii")
        if len(nb) > _MAX_DTYPE_NAME:
            raise ValueError(f"dtype name too long for a header: {name!r}")
    return (_FIXED.pack(_MAGIC, tag, arr.nbytes, chunk_bytes, part, parts, ndim, len(nb)) + nb
            + _SHAPES[ndim].pack(*arr.shape))


class Header(NamedTuple):
    """What precedes every message.

    Attributes:
      dtype: numpy / ml_dtypes dtype name (``"bfloat16"``, ``"float32"``, ...).
      shape: array extents (ndim <= 48).
      tag: user tag (>= 0) or an internal negative tag.
      nbytes: payload size in bytes (= prod(shape) * itemsize).
      chunk_bytes: the sender's chunk size in bytes (payload travels in ceil(nbytes/chunk_bytes) parts).
      part, parts: position of this array in a multi-array message (pytree): part of parts.
    """

    dtype: str
    shape: tuple
    tag: int
    nbytes: int
    chunk_bytes: int = 0
    part: int = 0
    parts: int = 1

    @classmethod
    def for_array(cls, arr: np.ndarray, tag: int, chunk_bytes: int = 0, part: int = 0,
                  parts: int = 1) -> "Header":
        if arr.ndim > MAX_NDIM:
            raise ValueError(f"arrays of at most {MAX_NDIM} dimensions can be sent, got {arr.ndim}")
        return cls(dtype_name(arr.dtype), tuple(int(s) for s in arr.shape), int(tag), int(arr.nbytes),
                   int(chunk_bytes), part, parts)

    def encode(self) -> bytes:
        """Wire format (see module comment); at most HEADER_MAX bytes."""
        name = self.dtype.encode("ascii")
        if len(name) > _MAX_DTYPE_NAME:
            raise ValueError(f"dtype name too long for a header: {self.dtype!r}")
        out = _FIXED.pack(_MAGIC, self.tag, self.nbytes, self.chunk_bytes, self.part, self.parts,
                          len(self.shape), len(name))
        return out + name + _SHAPES[len(self.shape)].pack(*self.shape)

    @classmethod
    def decode(cls, buf: bytes | memoryview | np.ndarray) -> "Header":
        """Parse a header from a buffer; trailing bytes (padding) are ignored.

        Raises:
          CommError: not a header (bad magic, too short) or inconsistent fields.
        """
        try:
            magic, tag, nbytes, chunk, part, parts, ndim, nlen = _FIXED.unpack_from(buf)
            o = _FIXED.size
            name = bytes(buf[o:o + nlen]).decode("ascii")
            shape = _SHAPES[ndim].unpack_from(buf, o + nlen)
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise CommError(f"malformed message header: {e}") from None
        if magic != _MAGIC:
            raise CommError(f"bad message header magic {magic!r}: peer is not speaking this protocol")
        if math.prod(shape) * dtype_from_name(name).itemsize != nbytes:
            raise CommError(f"inconsistent header: shape {shape} dtype {name} but {nbytes} bytes")
        return cls(name, shape, tag, nbytes, chunk, part, parts)

    def empty(self, out: np.ndarray | None = None) -> np.ndarray:
        """An uninitialised C-contiguous array this header describes, or ``out`` after checking it.

        Raises:
          CommError: ``out`` has another dtype or shape, or is not C-contiguous and writeable.
        """
        dtype = dtype_from_name(self.dtype)
        if out is None:
            return np.empty(self.shape, dtype=dtype)
        if (not isinstance(out, np.ndarray) or out.dtype != dtype or out.shape != self.shape
                or not out.flags.c_contiguous or not out.flags.writeable):
            got = (f"{out.dtype.name}{list(out.shape)}" if isinstance(out, np.ndarray)
                   else type(out).__name__)
            raise CommError(f"out= buffer {got} cannot hold message {self.describe()} (tag "
                            f"{self.tag}): need a writeable C-contiguous numpy array of that "
                            "dtype and shape")
        return out

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


class Request(abc.ABC):
    """Handle of a non-blocking operation.

    ``wait`` returns the received array (receives) or ``None`` (sends); ``test`` makes progress and
    says whether ``wait`` would return immediately.
    """

    @abc.abstractmethod
    def test(self) -> bool:
        """Make progress; True when complete. Never blocks."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete or the deadline (seconds; None: the communicator default).

        Raises:
          CommTimeoutError: the deadline passed; names the peer and tag.
        """

    def cancel(self) -> None:
        """Withdraw a receive whose message has not started to arrive (no-op otherwise)."""


class DoneRequest(Request):
    """A request that is already complete."""

    def __init__(self, value: Any = None):
        self._value = value

    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> Any:
        return self._value


def check_tag(tag: int, max_tag: int) -> int:
    if not isinstance(tag, (int, np.integer)) or not 0 <= int(tag) <= max_tag:
        raise ValueError(f"tag must be an int in [0, {max_tag}], got {tag!r}")
    return int(tag)


def poll_until(done: Callable[[], bool], deadline: float, describe: Callable[[], str],
               spin_s: float = 0.05, max_sleep_s: float = 0.001,
               every: Callable[[], Any] | None = None) -> None:
    """Call ``done()`` until it is True; raise CommTimeoutError at ``deadline`` (time.monotonic).

    ``done`` should be cheap (it runs back to back while a transfer is in flight: in MPI, each
    test also drives the copy); ``every()``, if given, runs every 16 polls (e.g. other progress).

    For ``spin_s`` seconds it polls back to back (checking the clock every 16 polls and, after the
    first ``_NO_YIELD_S`` seconds, yielding the CPU with ``sched_yield`` every 256 so
    oversubscribed ranks still run), then sleeps between bursts of 16 polls with a back-off growing
    from 10 us to ``max_sleep_s`` seconds. No yield at first: a yield is a system call of about a
    microsecond, and a 1 MiB message between two running ranks completes in under 0.2 ms.

    Raises:
      CommTimeoutError: with ``describe()`` in the message.
    """
    if done():
        return
    start = time.monotonic()
    spin_end = start + spin_s
    yield_from = start + _NO_YIELD_S
    sleep = 1e-5
    n = 0
    while not done():
        n += 1
        if n & 15:
            continue
        if every is not None:
            every()
        now = time.monotonic()
        if now >= deadline:
            raise CommTimeoutError(f"{describe()} did not complete within "
                                   f"{now - start:.3g} s (deadline)")
        if now < spin_end:
            if not n & 255 and now > yield_from:
                _yield()
        else:
            time.sleep(sleep)
            sleep = min(sleep * 2, max_sleep_s)


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_NO_YIELD_S = 2e-4  # seconds of polling before poll_until starts yielding the CPU


class Communicator(abc.ABC):
    """Abstract communicator: point-to-point messages and collectives among ``size`` ranks.

    Subclasses set ``_rank``, ``_size``, ``_timeout`` and implement ``isend``, ``irecv`` and ``split``;
    the collectives here are reference implementations on top of point-to-point messages (rank 0
    gathers, reduces in rank order, and sends back) that backends may override.
    """

    #: largest user tag accepted.
    max_tag: int = 2**20

    # ---- identity (backends set _rank, _size and _timeout in __init__) ------------------------
    _rank: int
    _size: int
    _timeout: float

    @property
    def rank(self) -> int:
        """This rank, 0 <= rank < size."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._size

    @property
    def timeout(self) -> float:
        """Default deadline of blocking calls, seconds."""
        return self._timeout

    def _deadline(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else timeout
        return time.monotonic() + t if math.isfinite(t) else math.inf

    def _check_peer(self, peer: int, what: str) -> int:
        if not isinstance(peer, (int, np.integer)) or not 0 <= int(peer) < self.size:
            raise ValueError(f"{what} must be a rank in [0, {self.size}), got {peer!r}")
        if int(peer) == self.rank and what != "root":
            pass  # self-messages are allowed (they match like any other channel)
        return int(peer)

    # ---- point-to-point ---------------------------------------------------------------------
    def isend(self, x: Any, dest: int, tag: int = 0) -> Request:
        """Start sending array ``x`` (any shape; dtype numeric, bool or ml_dtypes) to ``dest``.

        The array's current value is what is sent: host buffers are kept alive (and must not be
        modified) until the request completes. ``wait()`` returns None.

        Raises:
          ValueError: bad ``dest`` or ``tag`` (tags are ints in [0, max_tag]).
          TypeError: unsupported dtype.
        """
        return self._isend_part(x, dest, check_tag(tag, self.max_tag), 0, 1)

    def irecv(self, source: int, tag: int = 0, *, device: Any = None, sharding: Any = None,
              out: np.ndarray | None = None) -> Request:
        """Start receiving the next message from ``source`` on ``tag``.

        ``wait()`` returns a C-contiguous numpy array with the sender's dtype and shape, or a JAX
        array placed on ``device`` / ``sharding`` when one is given. With ``out`` (a writeable
        C-contiguous numpy array of the message's dtype and shape) the payload lands in ``out``
        and no buffer is allocated; ``wait()`` raises CommError if the message does not fit it
        (the message is consumed all the same).

        Raises:
          ValueError: bad ``source`` or ``tag``, or both ``device`` and ``sharding`` given.
        """
        if device is not None and sharding is not None:
            raise ValueError("give at most one of device= and sharding=")
        return self._post(source, check_tag(tag, self.max_tag), False, device, sharding, out)

    def send(self, x: Any, dest: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Blocking send (``isend(...).wait(timeout)``). May block until the receiver receives.

        Raises:
          CommTimeoutError: not complete within ``timeout`` seconds.
        """
        self.isend(x, dest, tag).wait(timeout)

    def recv(self, source: int, tag: int = 0, *, device: Any = None, sharding: Any = None,
             out: np.ndarray | None = None, timeout: float | None = None) -> Any:
        """Blocking receive; returns the array (see ``irecv``).

        Raises:
          CommTimeoutError: nothing arrived within ``timeout`` seconds.
          CommError: the message does not fit ``out``.
        """
        return self.irecv(source, tag, device=device, sharding=sharding, out=out).wait(timeout)

    def sendrecv(self, x: Any, dest: int, source: int, sendtag: int = 0, recvtag: int | None = None,
                 *, device: Any = None, sharding: Any = None, timeout: float | None = None) -> Any:
        """Send ``x`` to ``dest`` and receive from ``source`` at the same time (no deadlock in rings).

        Returns the received array. Raises CommTimeoutError after ``timeout`` seconds.
        """
        recvtag = sendtag if recvtag is None else recvtag
        deadline = self._deadline(timeout)
        r = self.irecv(source, recvtag, device=device, sharding=sharding)
        s = self.isend(x, dest, sendtag)
        s.wait(max(deadline - time.monotonic(), 0.0))
        return r.wait(max(deadline - time.monotonic(), 0.0))

    # ---- pytrees ----------------------------------------------------------------------------
    def isend_tree(self, tree: Any, dest: int, tag: int = 0) -> Request:
        """Send the leaves of a pytree (list/tuple/dict/... of arrays) as a sequence of messages.

        The receiver gives the structure (``like``); each header carries ``part``/``parts`` so a
        leaf-count mismatch is detected. Uses ``jax.tree_util`` (imports jax).
        """
        import jax

        leaves = jax.tree_util.tree_leaves(tree)
        reqs = [self._isend_part(leaf, dest, tag, i, len(leaves)) for i, leaf in enumerate(leaves)]
        return _AllRequest(reqs, lambda values: None)

    def irecv_tree(self, like: Any, source: int, tag: int = 0, *, device: Any = None,
                   sharding: Any = None) -> Request:
        """Receive a pytree with the structure of ``like`` (its leaves are only counted).

        If ``like``'s leaves have ``shape``/``dtype`` they are checked against the headers.
        ``wait()`` returns the tree of received arrays; raises CommError on a structure mismatch.
        """
        import jax

        leaves, treedef = jax.tree_util.tree_flatten(like)
        n = len(leaves)
        reqs = [self._irecv_part(source, tag, i, n, leaves[i], device, sharding) for i in range(n)]
        return _AllRequest(reqs, lambda values: jax.tree_util.tree_unflatten(treedef, values))

    def send_tree(self, tree: Any, dest: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Blocking ``isend_tree``."""
        self.isend_tree(tree, dest, tag).wait(timeout)

    def recv_tree(self, like: Any, source: int, tag: int = 0, *, device: Any = None,
                  sharding: Any = None, timeout: float | None = None) -> Any:
        """Blocking ``irecv_tree``."""
        return self.irecv_tree(like, source, tag, device=device, sharding=sharding).wait(timeout)

    @abc.abstractmethod
    def _isend_part(self, x: Any, dest: int, tag: int, part: int, parts: int) -> Request:
        """isend with the header's part/parts set."""

    @abc.abstractmethod
    def _post(self, source: int, tag: int, raw: bool, device: Any = None, sharding: Any = None,
              out: np.ndarray | None = None) -> Request:
        """Posts a receive of the next message from ``source`` on ``tag`` (already checked); with
        ``raw`` its wait returns (Header, numpy array), else the array placed as ``irecv`` says."""

    def _irecv_raw(self, source: int, tag: int) -> Request:
        """irecv whose wait returns (Header, numpy array)."""
        return self._post(source, tag, True)

    def _irecv_part(self, source, tag, part, parts, like_leaf, device, sharding) -> Request:
        raw = self._irecv_raw(source, tag)

        def finish(values):
            h, arr = values[0]
            if (h.part, h.parts) != (part, parts):
                raise CommError(f"pytree mismatch on tag {tag} from rank {source}: expected leaf "
                                f"{part} of {parts}, got leaf {h.part} of {h.parts}")
            shape, dtype = getattr(like_leaf, "shape", None), getattr(like_leaf, "dtype", None)
            if shape is not None and tuple(shape) != arr.shape or (
                    dtype is not None and np.dtype(dtype) != arr.dtype):
                raise CommError(f"pytree leaf {part} from rank {source} (tag {tag}) is "
                                f"{h.describe()}, expected {np.dtype(dtype).name}{list(shape)}")
            return place(arr, device, sharding)

        return _AllRequest([raw], finish)

    def allreduce_tree(self, tree: Any, op: str = "sum", *, timeout: float | None = None) -> Any:
        """All-reduce every leaf of a pytree; leaves of one dtype travel as one flat buffer.

        Returns a pytree of numpy arrays of the same structure, shapes and dtypes.
        """
        import jax

        leaves, treedef = jax.tree_util.tree_flatten(tree)
        host = [as_host_array(x) for x in leaves]
        out: list[np.ndarray | None] = [None] * len(host)
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, a in enumerate(host):
            by_dtype.setdefault(a.dtype, []).append(i)
        for dtype in sorted(by_dtype, key=lambda d: d.name):
            idx = by_dtype[dtype]
            # one leaf of this dtype: its own memory (a view, no copy); several: one buffer
            flat = host[idx[0]].reshape(-1) if len(idx) == 1 else np.concatenate([host[i].reshape(-1) for i in idx])
            red = self.allreduce(flat, op, timeout=timeout)
            off = 0
            for i in idx:
                n = host[i].size
                out[i] = red[off:off + n].reshape(host[i].shape)
                off += n
        return jax.tree_util.tree_unflatten(treedef, out)

    # ---- collectives (reference implementations over point-to-point) ---------------------------
    _COLL_TAG = -1  # internal tag of the reference collectives

    def _coll_gather(self, x: np.ndarray, deadline: float, what: str) -> list[np.ndarray] | None:
        """Rank 0 receives every rank's array (rank order); others send theirs. Checks headers."""
        if self.rank != 0:
            self._isend_part(x, 0, self._COLL_TAG, 0, 1).wait(max(deadline - time.monotonic(), 0))
            return None
        parts = [x]
        for r in range(1, self.size):
            h, arr = self._irecv_raw(r, self._COLL_TAG).wait(max(deadline - time.monotonic(), 0))
            parts.append(arr)
        return parts

    def _coll_bcast(self, x: np.ndarray | None, deadline: float) -> np.ndarray:
        """Rank 0 sends ``x`` to all; returns it everywhere."""
        if self.rank == 0:
            reqs = [self._isend_part(x, r, self._COLL_TAG, 0, 1) for r in range(1, self.size)]
            for q in reqs:
                q.wait(max(deadline - time.monotonic(), 0))
            return x
        return self._irecv_raw(0, self._COLL_TAG).wait(max(deadline - time.monotonic(), 0))[1]

    def _coll(self, x: Any, what: str, combine: Callable[[list[np.ndarray]], np.ndarray],
              timeout: float | None) -> np.ndarray:
        """Gather to rank 0, combine there (or raise the same error on every rank), broadcast.

        Errors found on rank 0 travel as a uint8 message with a negative first byte pattern so
        every rank raises CommError with the same text.
        """
        deadline = self._deadline(timeout)
        arr = as_host_array(x)
        parts = self._coll_gather(arr, deadline, what)
        if parts is not None:
            try:
                result = combine(parts)
                status = np.zeros(1, np.uint8)
                payload = result
            except CommError as e:
                status = np.ones(1, np.uint8)
                payload = np.frombuffer(str(e).encode(), np.uint8)
            self._coll_bcast(status, deadline)
            self._coll_bcast(payload, deadline)
            if status[0]:
                self._raise(payload)
            return payload
        status = self._coll_bcast(None, deadline)
        payload = self._coll_bcast(None, deadline)
        if status[0]:
            self._raise(payload)
        return payload

    @staticmethod
    def _raise(payload: np.ndarray):
        raise CommError(bytes(payload).decode())

    @staticmethod
    def _same_headers(parts: list[np.ndarray], what: str) -> None:
        first = parts[0]
        if any(p.shape != first.shape or p.dtype != first.dtype for p in parts):
            desc = ", ".join(f"rank {r}: {p.dtype.name}{list(p.shape)}" for r, p in enumerate(parts))
            raise CommError(f"{what}: ranks disagree on dtype/shape ({desc})")

    def allreduce(self, x: Any, op: str = "sum", *, timeout: float | None = None,
                  device: Any = None, sharding: Any = None) -> Any:
        """All-reduce ``x`` (same dtype and shape on every rank) with ``op`` in "sum", "max", "min".

        float16/bfloat16/float8 reduce in float32 and are cast back; bool sum is logical or.
        Returns an array of x's dtype and shape (numpy unless device/sharding is given).

        Raises:
          ValueError: unknown op.
          CommError: ranks passed different dtypes or shapes (raised on every rank).
          CommTimeoutError: not complete within ``timeout`` seconds.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")

        def combine(parts):
            self._same_headers(parts, f"allreduce({op})")
            return reduce_arrays(parts, op)

        return place(self._coll(x, "allreduce", combine, timeout), device, sharding)

    def broadcast(self, x: Any, root: int = 0, *, timeout: float | None = None,
                  device: Any = None, sharding: Any = None) -> Any:
        """Return root's ``x`` on every rank (``x`` is ignored and may be None on other ranks).

        On root the result may share memory with ``x``.
        """
        root = self._check_peer(root, "root")
        deadline = self._deadline(timeout)
        if self.rank == root:
            arr = as_host_array(x)
            reqs = [self._isend_part(arr, r, self._COLL_TAG - 1, 0, 1)
                    for r in range(self.size) if r != root]
            for q in reqs:
                q.wait(max(deadline - time.monotonic(), 0))
            return place(arr, device, sharding)
        arr = self._irecv_raw(root, self._COLL_TAG - 1).wait(max(deadline - time.monotonic(), 0))[1]
        return place(arr, device, sharding)

    def allgather(self, x: Any, *, timeout: float | None = None, device: Any = None,
                  sharding: Any = None) -> Any:
        """Stack every rank's ``x`` (same dtype and shape everywhere): result shape (size, *x.shape).

        Raises CommError on every rank if dtypes or shapes differ.
        """

        def combine(parts):
            self._same_headers(parts, "allgather")
            return np.stack(parts)

        return place(self._coll(x, "allgather", combine, timeout), device, sharding)

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier. Raises CommTimeoutError at the deadline."""
        self._coll(np.zeros(0, np.uint8), "barrier", lambda parts: parts[0], timeout)

    @abc.abstractmethod
    def split(self, color: int | None, key: int = 0, *, timeout: float | None = None
              ) -> "Communicator | None":
        """Collective: ranks passing the same ``color`` (int >= 0) form a sub-communicator, ordered by
        (key, rank). Ranks passing ``color=None`` take part but get None back.
        """


class _AllRequest(Request):
    """Completes when all sub-requests complete; ``finish(values)`` makes the result."""

    def __init__(self, reqs: list[Request], finish: Callable[[list[Any]], Any]):
        self._reqs = reqs
        self._finish = finish
        self._done = False
        self._value = None

    def cancel(self) -> None:
        for r in self._reqs:
            r.cancel()

    def test(self) -> bool:
        if not self._done:
            self._done = all(r.test() for r in self._reqs)
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        if self._finish is None:
            return self._value
        start = time.monotonic()
        values = []
        try:
            for r in self._reqs:
                left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
                values.append(r.wait(left))
            self._value = self._finish(values)
        except BaseException:
            for r in self._reqs[len(values):]:
                r.cancel()  # e.g. a pytree of the wrong length: leave nothing posted
            raise
        self._finish = None
        return self._value
