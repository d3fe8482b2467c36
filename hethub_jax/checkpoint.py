"""Checkpoints of the training job (orbax-checkpoint).

Layout (one directory per saved step, one orbax checkpoint per MPI rank)::

    checkpoint_dir/
      step_{N}/
        rank_{R}/        orbax StandardCheckpointer directory of rank R's stages:
                         {"r{replica}s{stage}": {"params": ..., "opt_state": ...}, ...}
        meta.json        written by the logging rank after its own save: step, world_size,
                         config and plan (for humans and for --resume)

orbax writes each ``rank_{R}`` into a temporary directory and renames it when complete, so a
``rank_{R}`` directory that exists is a complete checkpoint. A step is complete when ``meta.json``
and every rank's directory exist (:func:`latest_step`).

Islands of several processes (one ``jax.distributed`` runtime over several ranks) would need one
orbax checkpoint per island, saved by all its processes together; :func:`check_supported` rejects
them until the runtime supports that.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

__all__ = ["step_dir", "rank_dir", "save", "restore", "latest_step", "write_meta", "read_meta",
           "check_supported"]

_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir(checkpoint_dir: str | os.PathLike, step: int) -> Path:
    return Path(checkpoint_dir) / f"step_{step}"


def rank_dir(checkpoint_dir: str | os.PathLike, step: int, rank: int) -> Path:
    return step_dir(checkpoint_dir, step) / f"rank_{rank}"


def check_supported(plan: Any) -> None:
    """Raises ValueError if the plan has an island of several processes (not supported yet)."""
    multi = [i.name for i in plan.islands if i.num_processes > 1]
    if multi:
        raise ValueError(f"train.checkpoint_dir: checkpointing islands of several processes is not "
                         f"supported yet (islands {multi}); set train.checkpoint_dir: null")


def save(checkpoint_dir: str | os.PathLike, step: int, rank: int, state: Mapping[str, Any]) -> Path:
    """Save this rank's state (``PipelineRuntime.checkpoint_state()``) to
    ``checkpoint_dir/step_{step}/rank_{rank}`` and wait until it is committed. An existing directory
    of the same step and rank is replaced (orbax ``force=True``).

    Returns:
      the rank directory.
    """
    import orbax.checkpoint as ocp

    path = rank_dir(checkpoint_dir, step, rank).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(path, dict(state), force=True)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    return path


def restore(checkpoint_dir: str | os.PathLike, step: int, rank: int, like: Mapping[str, Any]) -> dict:
    """Restore rank ``rank``'s state of ``step`` with the structure, shapes, dtypes and shardings of
    ``like`` (the fresh runtime's ``checkpoint_state()``).

    Raises:
      FileNotFoundError: the checkpoint does not exist.
      ValueError: (from orbax) the stored tree does not match ``like``.
    """
    import jax
    import orbax.checkpoint as ocp

    path = rank_dir(checkpoint_dir, step, rank).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, dict(like))
    ckptr = ocp.StandardCheckpointer()
    try:
        return ckptr.restore(path, target)
    finally:
        ckptr.close()


def write_meta(checkpoint_dir: str | os.PathLike, step: int, meta: Mapping[str, Any]) -> Path:
    """Write ``step_{step}/meta.json`` atomically (temporary file, then ``os.replace``)."""
    path = step_dir(checkpoint_dir, step) / "meta.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(dict(meta), f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_meta(checkpoint_dir: str | os.PathLike, step: int) -> dict:
    with open(step_dir(checkpoint_dir, step) / "meta.json") as f:
        return json.load(f)


def latest_step(checkpoint_dir: str | os.PathLike, world_size: int) -> int | None:
    """The highest step N whose ``step_N`` holds ``meta.json`` and ``rank_0..rank_{world_size-1}``;
    ``None`` if there is none (or the directory does not exist)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    steps = sorted((int(m.group(1)) for m in (_STEP_RE.match(p.name) for p in root.iterdir()) if m),
                   reverse=True)
    for n in steps:
        d = step_dir(root, n)
        if (d / "meta.json").is_file() and all((d / f"rank_{r}").is_dir() for r in range(world_size)):
            return n
    return None
