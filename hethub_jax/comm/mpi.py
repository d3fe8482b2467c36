"""MPI backend: device -> host numpy -> mpi4py byte messages -> host -> device.

Wire protocol of one point-to-point message with user tag ``t`` on communicator ``comm``:

1. a header (``base.Header.encode()``, < 512 bytes) on MPI tag ``2*t`` (internal tags: ``2*t`` with
   ``t`` negative mapped above the user range);
2. the payload as raw bytes (``MPI.BYTE`` views of the C-contiguous array, so every dtype,
   ml_dtypes included, arrives bit-exact) on MPI tag ``2*t + 1``, in ``ceil(nbytes / chunk_bytes)``
   chunks of at most ``chunk_bytes`` (the sender's value, carried in the header).

The two use their own MPI tags, each kept in order by MPI, so the order in which a sender posts
them does not change which receive they match: the general path posts the header first, the fast
path of ``send`` the payload first.

Why the hot paths are lean: in MPICH's shared-memory transport a large transfer advances only inside
MPI calls of *both* ranks, so every microsecond of Python either rank runs between posting and
completing a transfer adds to its time (measured: 20 us of Python on either side adds 20 us to a
1 MiB message), and after a large copy the interpreter runs with cold caches (a few dictionary
lookups cost about a microsecond). So ``send`` of an array shaped like the last one on its tag posts
the payload before anything else and then a cached header; ``recv`` into ``out=`` posts both
receives first of all and compares the header (one byte comparison with the one its channel last
delivered) only after the payload has landed; neither builds a request object, and waits poll
MPI's ``Test`` directly (no Python frame per poll). Where the C hot path (``_hotpath.c``,
``HOTPATH``) is built, both fast paths run in C: the checks that admit a call to them, posting,
up to ``spin_s`` of polling and the header comparison; anything still in flight is handed back to
the Python code here (deadlines, decoding and errors stay here). Other messages take the general
path (headers encoded once per channel shape and decoded once per distinct header, both cached).
The header message itself costs about one small message's latency, the floor of this protocol
against a single raw message.

Headers and payloads use different MPI tags so receives of headers always match headers. MPI keeps
messages of one (source, tag, communicator) in order; the receiver posts payload receives of one
channel in the order their headers were matched, so several outstanding ``irecv`` on one channel
match messages in order.

Contiguous numpy inputs are sent from their own memory (no copy); the send request keeps the array
alive until it completes. Every wait polls (``Test``) against a deadline and raises
``CommTimeoutError`` naming the peer and tag. ``allreduce`` on up to ``exchange_max_ranks`` ranks
(default 2) exchanges whole buffers over these messages and reduces on the host in rank order
(bitwise the same on every rank); other collectives, and ``allreduce`` on more ranks, use MPI
non-blocking collectives (``Iallreduce``, ``Ibcast``, ``Iallgather``, ``Ibarrier``) under the same
deadline; float16, bfloat16 and float8 reduce in float32 and are cast back (see
``base.reduction_dtype``).

A communicator must not be used by two threads at once.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from .base import (HEADER_MAX, REDUCE_OPS, CommError, CommTimeoutError, Communicator, Header,
                   Request, _NAME_OF as _SENDABLE, as_host_array, check_tag, dtype_from_name, encode_header, place, poll_until,
                   reduce_arrays, reduction_dtype)

__all__ = ["MPIHostBridge", "DEFAULT_CHUNK_BYTES", "DEFAULT_EXCHANGE_MAX_RANKS", "HOTPATH"]

#: default payload chunk: 1 GiB, below MPI's 2**31-1 element count limit for MPI.BYTE.
DEFAULT_CHUNK_BYTES = 1 << 30
_MAX_CHUNK = (1 << 31) - 1
#: default ``exchange_max_ranks``: communicators of up to 2 ranks all-reduce by exchanging whole buffers.
DEFAULT_EXCHANGE_MAX_RANKS = 2
#: seconds the exchange all-reduce polls without sleeping once a peer's header has arrived (its
#: data is then moving), whatever ``spin_s`` is: 32 MiB take 3-10 ms between two processes here.
EXCHANGE_MOVING_SPIN_S = 0.02
_N_INTERNAL = 16  # internal (negative) tags -1 .. -16

_MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_MPI_TYPES: dict[np.dtype, Any] = {}  # reduction dtype -> predefined MPI datatype (cached)


def _mpi_type(dtype: np.dtype) -> Any:
    """The predefined MPI datatype of a plain numpy dtype: mpi4py's own typecode table
    (``MPI.Datatype.fromcode(dtype.char)``, the lookup ``mpi4py.util.dtlib.from_numpy_dtype`` makes for
    elementary types), cached.

    Not ``from_numpy_dtype`` itself: it returns a ``Dup`` of the predefined type (a user datatype the
    caller must free), and MPICH refuses MPI_SUM/MAX/MIN on it ("MPI_Op operation not defined for this
    datatype"). Used only by ``allreduce``, which reduces in ``base.reduction_dtype`` (a plain numpy
    dtype, never an ml_dtypes one); point-to-point messages, broadcast and allgather move raw bytes
    (``MPI.BYTE``), so ml_dtypes arrays (bfloat16, float8, ...), which mpi4py does not know, arrive
    bit-exact.

    Raises:
      TypeError: mpi4py has no MPI datatype for ``dtype``.
    """
    mtype = _MPI_TYPES.get(dtype)
    if mtype is None:
        try:
            mtype = _MPI_TYPES[dtype] = MPI.Datatype.fromcode(dtype.char)
        except (ValueError, KeyError):
            raise TypeError(f"allreduce does not support dtype {dtype}") from None
    return mtype


_BYTE = MPI.BYTE
_fromhandle = MPI.Request.fromhandle


_HOTPATH_INTERFACE = 2  # HOTPATH_INTERFACE of the _hotpath.c this module calls


def _load_hotpath():
    """The C hot path (``_hotpath.c``), or None: not built (``python -m
    hethub_jax.comm.build_hotpath``), turned off with the environment variable
    ``HETHUB_COMM_HOTPATH=0``, built for another MPI library than the one mpi4py runs on (the
    ``MPI.Get_library_version()`` recorded in ``_hotpath.json`` at build time must equal mpi4py's;
    checked before the import, so a second MPI library is never loaded), its handle constants differ
    from mpi4py's (another ABI), or it was built from another version of ``_hotpath.c`` (its
    ``INTERFACE``)."""
    if os.environ.get("HETHUB_COMM_HOTPATH", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        with open(os.path.join(os.path.dirname(__file__), "_hotpath.json")) as f:
            built_for = json.load(f).get("library_version")
    except (OSError, ValueError):
        return None
    if built_for != MPI.Get_library_version().replace("\x00", "").strip():  # Open MPI: NUL-terminated
        return None
    try:
        from . import _hotpath
    except ImportError:
        return None
    if getattr(_hotpath, "INTERFACE", None) != _HOTPATH_INTERFACE:
        return None  # built from another version of _hotpath.c (e.g. a stale in-place build)
    mine = (_hotpath.COMM_WORLD, _hotpath.BYTE, _hotpath.REQUEST_NULL)
    if mine != (MPI.COMM_WORLD.handle, MPI.BYTE.handle, MPI.REQUEST_NULL.handle):
        return None
    _hotpath.init(np.ndarray)
    return _hotpath


_hp = _load_hotpath()
#: True when ``send`` and ``recv(out=)`` post and spin in C (``_hotpath.c``); False: pure Python.
HOTPATH = _hp is not None
_c_writeable = lambda flags: flags.c_contiguous and flags.writeable  # noqa: E731
_DECODED: dict[bytes, tuple] = {}  # header buffer (zero padded) -> (Header, numpy dtype)


def _decode(hbuf: bytearray) -> tuple:
    """(Header, numpy dtype) of a received header buffer; a header seen before is not parsed again."""
    raw = bytes(hbuf)
    hit = _DECODED.get(raw)
    if hit is None:
        h = Header.decode(hbuf)
        if len(_DECODED) >= 4096:
            _DECODED.clear()
        hit = _DECODED[raw] = (h, dtype_from_name(h.dtype))
    return hit


def _poll(done, deadline: float, describe, spin_s: float, every=None) -> None:
    """poll_until, with MPI errors (truncation, ...) turned into CommError naming the operation."""
    try:
        poll_until(done, deadline, describe, spin_s, every=every)
    except MPI.Exception as e:
        raise CommError(f"{describe()} failed in MPI: {e.Get_error_string()}") from e


def _cancel(req) -> None:
    """Withdraw a pending receive (a completed one stays completed)."""
    if not req.Test():
        req.Cancel()
        req.Wait()


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    """uint8 view of a C-contiguous array's memory (no copy)."""
    return arr.reshape(-1).view(np.uint8)


