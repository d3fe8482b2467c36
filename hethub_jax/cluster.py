"""Islands and start-up of a multi-process job (DESIGN.md section 3).

Order on every rank (``join_job`` does 0, ``start`` 1-4, ``handshake`` 5):

0. after this rank's own checks: ``MPI_Init`` and the start-up gate, at which every rank says whether it
   failed before MPI started (then every rank raises ``StartFailed``), under a watchdog that ends a rank
   whose peers never start MPI (``$HETHUB_MPI_INIT_TIMEOUT_S``);

1. learn the island name from ``--island NAME`` or ``$HETHUB_ISLAND``, and its JAX platform from the
   caller (the plan), ``--platform``, ``$HETHUB_PLATFORM``, or the island name when it is a platform;
2. set ``JAX_PLATFORMS`` **before jax is imported** (``set_jax_platform``);
3. split ``MPI.COMM_WORLD`` by island (islands numbered in sorted name order, ranks in world order);
4. for an island of several processes: rank 0 of the island picks a free TCP port, broadcasts
   ``host:port``, and every process calls ``jax.distributed.initialize`` with that coordinator, the
   island size and its island rank (automatic cluster detection deactivated, so islands stay separate
   JAX runtimes). CPU islands use JAX's gloo CPU collectives so an island mesh spans its processes;
5. all ranks exchange a handshake record (config/plan hash, package versions, platform, island,
   local device count); rank 0 compares them and every rank raises ``HandshakeError`` with the same
   message naming the differing field and ranks.

``install_abort_on_exception`` turns any uncaught exception (main or other thread) into a
``[rank R, island X]`` traceback on stderr followed by ``MPI.COMM_WORLD.Abort(1)``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .comm.base import CommError, Communicator

__all__ = [
    "ENV_ISLAND", "ENV_PLATFORM", "HandshakeError", "Island", "island_from_args", "platform_for",
    "set_jax_platform", "start", "config_hash", "package_versions", "handshake_record",
    "compare_records", "handshake", "install_abort_on_exception", "join_job", "launcher_rank",
    "start_watchdog", "StartFailed", "MPI_INIT_TIMEOUT_S", "agree_errors", "SetUpFailed",
    "gather_texts",
]

ENV_ISLAND = "HETHUB_ISLAND"
ENV_PLATFORM = "HETHUB_PLATFORM"
JAX_PLATFORM_NAMES = ("cpu", "cuda", "rocm", "tpu", "gpu", "metal")
_NAME_BYTES = 64
_HANDSHAKE_TAG = 7001


class HandshakeError(CommError):
    """Ranks disagree at start-up (config/plan hash, versions, platform or device count).

    Raised with the same message on every rank; the abort hook lets rank 0 report it.
    """

    reported_by_rank0 = True


# ---- pure helpers ----------------------------------------------------------------------------
def _flag(argv: Sequence[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1:]
    return None


def island_from_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                     default: str | None = None) -> str:
    """Island name from ``--island NAME`` / ``--island=NAME`` in argv, else ``$HETHUB_ISLAND``.

    Raises:
      ValueError: no island given and no default, or the name is empty or longer than 64 bytes.
    """
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    name = _flag(argv, "--island") or environ.get(ENV_ISLAND) or default
    if not name:
        raise ValueError(f"no island given: pass --island NAME or set {ENV_ISLAND}")
    if len(name.encode()) > _NAME_BYTES:
        raise ValueError(f"island name longer than {_NAME_BYTES} bytes: {name!r}")
    return name


def platform_for(island: str, platform: str | None = None, argv: Sequence[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> str:
    """JAX platform of ``island``: ``platform`` (from the plan), else ``--platform``, else
    ``$HETHUB_PLATFORM``, else the island name itself when it is a JAX platform name.

    Raises:
      ValueError: none of these gives a platform.
    """
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    p = platform or _flag(argv, "--platform") or environ.get(ENV_PLATFORM)
    if not p and island in JAX_PLATFORM_NAMES:
        p = island
    if not p:
        raise ValueError(f"no JAX platform for island {island!r}: give it in the plan, with "
                         f"--platform or {ENV_PLATFORM}")
    return p


def set_jax_platform(platform: str, environ: Any = None) -> None:
    """Set ``JAX_PLATFORMS=platform`` for this process, before jax is imported.

    If jax is already imported, its configured platform must be ``platform`` already (or unset
    with no backend initialised yet, in which case it is updated).

    Raises:
      RuntimeError: jax was imported with a different platform, or already initialised a backend
        without one set.
    """
    environ = os.environ if environ is None else environ
    jax = sys.modules.get("jax")
    if jax is not None:
        current = jax.config.jax_platforms
        if current:
            if current.split(",")[0] != platform:
                raise RuntimeError(f"jax was imported with JAX_PLATFORMS={current!r} before the "
                                   f"island's platform {platform!r} could be set; set it first")
        else:
            if _jax_backends_initialised():
                raise RuntimeError("jax already initialised its backends without JAX_PLATFORMS; "
                                   f"cannot switch to platform {platform!r}")
            jax.config.update("jax_platforms", platform)
    environ["JAX_PLATFORMS"] = platform


def _jax_backends_initialised() -> bool:
    """Whether the imported jax has already created its backends (so its platform is fixed).

    Adapter over a private JAX name: JAX (0.10) has no public API that answers this without creating
    the backends (``jax.extend.backend.backends()`` creates them). This is the one place that reads
    ``jax._src.xla_bridge``; if the private name goes away, it answers False and the platform update
    below is left to JAX's own check.
    """
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - layout of a future JAX
        return False
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(probe()) if callable(probe) else bool(getattr(xla_bridge, "_backends", None))


def config_hash(*objs: Any) -> str:
    """SHA-256 hex digest of the objects as canonical JSON (sorted keys; non-JSON via str)."""
    blob = json.dumps(objs, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def package_versions(names: Sequence[str] = ("jax", "jaxlib", "flax", "optax", "hethub-jax")
                     ) -> dict[str, str]:
    """Installed versions (``"missing"`` when absent); hethub-jax falls back to its __version__."""
    out = {}
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            if n == "hethub-jax":
                from . import __version__

                out[n] = __version__
            else:
                out[n] = "missing"
    return out


def handshake_record(config_digest: str, island: str, platform: str, local_device_count: int,
                     versions: Mapping[str, str] | None = None, config: Mapping | None = None) -> dict:
    """What one rank contributes to the handshake (JSON-able). ``config`` (e.g. ``{"config": ...,
    "plan": ...}``) lets a hash mismatch name the first field that differs."""
    rec = {"config_hash": config_digest, "island": island, "platform": platform,
           "local_device_count": int(local_device_count),
           "versions": dict(package_versions() if versions is None else versions)}
    if config is not None:
        rec["config_fields"] = flatten_fields(config)
    return rec


def flatten_fields(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings/lists -> ``{"train.steps": 5, "plan.islands.0.name": "fast", ...}``."""
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flatten_fields(v, f"{prefix}{k}."))
    return out


