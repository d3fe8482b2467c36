"""A steady host allocator for CPU islands: no ``mmap``/``munmap`` churn of XLA's large buffers.

Why (measured, docs/benchmarks.md "Predictor accuracy", issue 13): XLA:CPU allocates each call's
temporary and output buffers with the C library's ``malloc``. glibc serves a block above its mmap
threshold (128 KiB, raised after frees up to a 32 MiB ceiling) with a fresh ``mmap``, returns it with
``munmap`` on free, and gives the top of the heap back to the kernel above its trim threshold; such
a block is faulted in again, page by page, on the next call. On the tiny model (32000 x 64 tied
embedding, sequences of 64) with glibc's defaults, a last stage's fused forward + backward took about
8,300 minor page faults per call at microbatch 2 and 16,600-17,600 at microbatch 4 (its logits are
16-33 MB; 0-30 at microbatch 1), in a process running one stage at a time; with the threshold no
longer adapting (as after any ``mallopt``), also microbatch 1 faulted (about 7,100 per call; a first
stage's backward about 2,200). Which calls fault thus depends on the sizes the process allocated and
freed before -- in a pipeline, on the other stages -- so a call's cost was not a property of the call;
in a VM each fault is costly: a 3-layer last stage at microbatch 4 took 90-100 ms with the faults
against 44-46 ms without them (two processes a minute apart, load 5). With the settings below those
calls took 0-30 faults and 0.50-0.79x the time (one process alternating the settings with ``mallopt``,
its "default" side with a fixed 128 KiB threshold).

What :func:`steady_host_allocator` sets (glibc ``mallopt(3)``): ``M_MMAP_MAX = 0`` (every block
from the heap, none mmapped), ``M_TRIM_THRESHOLD = -1`` (never: the heap's free top is kept whatever its size) and
``M_ARENA_MAX = 1`` (every thread allocates from the main heap). The process keeps its peak host
memory instead of returning it to the kernel between calls: the cost. With one arena the peak itself is higher
for calls of varied large shapes: the profile of ``benchmarks/hetero_e2e.py``'s 15 M model at microbatch
16, 32 and 64 peaked at 10.3 GiB RSS against 4.7 GiB with glibc's defaults (measured 2026-12-03;
``malloc_trim`` between shapes did not lower it); set ``HETHUB_HOST_ALLOCATOR=default`` where host
memory, not speed, is the limit.

Why no trim threshold at all (measured, session 18, ``benchmarks/fused_call_gap.py``, docs/benchmarks.md issue 17):
until then ``M_TRIM_THRESHOLD`` was 1 GiB, and a call whose block, with what was free beside it at the heap's
top, passed 1 GiB gave it back to the kernel at its ``free``; the next call of that size faulted it in afresh.
The 15 M model of ``benchmarks/hetero_e2e.py`` as one stage at microbatch 32 needs 967 MiB of XLA temporaries
for the fused forward + backward and 1,053 MiB for the fused forward + backward + update of a one-stage 1F1B
step's last microbatch (``memory_analysis``): the update program alone passes 1 GiB, so such a step trimmed
and faulted 247,000-270,000 pages per call, about +0.8-1.3 s of CPU on a 4.0-4.4 s call (one pinned core,
LOADED machine, one process); with trimming off, 0 faults per call after the first step. Whether a call faulted
depended on the heap's layout (the same profile call: 0 or 247,566 faults), so the profile and the runtime
could disagree on one call's cost. Memory: the heap keeps its largest free top as it keeps its holes;
:func:`release_free_host_memory` gives both back between phases.

A fixed mmap threshold as the middle way (measured, session 13, ``benchmarks/host_allocator_rss.py``,
docs/benchmarks.md issue 17 "Host allocator variants"): the tiny model as one stage, the profiler's four
calls at microbatch 4, 8 and 16 (sequence 64), twice over the sizes, one child process per variant on a
loaded shared machine (times not comparable, faults and RSS are). Peak RSS: steady 2.00-2.32 GiB, glibc's
defaults 1.24 GiB; with the steady settings plus ``M_MMAP_THRESHOLD`` 256 MiB 1.62-1.80 GiB, but the
fused forward + backward at microbatch 16 (its block over 256 MiB) then faulted 77,808 pages (304 MiB)
on every call (about 0.12 s of CPU at 1.5 us a fault, against a 0.41 s call); at 64 MiB 1.50 GiB, and
19,000-78,000 faults on most calls at every size; ``M_TRIM_THRESHOLD`` 256 MiB 2.15 GiB with the same
77,808 faults per large call. The peak falls by exactly the blocks that then fault on every use: no
setting lowered the peak without faults, so the default stays. ``HETHUB_HOST_ALLOCATOR_MMAP_MIB=N`` opts
in to the threshold (blocks of N MiB and more mmapped, the rest as steady) where host memory is short:
choose N above the blocks of the calls that dominate the step.

Why ``M_ARENA_MAX`` too (measured, docs/benchmarks.md issue 17, session 12): XLA:CPU runs a call on
its own threads, and glibc gives such a thread its own arena, whose heaps are at most 64 MiB
(``HEAP_MAX_SIZE``); a larger block there is mmapped whatever ``M_MMAP_MAX`` says (``sysmalloc``'s
fallback) and munmapped on free. On the 15 M model of ``benchmarks/hetero_e2e.py`` (logits of a
microbatch of 8 x 64 tokens: 65.5 MB) every whole-model backward then faulted 37,265 pages (146 MB)
and the 6th forward of a GPipe step another ~40,000, about 315,000 faults a step; with one arena,
none (a GPipe step took 0.95x and the fused forward + backward 0.88x the time;
``benchmarks/stage_shape_vs_run.py``). A thread keeps the arena it first allocated from, so the
setting covers only threads that allocate after it: call
this before the JAX backend starts (before the first ``jax.devices()``), as the profiler,
``hethub_jax.train`` (for CPU islands) and the benchmarks' pinned ranks do; ``PipelineRuntime`` calls
it again (too late for the arena, harmless). The result's ``backend_started`` says when a call came
after the backend had started.

Also (issue 13, the same setting): islands
run as threads (``benchmarks/predictor_accuracy.py``) and XLA:CPU computes on worker threads; glibc
gives each new thread an arena of its own (up to 8 per core), and a secondary arena grows by separate
64 MiB heaps, each deleted (unmapped) as soon as it is entirely free, whatever the trim threshold
(glibc ``arena.c`` ``heap_trim``): with two threads each using two 40 MiB blocks, every page of the
second use faulted again under the first two settings alone (20,480 of 20,480 pages), none with one
arena (tests/test_host_allocator.py). In the two-island benchmark that was 1,600-37,000 minor faults
per step (e.g. 37,357 at microbatch 4, quiet run of 2026-12-02), at about 1.5 us of CPU each on this
VM (a fresh page touched, measured), none of which the one-island profile sees. One arena serialises
the threads' ``malloc`` calls on its lock, which is NOT negligible for islands as threads of one process
(measured nearly quiet, docs/benchmarks.md issue 13 session 13: the two-island pipeline's first-stage calls took
1.35-1.5x their time with 16 arenas or with the islands as two processes, with 1.6-1.7x the voluntary context
switches); separate processes (``hethub_jax.train`` under mpiexec) each have their own arena and lock.
``M_ARENA_MAX`` takes effect for threads that have not allocated yet (a thread that already has an
arena keeps it): set it at the process's start (``benchmarks/predictor_accuracy.py`` does at import,
the profiler before JAX starts its threads; ``PipelineRuntime`` sets it when it is built, by which
time earlier threads may hold arenas of their own).

Only glibc has ``mallopt``; elsewhere nothing is changed (and the result says so). Set the
environment variable ``HETHUB_HOST_ALLOCATOR=default`` to leave the C library's defaults, or
``HETHUB_HOST_ALLOCATOR_MMAP_MIB=N`` for the steady settings with blocks of N MiB and more mmapped.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import threading
from typing import Dict, Optional

__all__ = ["steady_host_allocator", "current", "ENV", "ENV_MMAP_MIB", "M_MMAP_MAX", "M_TRIM_THRESHOLD",
           "M_ARENA_MAX", "M_MMAP_THRESHOLD", "TRIM_THRESHOLD", "ARENA_MAX", "mmap_threshold_mib"]

#: environment variable: ``default`` leaves the C library's allocator settings alone
ENV = "HETHUB_HOST_ALLOCATOR"
#: environment variable: N > 0 (MiB) keeps the steady settings but serves blocks of N MiB and more with
#: ``mmap`` again (``M_MMAP_THRESHOLD``; unset or 0: none mmapped, the default): lower peak memory, and
#: every call using such a block faults its pages in again (module docstring, measured)
ENV_MMAP_MIB = "HETHUB_HOST_ALLOCATOR_MMAP_MIB"
#: glibc ``mallopt`` parameter numbers (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -3, -4, -8
#: the arena count set: one (the main heap, which obeys ``M_MMAP_MAX``; glibc's default is 8 per core)
ARENA_MAX = 1
#: the trim threshold set: -1, which glibc reads as the largest size (``mallopt(3)``: "Setting M_TRIM_THRESHOLD
#: to -1 disables trimming completely"): the heap's free top stays with the process whatever its size, until
#: :func:`release_free_host_memory` (before session 18: 1 GiB, and a larger free top -- a call's block over 1 GiB
#: with what was free beside it -- was given back at every ``free`` and faulted in again by the next call)
TRIM_THRESHOLD = -1

_lock = threading.Lock()
_state: Dict[str, object] = {}


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    """The C library when it is glibc (has ``mallopt`` and ``gnu_get_libc_version``), else None; looked up once."""
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    return lib if hasattr(lib, "mallopt") and hasattr(lib, "gnu_get_libc_version") else None


def mmap_threshold_mib() -> int:
    """The opt-in mmap threshold from :data:`ENV_MMAP_MIB` (MiB; 0 when unset: no block mmapped).

    Raises:
      ValueError: the variable is set to something other than a whole number >= 0.
    """
    raw = os.environ.get(ENV_MMAP_MIB, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"${ENV_MMAP_MIB} must be a whole number of MiB >= 0 (0: no block mmapped), got {raw!r}")
    return int(raw)


def steady_host_allocator(enable: Optional[bool] = None) -> Dict[str, object]:
    """Sets the C library's allocator so that large blocks are neither mmapped nor trimmed (module
    docstring: why). Idempotent and thread-safe; call it early in a process that runs CPU islands
    (``PipelineRuntime`` does for CPU stages, the profiler and ``benchmarks/predictor_accuracy.py``
    at start).

    Args:
      enable: True sets the steady settings; False leaves glibc's own settings when this process
        never set them, else sets glibc's default values back (``M_MMAP_MAX`` 65536,
        ``M_TRIM_THRESHOLD`` 128 KiB, ``M_ARENA_MAX`` 8 per core as glibc computes it on 64-bit
        systems; glibc's adaptive threshold does not come back); None
        (default): steady unless the environment variable :data:`ENV` is ``default``.

    With :data:`ENV_MMAP_MIB` set to N > 0 the steady settings serve blocks of N MiB and more with
    ``mmap`` (``M_MMAP_MAX`` 65536, ``M_MMAP_THRESHOLD`` N MiB): ``allocator`` is then
    ``"steady-mmapN"``.

    Returns:
      ``{"allocator": "steady" | "steady-mmapN" | "default", "applied": bool, "reason": str}``: which settings are in
      force, whether this call changed them (False when they were already in force), and what was set
      (not glibc, or ``mallopt`` refused: ``applied`` False and ``allocator`` ``"default"``); when this
      call set them, also ``"backend_started": bool`` (True: the JAX backend had started before, so
      its threads may keep arenas of their own and ``M_ARENA_MAX`` does not reach them).
    """
    if enable is None:
        enable = os.environ.get(ENV, "steady").strip().lower() != "default"
    mib = mmap_threshold_mib() if enable else 0
    want = ("steady" if not mib else f"steady-mmap{mib}") if enable else "default"
    with _lock:
        if _state.get("allocator", "default") == want:
            return dict(_state, allocator=want, applied=False, reason=_state.get("reason", "glibc's own settings"))
        lib = _libc()
        if lib is None:
            return {"allocator": "default", "applied": False, "reason": "not glibc: mallopt unavailable"}
        mmap_max = 0 if enable and not mib else 65536
        ok = (lib.mallopt(M_MMAP_MAX, mmap_max) == 1
              and lib.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD if enable else 128 * 1024) == 1
              and lib.mallopt(M_ARENA_MAX, ARENA_MAX if enable else _default_arena_max()) == 1
              and (not mib or lib.mallopt(M_MMAP_THRESHOLD, mib << 20) == 1))
        if not ok:
            return {"allocator": "default", "applied": False, "reason": "mallopt refused the settings"}
        if not enable and hasattr(lib, "malloc_trim"):
            lib.malloc_trim(0)
        lib.gnu_get_libc_version.restype = ctypes.c_char_p
        _state.update(allocator=want, reason=f"glibc {lib.gnu_get_libc_version().decode()} mallopt: M_MMAP_MAX "
                                             f"{mmap_max}, M_TRIM_THRESHOLD "
                                             f"{str(TRIM_THRESHOLD) + ' (never)' if enable else 128 * 1024}, M_ARENA_MAX "
                                             f"{ARENA_MAX if enable else _default_arena_max()}"
                                             + (f", M_MMAP_THRESHOLD {mib << 20} (${ENV_MMAP_MIB}={mib})" if mib else ""))
        return dict(_state, applied=True, backend_started=_jax_backend_started())


def release_free_host_memory() -> bool:
    """Gives the free pages of the C library's heap back to the kernel (glibc ``malloc_trim(0)``: the
    free top above the pad and, since glibc 2.8, every whole free page inside the heap, with
    ``madvise(MADV_DONTNEED)``): the process's resident memory falls to what is live, while the heap's
    address space (and its fragmentation) stays. Under the steady settings the heap otherwise keeps its
    peak resident (its free top, whatever its size (:data:`TRIM_THRESHOLD`), and every hole inside it), and a phase
    whose blocks do not fit those holes adds its own ON TOP of the earlier peak (measured, session 16,
    docs/benchmarks.md issue 17: the profiler's chunked measurement after its whole-model stage shapes,
    15 M model at microbatch 1-16: 2,241 MiB resident before it, of which ``malloc_trim`` gave back 1,901
    MiB; without it the measurement took the process to 2,933 MiB, with it to 2,304 MiB). The next calls fault the
    released pages in again once: call it between phases, never inside a timed loop. Returns True when
    it ran (glibc), False elsewhere."""
    lib = _libc()
    if lib is None or not hasattr(lib, "malloc_trim"):
        return False
    lib.malloc_trim(0)
    return True


def _default_arena_max() -> int:
    """glibc's own arena limit on a 64-bit system, 8 per core (``NARENAS_FROM_NCORES``; ``mallopt``
    takes no 0 for "default")."""
    return 8 * (os.cpu_count() or 1)


def _jax_backend_started() -> bool:
    """True when this process's JAX backend has started (its threads may hold arenas of their own;
    see the module docstring); False when JAX is not imported or no backend exists yet."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(getattr(xla_bridge, "_backends", None))
    except Exception:  # a JAX without this private module: unknown, say started (the cautious answer)
        return True



def current() -> str:
    """``"steady"``, ``"steady-mmapN"`` or ``"default"``: what :func:`steady_host_allocator` last set in
    this process."""
    return str(_state.get("allocator", "default"))