def _chunks(nbytes: int, chunk: int):
    """(offset, length) of the payload messages: ceil(nbytes/chunk), and one empty one if nbytes=0."""
    if nbytes == 0:
        yield 0, 0
    for off in range(0, nbytes, chunk):
        yield off, min(chunk, nbytes - off)


class _SendRequest(Request):
    _spin: float | None = None  # seconds of polling before sleeping, if not the bridge's spin_s

    def __init__(self, comm: "MPIHostBridge", reqs: list, keep: tuple, dest: int, tag: int):
        self._comm, self._reqs, self._keep = comm, reqs, keep
        self._dest, self._tag = dest, tag
        self._done = False

    def test(self) -> bool:
        if not self._done:
            self._comm._progress()
            if MPI.Request.Testall(self._reqs):
                self._done, self._keep = True, None
        return self._done

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        reqs = self._reqs
        deadline = self._comm._deadline(timeout)

        def describe():
            return f"send from rank {self._comm.rank} to rank {self._dest} (tag {self._tag})"

        # The hot loop calls MPI's Test directly (no Python frame per poll): in MPICH each Test also
        # copies the next piece of a large shared-memory transfer, so a slower loop is a slower copy.
        # First the last payload piece (the transfer), then all (the small eager header, sent first).
        _poll(reqs[-1].Test, deadline, describe, self._spin if self._spin is not None else self._comm.spin_s, every=self._comm._progress)
        if len(reqs) > 2 or not reqs[0].Test():
            _poll(functools.partial(MPI.Request.Testall, reqs), deadline, describe,
                  self._spin if self._spin is not None else self._comm.spin_s, every=self._comm._progress)
        self._done, self._keep = True, None