def _first_difference(records: Sequence[Mapping]) -> str | None:
    """``config.train.steps: ranks [0] have 5; ranks [1] have 6`` for the first differing field."""
    if not all("config_fields" in r for r in records):
        return None
    keys: list[str] = []
    for r in records:
        keys += [k for k in r["config_fields"] if k not in keys]
    for k in keys:
        vals = [r["config_fields"].get(k, "<missing>") for r in records]
        if any(v != vals[0] for v in vals):
            return f"{k}: {_groups(vals, list(range(len(records))))}"
    return None


def _groups(values: Sequence[Any], ranks: Sequence[int]) -> str:
    by: dict[str, list[int]] = {}
    for v, r in zip(values, ranks):
        by.setdefault(json.dumps(v, sort_keys=True), []).append(r)
    return "; ".join(f"ranks {rs} have {v}" for v, rs in by.items())


def compare_records(records: Sequence[Mapping]) -> list[str]:
    """Problems among handshake records (index = world rank); empty when consistent.

    config_hash must be equal on all ranks; platform, local_device_count and versions must be equal
    within each island (versions may differ between islands with different installs).
    """
    problems = []
    ranks = list(range(len(records)))
    hashes = [r["config_hash"] for r in records]
    if len(set(hashes)) > 1:
        diff = _first_difference(records)
        problems.append(f"ranks run different configs/plans: {diff}" if diff
                        else f"config/plan hash differs: {_groups(hashes, ranks)}")
    islands: dict[str, list[int]] = {}
    for r, rec in enumerate(records):
        islands.setdefault(rec["island"], []).append(r)
    for name, members in sorted(islands.items()):
        for field in ("platform", "local_device_count", "versions"):
            vals = [records[r][field] for r in members]
            if any(v != vals[0] for v in vals):
                problems.append(f"{field} differs within island {name!r}: {_groups(vals, members)}")
    return problems


