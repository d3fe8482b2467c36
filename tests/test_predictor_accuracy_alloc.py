"""``benchmarks/predictor_accuracy.arenas_per_thread``: after the steady host allocator (one arena), glibc's own
arena count comes back (8 per core on a 64-bit glibc, ``NARENAS_FROM_NCORES`` in malloc/arena.c), checked in a
fresh process because the setting is process-wide."""
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def test_arenas_per_thread_sets_glibcs_own_arena_count():
    from hethub_jax import host_allocator
    if host_allocator._libc() is None:
        pytest.skip("not glibc: no mallopt")
    code = ("import os, benchmarks.predictor_accuracy as pa; "
            "from hethub_jax import host_allocator as h; assert h.current() == 'steady'; "
            "print(pa.arenas_per_thread()['arena_max'], 8 * os.cpu_count())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-2000:]
    got, want = p.stdout.split()[-2:]
    assert got == want