class _RecvRequest(Request):
    """Header receive posted at once; payload receives posted when this is the head of its channel."""

    _spin: float | None = None  # payload polling before sleeping (header arrived), if not spin_s

    def _moving_spin(self) -> float:
        return self._spin if self._spin is not None else self._comm.spin_s

    def __init__(self, comm: "MPIHostBridge", source: int, tag: int, raw: bool, device, sharding,
                 out, posted: tuple | None = None):
        self._comm, self._source, self._tag = comm, source, tag
        self._raw, self._device, self._sharding, self._out = raw, device, sharding, out
        if posted is None:
            self._hbuf = bytearray(HEADER_MAX)  # zeros: equal headers give equal buffers
            self._hreq = comm._comm.Irecv([self._hbuf, MPI.BYTE], source, comm._mpi_tag(tag, 0))
            pre = None
        else:  # (header buffer, its completed receive, payload receive into out=): recv's fast path
            self._hbuf, self._hreq, pre = posted
        self._header: Header | None = None
        self._arr: np.ndarray | None = None
        self._error: Exception | None = None
        self._reqs: list | None = None  # payload receives, once posted
        self._pre = pre  # payload receive posted into out= before the header arrived
        self._done = False
        self._result = None
        self._finished = False

    def _start_payload(self) -> bool:
        """If the header arrived: allocate and post the payload receives. Returns True if posted."""
        if self._reqs is not None:
            return True
        if not self._hreq.Test():
            return False
        h = self._header = _decode(self._hbuf)[0]
        try:
            self._arr = h.empty(self._out)
        except CommError as e:  # still consume the message so the channel stays in step
            self._error, self._arr = e, h.empty()
        mtag, comm, nbytes = self._comm._mpi_tag(self._tag, 1), self._comm._comm, h.nbytes
        view = self._arr.reshape(-1).view(np.uint8)
        if self._pre is not None:  # first payload message already has a receive (into out=)
            self._reqs = [self._pre] + [
                comm.Irecv([view[o:o + n], MPI.BYTE], self._source, mtag)
                for o, n in _chunks(nbytes, h.chunk_bytes or nbytes) if o > 0]
        elif nbytes <= h.chunk_bytes:
            self._reqs = [comm.Irecv([view, MPI.BYTE], self._source, mtag)]
        else:
            self._reqs = [comm.Irecv([view[o:o + n], MPI.BYTE], self._source, mtag)
                          for o, n in _chunks(nbytes, h.chunk_bytes or nbytes)]
        return True

    def test(self) -> bool:
        if self._done:
            return True
        if self._reqs is None:
            self._posted()
            if self._reqs is None:
                return False
        if MPI.Request.Testall(self._reqs):
            self._done = True
        return self._done

    def _posted(self) -> bool:
        if self._pre is not None:  # not queued on the channel: handle our own header
            self._start_payload()
        else:
            self._comm._progress()
        return self._reqs is not None

    def cancel(self) -> None:
        self._cancel_header()

    def _cancel_header(self) -> None:
        """With no header yet: withdraw the header receive from the channel."""
        if self._reqs is not None or self._finished:
            return
        self._comm._progress()
        if self._reqs is not None:
            return
        self._hreq.Cancel()
        status = MPI.Status()
        self._hreq.Wait(status)
        if status.Is_cancelled() and self._pre is not None:
            self._pre.Cancel()
            self._pre.Wait(status)
        if status.Is_cancelled():
            q = self._comm._pending.get((self._source, self._tag))
            if q is not None and self in q:
                q.remove(self)

    def wait(self, timeout: float | None = None) -> Any:
        if self._finished:
            return self._result
        deadline = self._comm._deadline(timeout)

        def describe():
            return (f"recv on rank {self._comm.rank} from rank {self._source} (tag "
                    f"{self._tag}){'' if self._header else ', no header yet'}")

        try:
            if self._pre is not None and self._reqs is None or not self.test():
                if self._reqs is None and self._pre is not None:
                    # phase 0 (out= given): the header first (sent first, it arrives before the
                    # payload), checked against out= in a few operations while the sender posts
                    # the payload, then the payload: nothing but returning is left after its copy.
                    _poll(self._hreq.Test, deadline, describe, self._comm.spin_s,
                          every=self._comm._progress)
                    h, dt = _DECODED.get(bytes(self._hbuf)) or _decode(self._hbuf)
                    out = self._out
                    if dt is out.dtype and h.shape == out.shape and h.nbytes <= h.chunk_bytes:
                        # the common case: the message is exactly out=, in one piece
                        self._header, self._arr, self._reqs = h, out, [self._pre]
                        _poll(self._pre.Test, deadline, describe, self._moving_spin(),
                              every=self._comm._progress)
                        self._done = self._finished = True
                        if self._raw:
                            self._result = (h, out)
                        elif self._device is None and self._sharding is None:
                            self._result = out
                        else:
                            self._result = place(out, self._device, self._sharding)
                        return self._result
                    self._start_payload()  # mismatch (error kept) or more pieces: phase 2
                elif self._reqs is None:
                    # phase 1: our header (a tight loop of MPI Test calls); its arrival means every
                    # earlier receive of the channel has its header too, so progress posts ours
                    _poll(self._hreq.Test, deadline, describe, self._comm.spin_s,
                          every=self._comm._progress)
                    self._comm._progress()
                reqs = self._reqs  # phase 2: only the payload requests, tested back to back
                if reqs:
                    fast = (reqs[0].Test if len(reqs) == 1
                            else functools.partial(MPI.Request.Testall, reqs))
                    try:
                        _poll(fast, deadline, describe, self._moving_spin(),
                              every=self._comm._progress)
                    except CommError:
                        if self._error is None or isinstance(self._error, CommTimeoutError):
                            raise
                self._done = True
        except CommTimeoutError:
            self._cancel_header()
            raise
        self._finished = True
        if self._error is not None:
            raise self._error
        h, arr = self._header, self._arr
        self._result = (h, arr) if self._raw else place(arr, self._device, self._sharding)
        return self._result