def handshake(world: Communicator, record: Mapping, *, timeout: float | None = None) -> list[dict]:
    """Collective over ``world``: gather every record on rank 0, compare, share the verdict.

    Returns all records (index = rank) on every rank.

    Raises:
      HandshakeError: on every rank, with one message listing what differs and on which ranks.
      CommTimeoutError: a rank did not take part within ``timeout`` seconds.
    """
    mine = np.frombuffer(json.dumps(dict(record), sort_keys=True).encode(), np.uint8)
    if world.rank == 0:
        blobs = [mine] + [world.recv(r, _HANDSHAKE_TAG, timeout=timeout)
                          for r in range(1, world.size)]
        records = [json.loads(bytes(b)) for b in blobs]
        problems = compare_records(records)
        verdict = {"problems": problems, "records": records}
        out = np.frombuffer(json.dumps(verdict).encode(), np.uint8)
        reqs = [world.isend(out, r, _HANDSHAKE_TAG) for r in range(1, world.size)]
        for q in reqs:
            q.wait(timeout)
    else:
        world.send(mine, 0, _HANDSHAKE_TAG, timeout=timeout)
        verdict = json.loads(bytes(world.recv(0, _HANDSHAKE_TAG, timeout=timeout)))
    if verdict["problems"]:
        raise HandshakeError("start-up handshake failed: " + " | ".join(verdict["problems"]))
    return verdict["records"]


# ---- start-up under MPI ----------------------------------------------------------------------
#: seconds a rank waits for every rank of the job to start MPI and report at the start-up gate
#: (``$HETHUB_MPI_INIT_TIMEOUT_S`` overrides it)
MPI_INIT_TIMEOUT_S = 120.0
ENV_MPI_INIT_TIMEOUT = "HETHUB_MPI_INIT_TIMEOUT_S"
_GATE_BYTES = 512  # per rank at the gate: 1 status byte + the start of its error message (UTF-8)
_joined: int | None = None  # this process's world rank once it passed the gate


class StartFailed(Exception):
    """Some ranks of the job failed before MPI started (``join_job``); raised on every rank after the
    start-up gate, with ``failed`` = ``{world rank: its error (first 511 bytes)}``, ``rank`` (this
    process's world rank) and ``size`` (the job's ranks)."""

    def __init__(self, failed: Mapping[int, str], rank: int = 0, size: int = 1):
        self.failed, self.rank, self.size = dict(failed), rank, size
        super().__init__("; ".join(f"rank {r} failed before MPI started: {m}" for r, m in self.failed.items()))


