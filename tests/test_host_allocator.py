"""hethub_jax.host_allocator: glibc settings under which large blocks are reused, not re-faulted.

Checked against an independent measurement: the kernel's count of minor page faults (``getrusage``)
when a 64 MiB block (C ``malloc``, as XLA:CPU allocates) is freed and allocated again, in fresh
processes (glibc's own defaults apply only before any ``mallopt``). With glibc's defaults a block that large (over its 32 MiB mmap threshold
ceiling) is mmapped afresh and every page faults again (~16,000 4-KiB pages); with the steady settings
the second allocation reuses the heap's pages. With two threads (islands as threads, XLA:CPU's worker
threads), glibc's per-thread arenas grow by separate heaps that are unmapped once free, whatever the
trim threshold: the steady settings keep one arena, and the second use faults in almost none."""
import json
import os
import subprocess
import sys

import pytest

from hethub_jax import host_allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import ctypes, json, resource, sys
from hethub_jax import host_allocator
info = host_allocator.steady_host_allocator() if sys.argv[1] == "steady" else {"allocator": "untouched"}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 64 << 20
flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def use(value):  # malloc, touch every byte, free: what XLA:CPU does with a call's buffers
    p = libc.malloc(n)
    ctypes.memset(p, value, n)
    libc.free(p)
