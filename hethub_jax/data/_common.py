"""Small helpers shared by the modules of :mod:`hethub_jax.data` (not public)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np


def package_dir(package: str) -> Path | None:
    """Directory of an installed top-level package, found without importing (executing) it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def check_positive_int(name: str, value) -> int:
    """``value`` as an int. Raises TypeError if it is not an int (bool excluded), ValueError if < 1;
    both messages name ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def log(msg: str) -> None:
    """One progress line on stderr, prefixed ``[hethub_jax.data]``."""
    print(f"[hethub_jax.data] {msg}", file=sys.stderr, flush=True)