def launcher_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's MPI rank read from the launcher's environment (MPICH/hydra ``PMI_RANK``, Open MPI
    ``OMPI_COMM_WORLD_RANK``, PMIx ``PMIX_RANK``, SLURM ``SLURM_PROCID``), without starting MPI; None
    when there is none."""
    from .rank_guard import launcher_rank as rank_text

    r = rank_text(environ)
    return int(r) if r.isdigit() else None


def join_job(error: str | None = None) -> int:
    """Start MPI (``MPI_Init``, which waits for every rank of the job) and pass the start-up gate: a
    collective over ``COMM_WORLD`` at which every rank says whether it failed before starting MPI
    (``error``: its message; ``None``: it is fine). Every rank calls it exactly once, right after its
    own checks and before any work that writes files; later calls return at once. A rank that failed
    before MPI therefore ends the whole job within seconds, and its peers do nothing in the meantime.

    The wait for MPI and the gate runs under ``start_watchdog``: if a rank never starts MPI (it died
    before reaching this function), this rank ends after ``$HETHUB_MPI_INIT_TIMEOUT_S`` seconds.

    Returns:
      This process's world rank (every rank passed the gate without error).
    Raises:
      StartFailed: on every rank, when at least one rank reported an error (``error`` given here
        included).
    """
    global _joined
    if _joined is not None:
        return _joined
    with start_watchdog():
        from mpi4py import MPI  # MPI_Init

        comm = MPI.COMM_WORLD
        # no deadline of its own: the watchdog's applies, and the poll sleeps (no core spins)
        failed = _gather_errors(comm, error, _GATE_BYTES, deadline=None, what="")
    if failed:
        raise StartFailed(failed, comm.Get_rank(), comm.Get_size())
    _joined = comm.Get_rank()
    return _joined


def _gather_errors(comm, error: str | None, nbytes: int, deadline: float | None, what: str) -> dict[int, str]:
    """Allgathers one fixed ``nbytes`` record per rank (1 status byte + the start of ``error``, UTF-8,
    cut to ``nbytes - 1`` bytes; ``None``: no error) and returns ``{world rank: its error}`` of the ranks
    that gave one. Polls the non-blocking allgather with a 5 ms sleep, so no core spins while a peer is
    busy.

    Raises:
      TimeoutError: ``deadline`` (``time.monotonic()`` seconds; ``None``: no deadline here) passed before
        every rank answered; ``what`` names the point in the message.
    """
    from mpi4py import MPI

    mine = np.zeros(nbytes, np.uint8)
    if error is not None:
        raw = error.encode()[:nbytes - 1]
        mine[0], mine[1:1 + len(raw)] = 1, np.frombuffer(raw, np.uint8)
    table = np.zeros((comm.Get_size(), nbytes), np.uint8)
    req = comm.Iallgather([mine, MPI.BYTE], [table, MPI.BYTE])
    while not req.Test():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"rank {comm.Get_rank()}: no answer from every rank at {what} "
                               "(a rank died or hangs)")
        time.sleep(0.005)
    return {r: bytes(row[1:]).rstrip(b"\0").decode(errors="replace") for r, row in enumerate(table) if row[0]}


_AGREE_BYTES = 2048  # per rank at an agreement point: 1 status byte + the start of its error (UTF-8)


class SetUpFailed(Exception):
    """Some ranks found an error at an agreement point (``agree_errors``); raised on every rank with
    ``failed`` = ``{world rank: its error}``, ``rank`` and ``size`` as :class:`StartFailed`."""

    def __init__(self, failed: Mapping[int, str], rank: int, size: int):
        self.failed, self.rank, self.size = dict(failed), rank, size
        super().__init__("; ".join(f"rank {r}: {m}" for r, m in sorted(self.failed.items())))

    def first_rank_of_own_error(self) -> bool:
        """True when this rank failed and no lower rank failed with the same message: the rank that
        prints it (each distinct error once, by the lowest rank that found it)."""
        mine = self.failed.get(self.rank)
        return mine is not None and min(r for r, m in self.failed.items() if m == mine) == self.rank

    def same_on(self) -> list[int]:
        """The other ranks that failed with this rank's message."""
        mine = self.failed.get(self.rank)
        return [r for r, m in sorted(self.failed.items()) if m == mine and r != self.rank]