use(1)                                                # first use: faults either way
f0 = flt()
use(2)                                                # second use of a block of the same size
print(json.dumps({"faults": flt() - f0, "pages": n // resource.getpagesize(), "info": info}))
"""


def _second_use_faults(mode):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop(host_allocator.ENV, None)
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_allocator._libc() is None, reason="glibc only")
def test_steady_allocator_reuses_pages():
    default, steady = _second_use_faults("default"), _second_use_faults("steady")
    assert steady["info"]["allocator"] == "steady" and steady["info"]["applied"]
    # glibc defaults: the second 64 MiB block is a fresh mmap, every page faults again
    assert default["faults"] > 0.8 * default["pages"]
    # steady: the heap keeps the pages; the second use faults in almost none of them
    assert steady["faults"] < 0.05 * steady["pages"]


def test_idempotent_and_env_opt_out(monkeypatch):
    if host_allocator._libc() is None:
        pytest.skip("glibc only")
    first = host_allocator.steady_host_allocator(True)
    again = host_allocator.steady_host_allocator(True)
    assert first["allocator"] == again["allocator"] == "steady" and not again["applied"]
    assert host_allocator.current() == "steady"
    monkeypatch.setenv(host_allocator.ENV, "default")
    assert host_allocator.steady_host_allocator()["allocator"] == "default"  # the opt-out restores glibc's
    assert host_allocator.current() == "default"
    monkeypatch.delenv(host_allocator.ENV)
    assert host_allocator.steady_host_allocator()["allocator"] == "steady"


_THREADS_CHILD = r"""
import ctypes, json, resource, sys, threading
from hethub_jax import host_allocator
info = host_allocator.steady_host_allocator() if sys.argv[1] == "steady" else {"allocator": "untouched"}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 40 << 20
flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def use(value):  # two blocks at once, touched, freed: one call's buffers
    ps = [libc.malloc(n) for _ in range(2)]
    for p in ps:
        ctypes.memset(p, value, n)
    for p in ps:
        libc.free(p)
bar, out = threading.Barrier(2), {}

def body(i):
    use(1)          # first use in this thread: faults either way
    bar.wait()
    if i == 0:
        out["f0"] = flt()
    bar.wait()
    use(2)          # second use, both threads
    bar.wait()
    if i == 0:
        out["faults"] = flt() - out["f0"]
threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({"faults": out["faults"], "pages": 2 * 2 * n // resource.getpagesize(), "info": info}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_allocator._libc() is None, reason="glibc only")
def test_steady_allocator_two_threads_reuse_pages():
    """Two threads each allocating two 40 MiB blocks twice: with glibc's defaults (per-thread arenas) the
    second use faults again; with the steady settings (one arena, M_ARENA_MAX 1) almost no page does."""
    def run(mode):
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop(host_allocator.ENV, None)
        out = subprocess.run([sys.executable, "-c", _THREADS_CHILD, mode], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    default, steady = run("default"), run("steady")
    assert "M_ARENA_MAX 1" in steady["info"]["reason"]
    assert default["faults"] > 0.4 * default["pages"]  # at least one thread's blocks faulted in again
    assert steady["faults"] < 0.05 * steady["pages"]


_THREAD_CHILD = r"""
import ctypes, json, resource, sys, threading
from hethub_jax import host_allocator
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 80 << 20                                          # over glibc's 64 MiB per-thread heap (HEAP_MAX_SIZE)
flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
mode, out = sys.argv[1], {}

def use(value):
    p = libc.malloc(n)
    ctypes.memset(p, value, n)
    libc.free(p)

def worker():                                         # a thread other than the main one, as XLA:CPU's are
    use(1)
    f0 = flt()
    use(2)
    out["faults"] = flt() - f0

out["info"] = host_allocator.steady_host_allocator()
if mode == "steady_without_arena_max":                # the settings before session 12: one arena per thread
    libc.mallopt(host_allocator.M_ARENA_MAX, host_allocator._default_arena_max())
t = threading.Thread(target=worker)
t.start()
t.join()
print(json.dumps(dict(out, pages=n // resource.getpagesize())))
"""


def _thread_faults(mode):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop(host_allocator.ENV, None)
    env.pop("MALLOC_ARENA_MAX", None)
    out = subprocess.run([sys.executable, "-c", _THREAD_CHILD, mode], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_allocator._libc() is None, reason="glibc only")
def test_steady_allocator_reuses_pages_in_other_threads():
    """A block over 64 MiB freed and allocated again in a thread other than the main one (XLA:CPU runs
    calls on its own threads): with one arena per thread (glibc's default, kept by the settings before
    session 12) the thread's arena cannot hold it and mmaps it afresh, so every page faults again; with
    ``M_ARENA_MAX = 1`` the thread uses the main heap and reuses its pages."""
    old, new = _thread_faults("steady_without_arena_max"), _thread_faults("steady")
    assert new["info"]["allocator"] == "steady" and "M_ARENA_MAX 1" in new["info"]["reason"]
    assert old["faults"] > 0.8 * old["pages"]
    assert new["faults"] < 0.05 * new["pages"]


_SIZES_CHILD = r"""
import ctypes, json, resource, sys
from hethub_jax import host_allocator
info = host_allocator.steady_host_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = {"info": info}
for mib in (16, 64):
    n = mib << 20
    def use(value):
        p = libc.malloc(n)
        ctypes.memset(p, value, n)
        libc.free(p)
    use(1)
    f0 = flt()
    use(2)
    out[str(mib)] = {"faults": flt() - f0, "pages": n // resource.getpagesize()}
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_allocator._libc() is None, reason="glibc only")
def test_opt_in_mmap_threshold_mmaps_only_blocks_above_it():
    """$HETHUB_HOST_ALLOCATOR_MMAP_MIB=32: a 64 MiB block is mmapped afresh (its second use faults every
    page again), a 16 MiB block stays in the heap (almost no fault); unset, neither faults again."""
    def run(mib):
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop(host_allocator.ENV, None)
        env.pop(host_allocator.ENV_MMAP_MIB, None)
        if mib is not None:
            env[host_allocator.ENV_MMAP_MIB] = str(mib)
        out = subprocess.run([sys.executable, "-c", _SIZES_CHILD], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    mm, steady = run(32), run(None)
    assert mm["info"]["allocator"] == "steady-mmap32" and "M_MMAP_THRESHOLD 33554432" in mm["info"]["reason"]
    assert mm["64"]["faults"] > 0.8 * mm["64"]["pages"] and mm["16"]["faults"] < 0.05 * mm["16"]["pages"]
    assert steady["info"]["allocator"] == "steady"
    assert steady["64"]["faults"] < 0.05 * steady["64"]["pages"] and steady["16"]["faults"] < 0.05 * steady["16"]["pages"]


def test_mmap_threshold_variable_is_validated(monkeypatch):
    monkeypatch.setenv(host_allocator.ENV_MMAP_MIB, "lots")
    with pytest.raises(ValueError, match="HETHUB_HOST_ALLOCATOR_MMAP_MIB must be a whole number"):
        host_allocator.mmap_threshold_mib()
    monkeypatch.setenv(host_allocator.ENV_MMAP_MIB, "256")
    assert host_allocator.mmap_threshold_mib() == 256


_RELEASE_CHILD = r"""
import ctypes, json
from hethub_jax import host_allocator
host_allocator.steady_host_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 64 << 20

def rss():  # resident bytes, from the kernel
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blocks = [libc.malloc(n) for _ in range(4)]
for p in blocks:
    ctypes.memset(p, 1, n)
pin = libc.malloc(4096)          # a live block above them: the heap's top cannot be trimmed
ctypes.memset(pin, 1, 4096)
for p in blocks:
    libc.free(p)                 # 256 MiB free inside the heap
r0 = rss()
ran = host_allocator.release_free_host_memory()
print(json.dumps({"ran": ran, "before": r0, "after": rss(), "freed": 4 * n}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_allocator._libc() is None, reason="glibc only")
def test_release_gives_back_free_pages_the_steady_heap_keeps():
    """Under the steady settings four freed 64 MiB blocks below a live block stay resident (the heap's top is
    pinned, its free pages are kept); ``release_free_host_memory`` gives them back: the kernel's resident
    count falls by at least 90 % of the 256 MiB freed (and before it, they were resident)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop(host_allocator.ENV, None)
    out = subprocess.run([sys.executable, "-c", _RELEASE_CHILD], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ran"] is True
    assert r["before"] - r["after"] >= 0.9 * r["freed"], r


_TRIM_CHILD = r"""
import ctypes, json
from hethub_jax import host_allocator
info = host_allocator.steady_host_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
n = 1280 << 20             # over the 1 GiB trim threshold of the steady settings before session 18
p = libc.malloc(n)         # from the heap's top (no mmap under the steady settings); its pages are never touched
grown = libc.sbrk(0)
libc.free(p)               # the heap's free top is now over 1.25 GiB
kept = libc.sbrk(0)
ran = host_allocator.release_free_host_memory()
released = libc.sbrk(0)
print(json.dumps({"info": info, "n": n, "p": p, "grown": grown, "kept": kept, "released": released, "ran": ran}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_allocator._libc() is None, reason="glibc only")
def test_steady_heap_keeps_a_free_top_of_any_size():
    """A block over 1 GiB (the 15 M model's fused forward + backward at microbatch 32 and up, with what is free
    beside it) freed at the heap's top: the steady settings keep it (the program break does not move back), so
    the next call of that size faults none of its pages in again; before session 18 the 1 GiB trim threshold gave
    it back at every ``free`` and every such call faulted it in afresh (on this VM, after an EMULATED wait,
    at several times the cost: docs/benchmarks.md issue 17, session 18). ``release_free_host_memory`` still
    gives it back on request. The block's pages are never touched, so the test costs no memory."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop(host_allocator.ENV, None)
    env.pop(host_allocator.ENV_MMAP_MIB, None)
    out = subprocess.run([sys.executable, "-c", _TRIM_CHILD], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["info"]["allocator"] == "steady" and r["p"], r
    assert r["grown"] >= r["p"] + r["n"], r  # the block came from the heap's top (the program break)
    assert r["kept"] == r["grown"], f"the free top was trimmed at free(): {r['grown'] - r['kept']} bytes given back"
    assert r["ran"] is True and r["grown"] - r["released"] >= 0.9 * r["n"], r  # the explicit release still works
