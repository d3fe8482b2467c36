"""Helpers shared by the benchmarks: machine description, load average, medians, JSON output."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
from typing import Any, Sequence

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine() -> dict[str, Any]:
    """Host, CPU count, platform and library versions (imports jax: call after any env set-up)."""
    import jax
    import numpy as np

    out = {"host": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform(),
           "python": platform.python_version(), "numpy": np.__version__, "jax": jax.__version__,
           "jax_devices": [str(d) for d in jax.devices()], "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
           "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        out["cpu_model"] = names[0] if names else ""
    except OSError:
        pass
    return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def command_line() -> str:
    return "python " + os.path.relpath(sys.argv[0], ROOT) + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")


def write_json(path: str, result: dict[str, Any]) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