class _CollRequest:
    def __init__(self, comm: "MPIHostBridge", what: str):
        self.comm, self.what = comm, what

    def wait(self, req, deadline: float) -> None:
        def done():
            self.comm._progress()
            return req.Test()

        _poll(done, deadline,
                   lambda: f"{self.what} on rank {self.comm.rank} of {self.comm.size}",
                   self.comm.spin_s)


class MPIHostBridge(Communicator):
    """Communicator over an mpi4py communicator, moving host buffers.

    Args:
      comm: the MPI communicator (default ``MPI.COMM_WORLD``).
      chunk_bytes: largest payload piece in one MPI message, bytes, in [1, 2**31-1]
        (default 1 GiB).
      timeout: default deadline of blocking calls, seconds (``math.inf``: none).
      spin_s: seconds a wait polls without sleeping before backing off (latency vs CPU use).
      exchange_max_ranks: largest communicator size whose ``allreduce`` exchanges whole buffers
        and reduces them on the host in rank order (bitwise the same result on every rank); larger
        ones use MPI's ``Iallreduce``. Default 2: each rank then receives one buffer, as in any
        all-reduce; with ``n`` ranks it receives ``n - 1``.

    Raises:
      ValueError: chunk_bytes out of range, spin_s negative, or exchange_max_ranks < 0.
    """

    def __init__(self, comm: Any = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout: float = 300.0, spin_s: float = 0.05,
                 exchange_max_ranks: int = DEFAULT_EXCHANGE_MAX_RANKS):
        self._comm = MPI.COMM_WORLD if comm is None else comm
        if not 1 <= int(chunk_bytes) <= _MAX_CHUNK:
            raise ValueError(f"chunk_bytes must be in [1, {_MAX_CHUNK}], got {chunk_bytes}")
        self._chunk_bytes = int(chunk_bytes)
        self._timeout = float(timeout)
        if not spin_s >= 0:
            raise ValueError(f"spin_s must be >= 0 seconds, got {spin_s}")
        self._spin_s = float(spin_s)
        if not isinstance(exchange_max_ranks, (int, np.integer)) or exchange_max_ranks < 0:
            raise ValueError(f"exchange_max_ranks must be an int >= 0, got {exchange_max_ranks!r}")
        self._exchange_max_ranks = int(exchange_max_ranks)
        self._hot_spin = min(self._spin_s, self._timeout)  # C spin budget at the default timeout
        self._rank, self._size = self._comm.Get_rank(), self._comm.Get_size()
        tag_ub = self._comm.Get_attr(MPI.TAG_UB) or 32767
        self.max_tag = min(Communicator.max_tag, (tag_ub - 1) // 2 - _N_INTERNAL)
        # per (source, tag): receives whose payload receives are not posted yet, in post order
        self._pending: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)
        self._headers_sent: dict[tuple, bytes] = {}  # (dtype, shape, tag, part, parts) -> header
        # send's fast path: tag -> (dtype, shape, header bytes, MPI header tag) of its last message
        self._last_sent: dict[int, tuple] = {}
        # recv's fast path: (source, tag) -> (dtype, shape, header bytes) last accepted into out=
        self._expected: dict[tuple, tuple] = {}
        self._hscratch = bytearray(HEADER_MAX)
        # the C hot path's view of this bridge (read there on every fast-path call; the dicts
        # and the scratch buffer are the objects above, updated in place here)
        self._hot = (self._comm.handle, self._last_sent, self._pending, self._size, self.max_tag,
                     self._hot_spin, self._spin_s, self._hscratch, self._expected)
        # sends that timed out or failed: (requests, buffers kept alive until MPI is done with them)
        self._abandoned: list[tuple[list, tuple]] = []

    def with_spin(self, spin_s: float) -> "MPIHostBridge":
        """A bridge over the same MPI communicator whose waits poll without sleeping for ``spin_s``
        seconds (same chunk size, timeout and ``exchange_max_ranks``). For a background thread that should sleep while its
        peers have not arrived rather than take a CPU core from compute (``spin_s=0``: back off at
        once, at most ``max_sleep_s`` = 1 ms late). The two objects share the communicator: use
        both from one thread only (MPI matches collectives in the order they are called).

        Raises:
          ValueError: if spin_s is negative.
        """
        return MPIHostBridge(self._comm, chunk_bytes=self._chunk_bytes, timeout=self._timeout, spin_s=spin_s,
                             exchange_max_ranks=self._exchange_max_ranks)

    @property
    def spin_s(self) -> float:
        """Seconds a wait polls without sleeping before backing off (fixed at construction)."""
        return self._spin_s

    @property
    def exchange_max_ranks(self) -> int:
        """Largest size whose ``allreduce`` exchanges whole buffers (fixed at construction)."""
        return self._exchange_max_ranks

    @property
    def chunk_bytes(self) -> int:
        """Largest payload piece in one MPI message, bytes (fixed at construction)."""
        return self._chunk_bytes

    @property
    def mpi_comm(self) -> Any:
        """The underlying mpi4py communicator."""
        return self._comm

    def __repr__(self):
        return f"MPIHostBridge(rank={self._rank}, size={self._size}, chunk_bytes={self.chunk_bytes})"

    def _mpi_tag(self, tag: int, payload: int) -> int:
        t = tag if tag >= 0 else self.max_tag - tag  # internal tags above the user range
        return 2 * t + payload

    def _progress(self) -> None:
        """Post payload receives for every receive whose header arrived (all channels, in order).

        Called from every poll (sends and collectives included): a large send completes only once
        its receiver has posted the payload receive, so e.g. in ``sendrecv`` waiting on the send
        must also progress the receive.
        """
        if not self._pending:
            return
        for key in list(self._pending):
            q = self._pending[key]
            while q and q[0]._start_payload():
                q.popleft()
            if not q:
                del self._pending[key]

    # ---- point-to-point --------------------------------------------------------------------
    def send(self, x: Any, dest: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """``Communicator.send``: ``isend(...).wait(timeout)``.

        Fast path, taken when ``x`` is a C-contiguous numpy array of the dtype and shape that the
        last message on this tag had (one payload piece) and no receive of this bridge waits for
        its header: the payload is posted before anything else (its transfer starts at once into a
        receive posted earlier), then the cached header, with no request object. With the C hot
        path (``HOTPATH``) the checks, the posting and up to ``spin_s`` seconds of polling all run
        in C. Every operation before the payload is posted adds to a large message's time (module
        comment). Otherwise: the general path, which also fills this tag's cache.
        """
        if _hp is not None:  # C: the checks below, posting and a spin (None: sent; False: n/a)
            r = _hp.send(self._hot, x, dest, tag, timeout)
            if r is None:
                return
            if r is not False:  # still in flight after the spin, or an MPI error
                return self._send_rest(r, x, self._last_sent[tag], dest, tag, timeout)
        else:
            ent = self._last_sent.get(tag)
            if (ent is not None and type(x) is np.ndarray and x.dtype is ent[0]
                    and x.shape == ent[1] and type(dest) is int and type(tag) is int
                    and 0 <= dest < self._size and x.flags.c_contiguous):
                return self._send_rest(None, x, ent, dest, tag, timeout)
        if type(tag) is not int or not 0 <= tag <= self.max_tag:
            tag = check_tag(tag, self.max_tag)
        req = self._isend_part(x, dest, tag, 0, 1)
        arr, hdr = req._keep
        try:
            req.wait(timeout)
        except CommError:
            self._abandon(req._reqs, req._keep)
            raise
        if arr.nbytes <= self._chunk_bytes:  # one piece: later sends of this kind go fast
            if len(self._last_sent) >= 4096:
                self._last_sent.clear()
            self._last_sent[tag] = (arr.dtype, arr.shape, hdr, 2 * tag)

    def _send_rest(self, r: tuple | None, x: np.ndarray, ent: tuple, dest: int, tag: int,
                   timeout: float | None) -> None:
        """send's fast path after the C spin (``r``: its result) or without C (``r`` None)."""
        t = self._timeout if timeout is None else timeout
        spin = self._spin_s
        if r is None:  # pure Python: post here
            p = self._comm.Isend([x, _BYTE], dest, ent[3] + 1)
            h = self._comm.Isend([ent[2], _BYTE], dest, ent[3])
        else:  # still in flight after the C spin, or an MPI error
            p, h = _fromhandle(r[1]), _fromhandle(r[2])
            if r[0]:
                self._abandon([p, h], (x, ent[2]))
                raise CommError(f"{self._describe_send(dest, tag)} failed in MPI: "
                                f"{MPI.Get_error_string(r[0])}")
            t, spin = t - min(t, spin), 0.0
        every = self._progress if self._pending else None
        deadline = None
        try:
            if not p.Test():
                deadline = time.monotonic() + t
                _poll(p.Test, deadline, lambda: self._describe_send(dest, tag), spin, every=every)
            if not h.Test():
                if deadline is None:
                    deadline = time.monotonic() + t
                _poll(h.Test, deadline, lambda: self._describe_send(dest, tag), spin, every=every)
        except CommError:
            self._abandon([p, h], (x, ent[2]))
            raise

    def _abandon(self, reqs: list, keep: tuple) -> None:
        """Keep the buffers of a send that raised (timeout, MPI error) alive while MPI may still
        read them; entries are dropped once their requests complete (tested here and in barrier)."""
        self._reap()
        self._abandoned.append((list(reqs), keep))

    def _reap(self) -> None:
        if self._abandoned:
            self._abandoned = [e for e in self._abandoned if not MPI.Request.Testall(e[0])]

    def _describe_send(self, dest: int, tag: int) -> str:
        return f"send from rank {self._rank} to rank {dest} (tag {tag})"

    def recv(self, source: int, tag: int = 0, *, device: Any = None, sharding: Any = None,
             out: np.ndarray | None = None, timeout: float | None = None) -> Any:
        """``Communicator.recv``: ``irecv(...).wait(timeout)``.

        Fast path, taken for a receive into ``out=`` (C-contiguous, writeable, one payload piece)
        while no other receive of this bridge waits for its header: payload and header receives
        are posted first of all, with no request object, and only once the payload has landed is
        the header compared with the one this channel last delivered into such an ``out=`` (one
        byte comparison; work while a large message is in flight would stall its copy). With the
        C hot path (``HOTPATH``) the checks, the posting, up to ``spin_s`` seconds of polling and
        that comparison all run in C. A first or different header, or a message in several
        pieces, continues on the general path, which raises ``CommError`` on a mismatch (the
        contents of ``out=`` are then undefined).
        """
        if type(out) is np.ndarray and (device is None or sharding is None):
            if _hp is not None:  # C: checks, posting, a spin and the header comparison
                r = _hp.recv(self._hot, out, source, tag, timeout)
                if r is out:
                    return out if device is None and sharding is None else \
                        place(out, device, sharding)
                if r is not False:  # both arrived (header to check) or still in flight, or error
                    return self._recv_rest(r, out, self._hscratch,
                                           self._expected.get((source, tag)), source, tag,
                                           device, sharding, timeout)
            elif (type(tag) is int and type(source) is int and not self._pending
                  and 0 <= tag <= self.max_tag and 0 <= source < self._size
                  and 0 < out.nbytes <= _MAX_CHUNK and _c_writeable(out.flags)):
                return self._recv_rest((), out, self._hscratch, self._expected.get((source, tag)),
                                       source, tag, device, sharding, timeout)
        if type(tag) is not int or not 0 <= tag <= self.max_tag:
            tag = check_tag(tag, self.max_tag)
        if device is not None and sharding is not None:
            raise ValueError("give at most one of device= and sharding=")
        return self._post(source, tag, False, device, sharding, out).wait(timeout)

    def _recv_rest(self, r: tuple | None, out: np.ndarray, hbuf: bytearray, ent: tuple | None,
                   source: int, tag: int, device: Any, sharding: Any, timeout: float | None
                   ) -> Any:
        """recv's fast path after the C spin (``r``: its result; None: both arrived) or without C
        (``r`` is ``()``): finish the receive, compare the header, or hand over to the general
        path."""
        t = self._timeout if timeout is None else timeout
        spin, ok, pending = self._spin_s, True, True
        if r == ():  # pure Python: post here
            pre = self._comm.Irecv([out, _BYTE], source, 2 * tag + 1)
            hreq = self._comm.Irecv([hbuf, _BYTE], source, 2 * tag)
        elif r is None:  # both arrived; the header differs from ent's (or there is no ent)
            pre, hreq, pending = MPI.Request(), MPI.Request(), False
        else:  # still in flight after the C spin, or an MPI error (e.g. truncated: larger than out=)
            pre, hreq = _fromhandle(r[1]), _fromhandle(r[2])
            ok = not r[0]
            t, spin = t - min(t, spin), 0.0
        deadline = time.monotonic() + t
        if pending and ok:
            # the header, then the payload; the header is checked only once the payload has
            # landed: work done while a large message is in flight would stall its copy
            try:
                if not hreq.Test():
                    _poll(hreq.Test, deadline, lambda: self._describe_recv(source, tag, False), spin)
                if not pre.Test():
                    _poll(pre.Test, deadline, lambda: self._describe_recv(source, tag, True), spin)
            except CommTimeoutError:
                _cancel(hreq)
                _cancel(pre)
                raise
            except (CommError, MPI.Exception):  # e.g. truncated: a larger message than out=
                ok = False  # the general path names both sides from the header
            if (ok and ent is not None and hbuf.startswith(ent[2]) and ent[0] is out.dtype
                    and ent[1] == out.shape):
                return out if device is None and sharding is None else place(out, device, sharding)
        # first time on this channel with such an out=, another header, or more pieces:
        # decode and check on the general path
        req = _RecvRequest(self, source, tag, False, device, sharding, out,
                           posted=(bytearray(hbuf), hreq, pre))
        hbuf[:] = bytes(HEADER_MAX)
        result = req.wait(max(deadline - time.monotonic(), 0.0))
        h = req._header
        if h.nbytes <= h.chunk_bytes and h.part == 0 and h.parts == 1:
            if len(self._expected) >= 4096:
                self._expected.clear()
            self._expected[(source, tag)] = (out.dtype, out.shape,
                                             encode_header(out, tag, h.chunk_bytes, 0, 1))
        return result

    def _describe_recv(self, source: int, tag: int, header: bool) -> str:
        return (f"recv on rank {self._rank} from rank {source} (tag {tag})"
                f"{'' if header else ', no header yet'}")

    def _isend_part(self, x: Any, dest: int, tag: int, part: int, parts: int) -> Request:
        if type(dest) is not int or not 0 <= dest < self._size:
            dest = self._check_peer(dest, "dest")
        if type(x) is np.ndarray and x.flags.c_contiguous and x.dtype in _SENDABLE:
            arr = x  # as_host_array's fast path, inlined: this runs before the payload is posted
        else:
            arr = as_host_array(x)
        t = tag if tag >= 0 else self.max_tag - tag
        comm, nbytes = self._comm, arr.nbytes
        key = (arr.dtype, arr.shape, tag, part, parts)
        hdr = self._headers_sent.get(key)
        if hdr is None:  # encoded once per (dtype, shape, tag, part): repeated channels reuse it
            if len(self._headers_sent) >= 4096:
                self._headers_sent.clear()
            hdr = self._headers_sent[key] = encode_header(arr, tag, self.chunk_bytes, part, parts)
        # header first, then the payload; each of the two MPI tags keeps its own order. At least
        # one payload message, empty if nbytes == 0.
        reqs = [comm.Isend([hdr, _BYTE], dest, 2 * t)]
        if nbytes <= self.chunk_bytes:  # the array's memory as bytes (every dtype, ml_dtypes too)
            reqs.append(comm.Isend([arr, _BYTE], dest, 2 * t + 1))
        else:
            view = _bytes_of(arr)
            reqs += [comm.Isend([view[o:o + n], _BYTE], dest, 2 * t + 1)
                     for o, n in _chunks(nbytes, self.chunk_bytes)]
        return _SendRequest(self, reqs, (arr, hdr), dest, tag)

    def _post(self, source, tag, raw, device=None, sharding=None, out=None) -> Request:
        if type(source) is not int or not 0 <= source < self._size:
            source = self._check_peer(source, "source")
        pre = None
        if (type(out) is np.ndarray and 0 < out.nbytes <= _MAX_CHUNK and _c_writeable(out.flags)
                and not self._pending.get((source, tag))):
            # Nothing earlier on this channel waits for its header: post the first payload
            # message's receive into out= first of all, so data lands without waiting for our
            # header processing (the header is checked against out= when it arrives).
            pre = self._comm.Irecv([out, _BYTE], source, 2 * tag + 1 if tag >= 0 else self._mpi_tag(tag, 1))
        req = _RecvRequest(self, source, tag, raw, device, sharding, out)
        if pre is None:
            self._pending[(source, tag)].append(req)
        else:
            req._pre = pre
        return req

    # ---- collectives -----------------------------------------------------------------------
    def _headers(self, arr: np.ndarray, what: str, deadline: float) -> list[Header]:
        """All-gather every rank's header (dtype/shape) under the deadline."""
        mine = np.zeros(HEADER_MAX, np.uint8)
        enc = Header.for_array(arr, 0).encode()
        mine[:len(enc)] = np.frombuffer(enc, np.uint8)
        table = np.empty((self._size, HEADER_MAX), np.uint8)
        _CollRequest(self, what).wait(self._comm.Iallgather([mine, MPI.BYTE], [table, MPI.BYTE]),
                                      deadline)
        return [Header.decode(table[r]) for r in range(self._size)]

    def _same(self, arr: np.ndarray, what: str, deadline: float) -> None:
        hs = self._headers(arr, what, deadline)
        if any((h.dtype, h.shape) != (hs[0].dtype, hs[0].shape) for h in hs):
            desc = ", ".join(f"rank {r}: {h.describe()}" for r, h in enumerate(hs))
            raise CommError(f"{what}: ranks disagree on dtype/shape ({desc})")

    _EXCHANGE_TAG = -4  # internal tag of allreduce's exchange of whole buffers (base uses -1, -2)

    def allreduce(self, x: Any, op: str = "sum", *, timeout: float | None = None,
                  device: Any = None, sharding: Any = None) -> Any:
        """``Communicator.allreduce``: every rank gets the reduction of every rank's ``x``.

        Up to ``exchange_max_ranks`` ranks (default 2): every rank sends its whole buffer to every
        other (``isend`` / ``irecv`` of the bridge, in the array's own dtype: bfloat16 travels as 2
        bytes per element) and reduces the ``size`` arrays on the host in rank order,
        ``((x_0 op x_1) op x_2) ...`` in ``base.reduction_dtype`` (as ``base.reduce_arrays`` and
        the in-process backend), so the result is bitwise the same on every rank and the same as
        ``LocalCommunicator``'s. Above that: MPI's ``Iallreduce`` in pieces of at most
        ``chunk_bytes`` after an all-gather of the headers (MPI's own reduction order, which for 3
        ranks and more need not be the same on every rank for floats). Why the exchange: MPICH's
        ``Iallreduce`` runs several rounds, each advanced only inside MPI calls of both ranks, so
        it pays the bridge's polling (with ``spin_s=0`` its sleeps) several times, where one
        exchange pays it once: between two processes the ``Iallreduce`` path took 1.2-2.3x the
        exchange with sleeping waits at 64 KiB-32 MiB (``benchmarks/bridge.py --allreduce``;
        docs/benchmarks.md, issue 3, session 15; a LOADED machine).

        Args:
          x: array-like, the same dtype and shape on every rank.
          op: "sum", "max" or "min". float16 / bfloat16 / float8 reduce in float32 and are cast back
            (round to nearest even, once); bool sum is logical or; integers wrap as numpy's do.
          timeout: seconds (None: the bridge's default).

        Returns:
          An array of x's dtype and shape (numpy unless ``device`` / ``sharding`` is given).

        Raises:
          ValueError: unknown op.
          CommError: ranks passed different dtypes or shapes (raised on every rank, naming them).
          CommTimeoutError: a rank did not take part within ``timeout`` seconds.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        deadline = self._deadline(timeout)
        arr = as_host_array(x)
        if self._size <= self._exchange_max_ranks:
            # every dtype travels as itself (bfloat16: 2 bytes), so a rank with another dtype or
            # shape is seen in the headers by all; widening a peer's float16 / bfloat16 array on the
            # receiver made bfloat16 0.72-0.78x the Iallreduce path at 8-32 MiB in one LOADED run
            # (docs/benchmarks.md); sending float32 instead would need a header round first
            res = self._allreduce_exchange(arr, op, deadline)
        else:
            res = self._allreduce_mpi(arr, op, deadline)
        return place(res, device, sharding)

    def _allreduce_exchange(self, arr: np.ndarray, op: str, deadline: float) -> np.ndarray:
        """Every rank's whole ``arr`` to every other, then the reduction in rank order (``allreduce``)."""
        n, me, tag = self._size, self._rank, self._EXCHANGE_TAG
        peers = [(me + k) % n for k in range(1, n)]  # rotated: rank r sends to r+1 first
        recvs = {src: self._post(src, tag, True, out=np.empty(arr.shape, arr.dtype))
                 for src in sorted(peers)}
        sends = [self._isend_part(arr, dst, tag, 0, 1) for dst in peers]
        # Waiting for a peer to arrive follows spin_s (a sleeping bridge leaves the core to compute);
        # once its header is here the data moves, and it moves only inside MPI calls: poll without
        # sleeping for up to EXCHANGE_MOVING_SPIN_S then (sched_yield still runs every 256 polls).
        moving = max(self._spin_s, EXCHANGE_MOVING_SPIN_S)
        for q in list(recvs.values()) + sends:
            q._spin = moving
        parts: dict[int, np.ndarray] = {me: arr}
        headers: dict[int, Header] = {}
        waited: set[int] = set()  # receives whose wait ran (a wait that times out withdraws its own)
        try:
            for src, req in recvs.items():
                waited.add(src)
                try:
                    parts[src] = req.wait(max(deadline - time.monotonic(), 0.0))[1]
                except CommTimeoutError as e:
                    raise CommTimeoutError(f"allreduce({op}) on rank {me} of {n}: rank {src} did not "
                                           f"take part ({e})") from None
                except CommError:
                    if req._header is None:  # not a shape/dtype mismatch (an MPI failure)
                        raise
                    headers[src] = req._header  # consumed: the other ranks' messages still come
            for s, dst in zip(sends, peers):
                try:
                    s.wait(max(deadline - time.monotonic(), 0.0))
                except CommTimeoutError as e:
                    raise CommTimeoutError(f"allreduce({op}) on rank {me} of {n}: rank {dst} did not "
                                           f"take part ({e})") from None
        except BaseException:
            for src, req in recvs.items():
                if src not in waited:
                    req.cancel()
            for s in sends:
                if not s._done:
                    self._abandon(s._reqs, s._keep)
            raise
        if headers:
            mine = Header.for_array(arr, 0)
            desc = ", ".join(f"rank {r}: {headers[r].describe() if r in headers else mine.describe()}"
                             for r in range(n))
            raise CommError(f"allreduce({op}): ranks disagree on dtype/shape ({desc})")
        return reduce_arrays([parts[r] for r in range(n)], op)

    def _allreduce_mpi(self, arr: np.ndarray, op: str, deadline: float) -> np.ndarray:
        """MPI's ``Iallreduce`` in pieces of at most ``chunk_bytes`` (``allreduce`` above
        ``exchange_max_ranks`` ranks)."""
        self._same(arr, f"allreduce({op})", deadline)
        red = reduction_dtype(arr.dtype)
        src = arr.astype(red, copy=False).reshape(-1)
        out = np.empty_like(src)
        mtype, waiter = _mpi_type(red), _CollRequest(self, f"allreduce({op})")
        step = max(self.chunk_bytes // red.itemsize, 1)
        for o in range(0, src.size, step):
            n = min(step, src.size - o)
            waiter.wait(self._comm.Iallreduce([src[o:o + n], n, mtype], [out[o:o + n], n, mtype],
                                              _MPI_OPS[op]), deadline)
        res = out.reshape(arr.shape)
        if red != arr.dtype:
            res = res.astype(arr.dtype) if arr.dtype != np.bool_ else res != 0
        return res

    def broadcast(self, x: Any, root: int = 0, *, timeout: float | None = None,
                  device: Any = None, sharding: Any = None) -> Any:
        root = self._check_peer(root, "root")
        deadline = self._deadline(timeout)
        hbuf = np.zeros(HEADER_MAX, np.uint8)
        if self._rank == root:
            arr = as_host_array(x)
            enc = Header.for_array(arr, 0).encode()
            hbuf[:len(enc)] = np.frombuffer(enc, np.uint8)
        waiter = _CollRequest(self, f"broadcast(root={root})")
        waiter.wait(self._comm.Ibcast([hbuf, MPI.BYTE], root), deadline)
        if self._rank != root:
            arr = Header.decode(hbuf).empty()
        view = _bytes_of(arr)
        for o, n in _chunks(arr.nbytes, self.chunk_bytes):
            waiter.wait(self._comm.Ibcast([view[o:o + n], MPI.BYTE], root), deadline)
        return place(arr, device, sharding)

    def allgather(self, x: Any, *, timeout: float | None = None, device: Any = None,
                  sharding: Any = None) -> Any:
        deadline = self._deadline(timeout)
        arr = as_host_array(x)
        self._same(arr, "allgather", deadline)
        out = np.empty((self._size,) + arr.shape, arr.dtype)
        mine, table = _bytes_of(arr), out.reshape(self._size, -1).view(np.uint8)
        waiter = _CollRequest(self, "allgather")
        if arr.nbytes <= self.chunk_bytes:
            waiter.wait(self._comm.Iallgather([mine, MPI.BYTE], [table, MPI.BYTE]), deadline)
        else:
            for o, n in _chunks(arr.nbytes, self.chunk_bytes):
                tmp = np.empty((self._size, n), np.uint8)
                waiter.wait(self._comm.Iallgather([mine[o:o + n], MPI.BYTE], [tmp, MPI.BYTE]),
                            deadline)
                table[:, o:o + n] = tmp
        return place(out, device, sharding)

    def barrier(self, *, timeout: float | None = None) -> None:
        self._reap()
        _CollRequest(self, "barrier").wait(self._comm.Ibarrier(), self._deadline(timeout))

    def split(self, color: int | None, key: int = 0, *, timeout: float | None = None
              ) -> "MPIHostBridge | None":
        if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"color must be an int >= 0 or None, got {color!r}")
        # MPI_Comm_split cannot time out: enter it only once every rank has arrived.
        self.barrier(timeout=timeout)
        sub = self._comm.Split(MPI.UNDEFINED if color is None else int(color), int(key))
        if sub == MPI.COMM_NULL:
            return None
        return MPIHostBridge(sub, chunk_bytes=self.chunk_bytes, timeout=self._timeout,
                             spin_s=self.spin_s, exchange_max_ranks=self._exchange_max_ranks)
