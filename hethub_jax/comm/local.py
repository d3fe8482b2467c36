"""In-process backend: several logical ranks of one Python process exchanging messages by queues.

``LocalCommunicator.create(n)`` returns ``n`` endpoints (ranks 0..n-1) sharing one hub. Semantics
match the contract (per-channel FIFO order, headers, timeouts) with one difference: every send is
buffered (the array is copied at ``isend`` and the send completes at once), whereas an MPI send of a
large message may wait for its receiver. Code that is correct under MPI semantics is correct here.

Blocking calls wait on a condition variable. Point-to-point traffic can be driven from one thread
(post receives, send, then wait), but collectives and ``split`` block until every rank of the group
has called them, so in-process ranks that use collectives must run in separate threads (one per
logical rank), as the pipeline runtime and the tests do. One endpoint must not be used by two threads
at the same time.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

from .base import (Communicator, CommTimeoutError, DoneRequest, Header, Request, as_host_array,
                   place)

__all__ = ["LocalCommunicator"]


class _Hub:
    """Queues shared by all endpoints: channel (group, src, dst, tag) -> messages / posted receives."""

    def __init__(self):
        self.cond = threading.Condition()
        self.messages: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.posted: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)

    def match(self, key: tuple) -> None:
        """Pair queued messages with posted receives in FIFO order (call with cond held)."""
        msgs, recvs = self.messages[key], self.posted[key]
        matched = False
        while msgs and recvs:
            recvs.popleft()._value = msgs.popleft()
            matched = True
        if matched:
            self.cond.notify_all()


class _LocalRecv(Request):
    def __init__(self, comm: "LocalCommunicator", key: tuple, raw: bool, device=None, sharding=None,
                 out=None):
        self._comm, self._key, self._raw = comm, key, raw
        self._device, self._sharding, self._out = device, sharding, out
        self._value = None  # (Header, ndarray) once matched
        self._result = None
        self._finished = False

    def test(self) -> bool:
        return self._value is not None

    def cancel(self) -> None:
        hub = self._comm._hub
        with hub.cond:
            if self._value is None and self in hub.posted[self._key]:
                hub.posted[self._key].remove(self)

    def wait(self, timeout: float | None = None) -> Any:
        if self._finished:
            return self._result
        hub = self._comm._hub
        deadline = self._comm._deadline(timeout)
        with hub.cond:
            while self._value is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    _, src, dst, tag = self._key
                    hub.posted[self._key].remove(self)  # abandon: later messages go to later recvs
                    raise CommTimeoutError(f"recv on rank {dst} from rank {src} (tag {tag}) did not "
                                           f"complete within {self._comm._t(timeout):.3g} s")
                hub.cond.wait(min(left, 1.0))
        h, arr = self._value
        if self._out is not None:
            out, self._out = self._out, None
            self._value = (h, None)  # a retried wait finds no array
            np.copyto(h.empty(out), arr)  # raises CommError if it does not fit
            arr = out
        self._result = (h, arr) if self._raw else place(arr, self._device, self._sharding)
        self._finished = True
        return self._result


class LocalCommunicator(Communicator):
    """One logical rank of an in-process group. Build groups with :meth:`create`.

    Args:
      timeout: default deadline of blocking calls, seconds (``math.inf``: none).
    """

    def __init__(self, hub: _Hub, group: tuple, rank: int, size: int, timeout: float = 300.0):
        self._hub, self._group, self._rank, self._size = hub, group, rank, size
        self._timeout = float(timeout)
        self._splits = 0

    @classmethod
    def create(cls, n: int, *, timeout: float = 300.0) -> list["LocalCommunicator"]:
        """``n`` endpoints (ranks 0..n-1) of one new group. Raises ValueError if n < 1."""
        if n < 1:
            raise ValueError(f"a group needs at least one rank, got n={n}")
        hub = _Hub()
        return [cls(hub, ("world",), r, n, timeout) for r in range(n)]

    def _t(self, timeout):
        return self._timeout if timeout is None else timeout

    def __repr__(self):
        return f"LocalCommunicator(rank={self._rank}, size={self._size}, group={self._group})"

    # ---- point-to-point --------------------------------------------------------------------
    def _isend_part(self, x: Any, dest: int, tag: int, part: int, parts: int) -> Request:
        dest = self._check_peer(dest, "dest")
        arr = as_host_array(x)
        arr = arr.copy() if arr.base is not None or arr is x else arr  # buffered: own a copy
        h = Header.for_array(arr, tag, 0, part, parts)
        key = (self._group, self._rank, dest, int(tag))
        with self._hub.cond:
            self._hub.messages[key].append((h, arr))
            self._hub.match(key)
        return DoneRequest(None)

    def _post(self, source, tag, raw, device=None, sharding=None, out=None) -> Request:
        source = self._check_peer(source, "source")
        key = (self._group, source, self._rank, int(tag))
        req = _LocalRecv(self, key, raw, device, sharding, out)
        with self._hub.cond:
            self._hub.posted[key].append(req)
            self._hub.match(key)
        return req

    # ---- groups ----------------------------------------------------------------------------
    def split(self, color: int | None, key: int = 0, *, timeout: float | None = None
              ) -> "LocalCommunicator | None":
        if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"color must be an int >= 0 or None, got {color!r}")
        self._splits += 1
        mine = np.array([-1 if color is None else int(color), int(key)], np.int64)
        table = self.allgather(mine, timeout=timeout)
        if color is None:
            return None
        members = sorted((int(table[r, 1]), r) for r in range(self._size) if table[r, 0] == color)
        ranks = [r for _, r in members]
        group = self._group + ((self._splits, int(color)),)
        return LocalCommunicator(self._hub, group, ranks.index(self._rank), len(ranks), self._timeout)