def agree_errors(error: str | None, timeout: float, comm: Any = None) -> None:
    """An agreement point after MPI started: a collective over ``MPI.COMM_WORLD`` (an allgather of a
    fixed ``2048``-byte record per rank) at which every rank says whether its set-up step failed
    (``error``: its message, cut to 2047 UTF-8 bytes; ``None``: it is fine). Every rank of the job must
    call it at the same points, in the same order, with no other collective in between that only some
    ranks reach. Returns when no rank failed. ``comm``: a duplicate of ``MPI.COMM_WORLD`` (same ranks) to
    agree on instead, so that a rank failing between the collectives of a step on ``COMM_WORLD`` cannot
    match its agreement with a peer's pending collective there (None: ``COMM_WORLD``).

    Raises:
      SetUpFailed: on every rank, when at least one rank gave an error.
      TimeoutError: a rank did not arrive within ``timeout`` seconds (it died or hangs; the caller's
        uncaught-exception hook then aborts the job instead of waiting forever).
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    failed = _gather_errors(comm, error, _AGREE_BYTES, deadline=time.monotonic() + timeout,
                            what=f"a set-up agreement point within {timeout:g} s")
    if failed:
        raise SetUpFailed(failed, comm.Get_rank(), comm.Get_size())


def gather_texts(text: str, timeout: float, what: str = "an agreement point") -> dict[int, str]:
    """Every rank's ``text`` after MPI started: ``{world rank: its text}`` on every rank, through the
    same fixed-size allgather over ``MPI.COMM_WORLD`` as :func:`agree_errors` (``text`` cut to 2047 UTF-8
    bytes), so that the ranks can check that they reached the same decision (e.g. train's check that the
    newest checkpoint already reaches ``train.steps``). Every rank must call it at the same point.

    Raises:
      TimeoutError: a rank did not arrive within ``timeout`` seconds (``what`` names the point).
    """
    from mpi4py import MPI

    return _gather_errors(MPI.COMM_WORLD, text, _AGREE_BYTES, deadline=time.monotonic() + timeout,
                          what=f"{what} within {timeout:g} s")


_WATCHDOG_CHILD = r"""
import os, select, signal, sys, time
pid, t, msg = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if select.select([sys.stdin], [], [], t)[0]:
    sys.exit(0)  # the pipe closed: MPI started (or the watched process ended)
sys.stderr.write(msg + "\n")
sys.stderr.flush()
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.kill(pid, sig)
    except OSError:
        break
    time.sleep(2.0)
"""


class start_watchdog:
    """Context manager around ``MPI_Init`` and the start-up gate: if they have not finished within
    ``$HETHUB_MPI_INIT_TIMEOUT_S`` seconds (default ``MPI_INIT_TIMEOUT_S``: another rank ended before
    it started MPI, e.g. a Python error or a wrong command in its part of the ``mpiexec`` line), print
    one line naming this rank and the variable, then end this process (SIGTERM, SIGKILL 2 s later).

    A child process keeps the time, because mpi4py's ``MPI_Init`` holds the interpreter lock (no
    Python thread or signal handler runs during it). The child exits as soon as the context ends
    (the pipe to it closes) or this process dies. ``prefix`` starts the line (the program's name).
    """

    def __init__(self, prefix: str = "python -m hethub_jax.train: error: "):
        self.prefix = prefix

    def __enter__(self):
        import subprocess

        t = float(os.environ.get(ENV_MPI_INIT_TIMEOUT, MPI_INIT_TIMEOUT_S))
        r = launcher_rank()
        who = f"rank {r}" if r is not None else "this rank"
        msg = (f"{self.prefix}{who}: MPI did not start within {t:g} s (${ENV_MPI_INIT_TIMEOUT}): another rank "
               f"of the job ended before starting MPI (see its output: a Python error, a wrong command or "
               f"path in its part of the mpiexec line) or never started; ending {who}")
        self.child = subprocess.Popen([sys.executable, "-S", "-c", _WATCHDOG_CHILD, str(os.getpid()), str(t), msg],
                                      stdin=subprocess.PIPE)
        return self

    def __exit__(self, *exc):
        self.child.stdin.close()
        try:
            self.child.wait(timeout=10)
        except Exception:  # noqa: BLE001 - never let the watchdog's clean-up hide the real outcome
            pass
        return False


@dataclass
class Island:
    """This process's place in the job.

    Attributes:
      name, platform: island name and its JAX platform.
      names: all island names (sorted); ``index`` is this island's position.
      world: MPIHostBridge over all ranks; ``comm``: over this island's ranks.
      world_ranks: world ranks of this island's processes, in island-rank order.
      coordinator: ``host:port`` of the island's jax.distributed coordinator (None: one process).
    """

    name: str
    platform: str
    index: int
    names: tuple[str, ...]
    world: Any
    comm: Any
    world_ranks: tuple[int, ...]
    coordinator: str | None

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size


def _strings(comm: Communicator, s: str, timeout) -> list[str]:
    buf = np.zeros(_NAME_BYTES, np.uint8)
    raw = s.encode()[:_NAME_BYTES]
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    table = comm.allgather(buf, timeout=timeout)
    return [bytes(row).rstrip(b"\0").decode() for row in table]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start(island: str | None = None, platform: str | None = None, *, argv: Sequence[str] | None = None,
          environ: Any = None, mpi_comm: Any = None, timeout: float = 300.0,
          coordinator_host: str | None = None, initialize_distributed: bool = True,
          chunk_bytes: int | None = None) -> Island:
    """Steps 1-4 of the module docstring. Collective over ``mpi_comm`` (default COMM_WORLD).

    Args:
      island, platform: override the flag/environment look-up.
      timeout: deadline in seconds for the communicator calls and jax.distributed start-up.
      coordinator_host: host name/IP of the island's coordinator; default 127.0.0.1 when all the
        island's processes share a host, else the address of island rank 0's host name.
      initialize_distributed: call jax.distributed.initialize for islands of several processes.

    Raises:
      ValueError: no island or platform. RuntimeError: jax imported with another platform.
      CommTimeoutError: a rank did not arrive within ``timeout`` seconds.
    """
    environ = os.environ if environ is None else environ
    name = island_from_args(argv, environ) if island is None else island
    plat = platform_for(name, platform, argv, environ)
    set_jax_platform(plat, environ)

    from mpi4py import MPI

    from .comm.mpi import DEFAULT_CHUNK_BYTES, MPIHostBridge

    world = MPIHostBridge(MPI.COMM_WORLD if mpi_comm is None else mpi_comm, timeout=timeout,
                          chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES)
    all_names = _strings(world, name, timeout)
    names = tuple(sorted(set(all_names)))
    index = names.index(name)
    comm = world.split(index, world.rank, timeout=timeout)
    world_ranks = tuple(r for r, n in enumerate(all_names) if n == name)
    coordinator = None
    if comm.size > 1:
        hosts = _strings(comm, socket.gethostname(), timeout)
        if comm.rank == 0:
            host = coordinator_host or ("127.0.0.1" if len(set(hosts)) == 1
                                        else socket.gethostbyname(socket.gethostname()))
            addr = f"{host}:{_free_port()}"
        else:
            addr = ""
        coordinator = _strings(comm, addr, timeout)[0]
        if initialize_distributed:
            import jax

            if plat == "cpu":
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=comm.size,
                                       process_id=comm.rank, cluster_detection_method="deactivate",
                                       initialization_timeout=int(timeout))
    return Island(name, plat, index, names, world, comm, world_ranks, coordinator)


#: seconds between printing a rank's error and aborting the job (lets mpiexec forward the message)
ABORT_GRACE_S = 1.0


def install_abort_on_exception(rank: int | None = None, island: str | None = None,
                               stream: Any = None) -> None:
    """Make an uncaught exception on this rank (any thread) end the whole MPI job.

    The hook prints ``[rank R, island X] <traceback>`` to stderr (``stream``) and calls
    ``MPI.COMM_WORLD.Abort(1)`` ``ABORT_GRACE_S`` seconds later, which makes mpiexec end every rank
    with a non-zero status.
    ``rank`` defaults to the world rank, ``island`` to ``$HETHUB_ISLAND`` / ``--island``.
    """
    from mpi4py import MPI

    r = MPI.COMM_WORLD.Get_rank() if rank is None else rank
    if island is None:
        island = _flag(sys.argv[1:], "--island") or os.environ.get(ENV_ISLAND) or "?"
    prefix = f"[rank {r}, island {island}] "

    def hook(exc_type, exc, tb):
        out = stream or sys.stderr
        if r != 0 and getattr(exc, "reported_by_rank0", False):
            time.sleep(5)  # the same error is raised on rank 0, whose abort normally ends us first
        try:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            out.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
            out.flush()
            sys.stdout.flush()
            # Give the launcher a moment to forward what was written: Abort kills the job's
            # processes, and output still in flight to mpiexec would be lost (seen in CI).
            time.sleep(ABORT_GRACE_S)
        finally:
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
    threading.excepthook = lambda a: hook(a.exc_type, a.exc_value, a.exc_traceback)
