"""Plan-independent checkpoints of the training job (orbax-checkpoint; docs/training.md).

Layout (one directory per saved step, one orbax checkpoint per *unit* of the model)::

    checkpoint_dir/
      .lock                 held (``fcntl.flock``) by the run writing here; pid and host inside; deleted
                            when the run ends (``DirLock``)
      step_{N}/
        embed/              orbax checkpoint of the token embedding
        layers.{i}/         one per decoder layer i
        head/               final norm (and the output head if not tied to the embedding)
        {unit}.crc.json     CRC-32 (zlib) of every array of the unit, with shape and dtype
        meta.json           step, config, plan it was written under, data position, seeds

Each unit holds ``{"params": {...}, "opt": {"0_mu": {...}, "0_nu": {...}}, "shared": {"0_count",
"2_count"}}``: the unit's parameters under their global names (``layers.3.mlp.up_proj`` ->
``params/layers/3/mlp/up_proj``), the optimizer's per-parameter moments for exactly those parameters
(optax AdamW keeps ``mu`` and ``nu`` per parameter leaf, so every node of the optimizer state whose
tree structure is the parameters' is sliced per unit), and the optimizer's shared scalars (step
counts, equal on every stage) copied into every unit. Nothing depends on the plan: a process of any
plan restores exactly the units of its own stages, re-placed on its own meshes.

Writing: each unit is written by the rank holding its first copy (replica 0's stage; the tied
embedding by the first stage), with orbax's asynchronous checkpointer (saving overlaps the next
training steps; the arrays are copied to host first). orbax writes a unit into a temporary directory
and renames it when complete; the CRC file and ``meta.json`` are written atomically (temporary file,
``os.replace``) after it. A step is *complete* when every unit directory, every CRC file and
``meta.json`` exist (:func:`complete_steps`): a crash mid-save leaves an incomplete step that is
never loaded and is deleted by the next run's pruning. ``keep`` complete steps are kept.

Restoring (:func:`restore_latest`) tries complete steps newest first; a unit whose orbax read fails
or whose arrays do not match their CRC is :class:`CheckpointCorrupt` (naming the unit directory and
array), and all ranks then fall back together to the next older complete step, with a warning.

Islands of several processes (one ``jax.distributed`` runtime over several ranks; an island of
several processes runs one stage, docs/multiprocess_islands.md): every process of the island saves
the units of that stage together, passing the stage's global ``jax.Array``s (not host copies) to
orbax's multi-process save: each process writes the shards it holds (``ocdbt.process_{i}/``, orbax
splits replicated shards between their replicas), orbax's barriers run inside the island's runtime
(``jax.process_count()`` is the island's process count; islands of one process need none) as
key-value-store barriers among the stage's processes (``active_processes``, not orbax's default
device collective), and the island's process 0 renames the temporary directory when all processes
are done and then writes the CRC file (from its host copy: every process of such a stage holds every
element, TP lies inside a process). Restoring is the same on every plan: each process reads the whole
units of its stages and places them on its meshes (each device gets its own slice,
``multiprocess.place_global``). :func:`check_supported` refuses, before training, a stage that runs
on only some processes of its island (orbax 0.12 cannot save it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

__all__ = ["CheckpointError", "CheckpointCorrupt", "CheckpointMismatch", "unit_of", "model_units",
           "step_dir", "complete_steps", "latest_step", "read_meta", "write_meta", "check_supported",
           "check_compatible", "AsyncSaver", "runtime_units", "runtime_arrays", "restore_latest", "agree_steps",
           "by_ranks", "DirLock",
           "probe_writable"]

FORMAT = 2
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (the message names the path)."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint unit fails to load or does not match its checksums (names the unit and array)."""


class CheckpointMismatch(ValueError):
    """A checkpoint written for another model or data set-up (names the first field that differs)."""


# ---------------------------------------------------------------------------------------------------
# names and layout

def unit_of(name: str) -> str:
    """Global parameter name -> unit: ``layers.3.mlp.up_proj`` -> ``layers.3``, ``embed_tokens`` ->
    ``embed``, ``norm`` / ``lm_head`` -> ``head``."""
    if name.startswith("layers."):
        return ".".join(name.split(".")[:2])
    return "embed" if name == "embed_tokens" else "head"


def model_units(num_layers: int) -> list[str]:
    """Every unit of a model of ``num_layers`` decoder layers."""
    return ["embed", *(f"layers.{i}" for i in range(num_layers)), "head"]


def step_dir(checkpoint_dir: str | os.PathLike, step: int) -> Path:
    return Path(checkpoint_dir) / f"step_{step}"


def _steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)) for m in (_STEP_RE.match(p.name) for p in root.iterdir()) if m),
                  reverse=True)


def is_complete(checkpoint_dir: str | os.PathLike, step: int, units: list[str]) -> bool:
    d = step_dir(checkpoint_dir, step)
    return (d / "meta.json").is_file() and all(
        (d / u).is_dir() and (d / f"{u}.crc.json").is_file() for u in units)


def complete_steps(checkpoint_dir: str | os.PathLike, num_layers: int) -> list[int]:
    """Steps (newest first) whose every unit, CRC file and ``meta.json`` exist."""
    units = model_units(num_layers)
    return [n for n in _steps(Path(checkpoint_dir)) if is_complete(checkpoint_dir, n, units)]


def latest_step(checkpoint_dir: str | os.PathLike, num_layers: int) -> int | None:
    """The newest complete step, or None."""
    steps = complete_steps(checkpoint_dir, num_layers)
    return steps[0] if steps else None


def looks_saved(checkpoint_dir: str | os.PathLike, step: int, num_layers: int) -> bool:
    """Whether every unit of ``step`` looks as a save leaves it, without reading an array: its CRC file
    (written after orbax finished the unit) reads as a non-empty JSON object (one ``[crc32, shape,
    dtype]`` per array; every unit holds arrays) and its directory holds a file or directory that is not
    hidden (orbax's). A cheap check (a few small files per unit), e.g. for ``train`` to decide that a
    finished run has nothing to do before it plans; the arrays' checksums are verified only when a step
    is restored (:func:`restore_latest`)."""
    d = step_dir(checkpoint_dir, step)
    for u in model_units(num_layers):
        try:
            with open(d / f"{u}.crc.json") as f:
                crc = json.load(f)
            if not isinstance(crc, dict) or not crc or not any(not p.name.startswith(".") for p in (d / u).iterdir()):
                return False
        except (OSError, ValueError):
            return False
    return True


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_meta(checkpoint_dir: str | os.PathLike, step: int, meta: Mapping[str, Any]) -> Path:
    """Write ``step_{step}/meta.json`` atomically (temporary file, then ``os.replace``)."""
    path = step_dir(checkpoint_dir, step) / "meta.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_json(path, {"format": FORMAT, **dict(meta)})
    return path


def read_meta(checkpoint_dir: str | os.PathLike, step: int) -> dict:
    path = step_dir(checkpoint_dir, step) / "meta.json"
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{path}: unreadable ({e})") from None


def check_supported(plan: Any) -> None:
    """Raises ValueError (naming ``train.checkpoint_dir``, the stage and its processes) if a stage on
    an island of several processes does not run on every process of that island: orbax, in a
    ``jax.distributed`` runtime of several processes, writes host (numpy) arrays only from the
    runtime's process 0 and refuses arrays local to one process (orbax-checkpoint 0.12), so such a
    stage's units could not be saved. A stage spanning all of its island's processes (the layouts the
    planner writes) passes."""
    for isl in plan.islands:
        if isl.num_processes == 1:
            continue
        for r, s in plan.island_stages(isl.name):
            procs = sorted({d // isl.devices_per_process for d in plan.stage_devices(r, s)})
            if procs != list(range(isl.num_processes)):
                raise ValueError(
                    f"train.checkpoint_dir: stage {s} of replica {r} runs on processes {procs} of the "
                    f"{isl.num_processes} processes of island {isl.name!r}; checkpoints of an island of "
                    f"several processes need its stage on every process of the island (give it devices "
                    f"on each, or set train.checkpoint_dir: null)")


#: config fields that must match the checkpoint's for a resume (model shape, and the data order that
#: the saved data position refers to); anything else (optimizer, plan, eval, ...) may change
_DATA_FIELDS = ("corpus_path", "tokenizer_path", "seq_len", "validation_fraction", "seed")


def check_compatible(meta: Mapping[str, Any], config: Mapping[str, Any], global_batch_size: int,
                     where: str) -> None:
    """Raises :class:`CheckpointMismatch` naming the first field (``model.hidden_size``,
    ``data.seq_len``, ``train.global_batch_size``) whose value differs between the checkpoint's
    ``meta.json`` and this run (``config``: ``TrainConfig.to_dict()``)."""
    theirs = meta.get("config", {})
    pairs = [(f"model.{k}", theirs.get("model", {}).get(k), v) for k, v in config["model"].items()]
    pairs += [(f"data.{k}", theirs.get("data", {}).get(k), config["data"].get(k))
              for k in _DATA_FIELDS if k in config["data"]]
    pairs.append(("train.global_batch_size", meta.get("data", {}).get("global_batch_size"),
                  global_batch_size))
    for name, a, b in pairs:
        if a != b:
            raise CheckpointMismatch(f"{where} was written for another set-up: {name} is {a!r} there, "
                                     f"{b!r} here (resume with the same value, or start in another "
                                     f"train.checkpoint_dir)")


# ---------------------------------------------------------------------------------------------------
# the unit trees of a runtime

def _is_param_tree(pdef) -> Callable[[Any], bool]:
    import jax
    return lambda x: not isinstance(x, (np.ndarray, jax.Array)) and jax.tree.structure(x) == pdef


def _opt_nodes(opt_state: Any, params: Any) -> list[tuple[str, Any, bool]]:
    """``(key, node, per_parameter)`` for the optimizer state: nodes shaped like the parameters
    (AdamW's ``mu``, ``nu``) and the remaining leaves (step counts). Keys like ``0_mu``."""
    import jax
    is_p = _is_param_tree(jax.tree.structure(params))
    leaves = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_p)[0]
    return [(jax.tree_util.keystr(p, simple=True, separator="_"), x, is_p(x)) for p, x in leaves]


def _nest(flat: Mapping[str, Any]) -> dict:
    out: dict = {}
    for name, x in flat.items():
        *head, last = name.split(".")
        d = out
        for k in head:
            d = d.setdefault(k, {})
        d[last] = x
    return out


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        out.update(_flatten(v, name + ".") if isinstance(v, Mapping) else {name: v})
    return out


def _stage_units(stage: Any, leaf: Callable[[Any], Any]) -> dict[str, dict]:
    """The unit trees of one stage, every array passed through ``leaf`` (host copy, or abstract)."""
    units: dict[str, dict] = {}
    for name, x in stage.flat().items():
        units.setdefault(unit_of(name), {"params": {}, "opt": {}, "shared": {}})["params"][name] = leaf(x)
    for key, node, per_param in _opt_nodes(stage.opt_state, stage.params):
        for u, tree in units.items():
            if per_param:
                tree["opt"].setdefault(key, {}).update(
                    {n: leaf(x) for n, x in stage.flat(node).items() if unit_of(n) == u})
            else:
                tree["shared"][key] = leaf(node)
    return {u: {"params": _nest(t["params"]), "opt": {k: _nest(v) for k, v in t["opt"].items()},
                "shared": t["shared"]} for u, t in units.items()}


def _owned_units(rt: Any) -> dict[str, tuple]:
    """unit -> the stage key holding its first copy (it saves the unit), for units of local stages."""
    out = {}
    for name, key in rt.norm_owner.items():
        out.setdefault(unit_of(name), key)
    return {u: k for u, k in out.items() if k in rt.stages}


def runtime_units(rt: Any) -> dict[str, dict]:
    """Host copies (numpy) of the units this rank writes (see module docstring), by unit name.
    Arrays of a stage spanning processes are read from this process's shards
    (``multiprocess.host_copy``: each process holds every element of a parameter). Every rank calls
    it at the same step: under the sharded update (ZeRO-1) the Adam moments a replica does not own
    are first gathered from their owners (``rt.sync_optimizer_state``, a collective)."""
    from hethub_jax.parallel.multiprocess import host_copy
    if hasattr(rt, "sync_optimizer_state"):
        rt.sync_optimizer_state()
    out = {}
    for u, key in _owned_units(rt).items():
        out[u] = _stage_units(rt.stages[key], host_copy)[u]
    return out


def runtime_arrays(rt: Any) -> dict[str, dict]:
    """The units of this rank's stages whose mesh spans several processes, as trees of their global
    ``jax.Array``s (for orbax's multi-process save, :meth:`AsyncSaver.save` ``arrays``); empty when
    every stage of this rank lies in this process."""
    out = {}
    for u, key in _owned_units(rt).items():
        if getattr(rt.stages[key], "multiprocess", False):
            out[u] = _stage_units(rt.stages[key], lambda x: x)[u]
    return out


def _orbax_options(devices: Any) -> Any:
    """orbax's multiprocessing options for a unit held on ``devices`` (a stage's mesh devices):
    barriers among the processes of those devices only, through the island runtime's key-value store
    (``active_processes``; orbax's default barrier over all processes is a device collective, which
    would make a new gloo group at a save), the first of them primary (it commits the unit). orbax's
    defaults in a runtime of one process."""
    import jax
    import orbax.checkpoint as ocp
    if jax.process_count() == 1:
        return ocp.options.MultiprocessingOptions()
    procs = {d.process_index for d in devices}
    return ocp.options.MultiprocessingOptions(primary_host=min(procs), active_processes=procs)


def _tree_devices(tree: Any) -> set:
    import jax
    return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def _crc_table(tree: Mapping[str, Any]) -> dict[str, list]:
    return {k: [zlib.crc32(np.ascontiguousarray(x).tobytes()), list(np.shape(x)), str(np.asarray(x).dtype)]
            for k, x in _flatten(tree).items()}


# ---------------------------------------------------------------------------------------------------
# saving

class AsyncSaver:
    """Writes this rank's units of a step with orbax's asynchronous checkpointer; a background thread
    waits for them, then writes the CRC files, ``meta.json`` (if given) and prunes old steps.

    ``save`` returns once the arrays are on the host; the next ``save`` (and ``wait``) waits for the
    previous one and raises its error, if any, as :class:`CheckpointError`.

    Args:
      root: ``train.checkpoint_dir``.
      num_layers: the model's decoder layers (the units of a complete step).
      keep: complete steps kept (older ones and incomplete older ones are deleted by the rank that
        writes ``meta.json``); None keeps all.
    """

    def __init__(self, root: str | os.PathLike, num_layers: int, keep: int | None):
        self.root, self.units, self.keep = Path(root), model_units(num_layers), keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, units: Mapping[str, dict], meta: Mapping[str, Any] | None,
             arrays: Mapping[str, dict] | None = None) -> Path:
        """Start saving ``units`` (host copies: the CRC files are computed from them) at ``step``.

        ``arrays``: for units of a stage spanning several processes of an island, the trees of global
        ``jax.Array``s that orbax writes instead of the host copy (every process of the island must
        call ``save`` with the same units in the same order; orbax synchronises them inside the
        island's ``jax.distributed`` runtime). Only the unit's committing process (the first process
        of its stage, orbax's primary host) writes its CRC file."""
        import orbax.checkpoint as ocp
        self.wait()
        d = step_dir(self.root, step).absolute()
        d.mkdir(parents=True, exist_ok=True)
        pending = []
        for u, tree in units.items():
            glob = (arrays or {}).get(u)
            opts = _orbax_options(_tree_devices(glob)) if glob is not None else ocp.options.MultiprocessingOptions()
            ckptr = ocp.StandardCheckpointer(multiprocessing_options=opts)
            ckptr.save(d / u, tree if glob is None else glob, force=True)
            pending.append((u, ckptr, opts.primary_host))
        self._thread = threading.Thread(target=self._finish, args=(step, d, pending, units, meta),
                                        name=f"checkpoint-step-{step}")
        self._thread.start()
        return d

    def _finish(self, step, d: Path, pending, units, meta) -> None:
        import jax
        try:
            for u, ckptr, primary in pending:
                ckptr.wait_until_finished()
                ckptr.close()
                if jax.process_index() == primary:  # the unit's committing process (one process: 0)
                    _atomic_json(d / f"{u}.crc.json", _crc_table(units[u]))
            if meta is not None:
                write_meta(self.root, step, meta)
                self._prune(step)
        except BaseException as e:  # reported by the next save / wait
            self._error = e

    def _prune(self, newest: int) -> None:
        """Keep the newest ``keep`` complete steps; delete older and incomplete steps older than the
        newest complete one (no rank writes those any more)."""
        done = [n for n in _steps(self.root) if is_complete(self.root, n, self.units)]
        if not done or self.keep is None:
            return
        kept = set(done[:self.keep])
        for n in _steps(self.root):
            if n < done[0] and n not in kept:
                shutil.rmtree(step_dir(self.root, n), ignore_errors=True)

    def wait(self) -> None:
        """Wait for the save in flight; raises CheckpointError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise CheckpointError(f"saving a checkpoint in {self.root} failed: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------------
# restoring

def _read_unit(d: Path, unit: str, like: dict, options: Any = None) -> dict:
    """One unit of a step, checked against its CRC table (``options``: orbax's multiprocessing
    options, see ``_orbax_options``). Raises CheckpointCorrupt."""
    import jax
    import orbax.checkpoint as ocp
    path = (d / unit).absolute()
    try:
        with open(d / f"{unit}.crc.json") as f:
            crc = json.load(f)
        target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), like)
        ckptr = ocp.StandardCheckpointer(multiprocessing_options=options or ocp.options.MultiprocessingOptions())
        try:
            tree = ckptr.restore(path, target)
        finally:
            ckptr.close()
    except Exception as e:  # orbax / tensorstore / json: report the unit, not a 60-line traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointCorrupt(f"{path}: cannot be read ({type(e).__name__}: {first[:200]})") from None
    got = _crc_table(tree)
    for k, want in crc.items():
        if got.get(k) != want:
            raise CheckpointCorrupt(f"{path}: array {k} does not match its checksum in {unit}.crc.json "
                                    f"(data corrupted on disk)")
    if set(got) != set(crc):
        raise CheckpointCorrupt(f"{path}: arrays {sorted(set(got) ^ set(crc))} missing from {unit}.crc.json")
    return tree


def _load_stage(stage: Any, trees: Mapping[str, dict]) -> None:
    """Places the units' parameters and optimizer state onto ``stage`` (its own shardings)."""
    import jax

    from hethub_jax.parallel.multiprocess import place_global
    # a mesh spanning processes: each device gets its slice of the (identical) host value
    put = place_global if getattr(stage, "multiprocess", False) else jax.device_put
    flat = {}
    for t in trees.values():
        flat.update(_flatten(t["params"]))
    stage.params = jax.tree.map(lambda x, s: put(np.asarray(x), s), stage.unflat(flat), stage.param_shardings)
    first = next(iter(trees.values()))
    nodes = {}
    for key, node, per_param in _opt_nodes(stage.opt_state, stage.params):
        if per_param:
            moments = {}
            for t in trees.values():
                moments.update(_flatten(t["opt"][key]))
            nodes[key] = stage.unflat(moments, like=node)
        else:
            nodes[key] = first["shared"][key]
    import jax.tree_util as tu
    is_p = _is_param_tree(jax.tree.structure(stage.params))
    new = tu.tree_map_with_path(lambda p, x: nodes[tu.keystr(p, simple=True, separator="_")],
                                stage.opt_state, is_leaf=is_p)
    stage.opt_state = jax.tree.map(lambda n, o: put(np.asarray(n).astype(o.dtype), o.sharding),
                                   new, stage.opt_state)


def _read_step(rt: Any, root: Path, step: int) -> dict[tuple, dict]:
    """The unit trees of every local stage at ``step`` (each unit read once). Raises CheckpointCorrupt."""
    import jax
    d = step_dir(root, step)
    cache: dict[str, dict] = {}
    out = {}
    for key, stage in rt.stages.items():
        like = _stage_units(stage, lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
        for u in like:
            if u not in cache:
                cache[u] = _read_unit(d, u, like[u], _orbax_options(stage.mesh.devices.flat))
        out[key] = {u: cache[u] for u in like}
    return out


#: bytes per rank of the record the ranks exchange while restoring (``_gather_text``): 1 status byte and
#: the start of the rank's text (UTF-8)
_RANK_TEXT_BYTES = 1024


def _gather_text(comm: Any, text: str | None) -> dict[int, str]:
    """``{rank: its text}`` of the ranks that gave one (``None``: nothing to say), through one allgather
    of a fixed ``_RANK_TEXT_BYTES`` record per rank over ``comm`` (a ``hethub_jax.comm`` Communicator:
    its own deadline applies; CommTimeoutError when a rank does not arrive). Every rank of ``comm`` must
    call it at the same point. ``comm`` None (one process): ``{0: text}`` or ``{}``."""
    if comm is None:
        return {} if text is None else {0: text}
    rec = np.zeros(_RANK_TEXT_BYTES, np.uint8)
    if text is not None:
        raw = text.encode()[:_RANK_TEXT_BYTES - 1]
        rec[0], rec[1:1 + len(raw)] = 1, np.frombuffer(raw, np.uint8)
    table = np.asarray(comm.allgather(rec))
    return {r: bytes(row[1:]).rstrip(b"\0").decode(errors="replace") for r, row in enumerate(table) if row[0]}


def _rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def by_ranks(texts: Mapping[int, str], size: int, limit: int = 400) -> str:
    """One line for what ranks reported (``texts``: ``{rank: text}``, ``size``: the job's ranks): the
    text alone when every rank of the job reported that one text (a job of one rank included); else
    each distinct text once (cut to ``limit`` characters) after the ranks that reported it, in rank
    order: ``"rank 0: A; ranks 1-3: B"``. The same on every rank that is given the same ``texts``."""
    if len(texts) == size and len(set(texts.values())) == 1:
        return next(iter(texts.values()))[:limit]
    groups: dict[str, list[int]] = {}
    for r in sorted(texts):
        groups.setdefault(texts[r], []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_rank_ranges(rs)}: {t[:limit]}" for t, rs in groups.items())


def _steps_text(steps: str) -> str:
    return "no complete step" if steps == "none" else f"step {steps}" if "," not in steps else f"steps {steps}"


def agree_steps(comm: Any, steps: list[int], root: str | os.PathLike) -> None:
    """Under MPI (``comm`` not None) every rank must see the same complete steps (``steps``: this rank's,
    from :func:`complete_steps`) in the checkpoint directory ``root``: one shared directory. A collective
    over ``comm`` (:func:`_gather_text`).

    Raises:
      CheckpointError: on every rank, with the same message naming each rank's steps, when they differ.
    """
    if comm is None or comm.size <= 1:
        return
    seen = _gather_text(comm, ", ".join(map(str, steps)) or "none")
    if len(set(seen.values())) > 1:
        each = by_ranks({r: _steps_text(s) for r, s in seen.items()}, comm.size)
        raise CheckpointError(f"the ranks see different complete checkpoint steps in {root}: {each} (the ranks "
                              f"need one checkpoint directory that every rank sees whole: a shared file system)")


def restore_latest(rt: Any, root: str | os.PathLike, config: Mapping[str, Any], global_batch_size: int,
                   warn: Callable[[str], None] = print) -> tuple[int, dict] | None:
    """Restore the newest complete, readable step of ``root`` into the runtime ``rt`` (every rank of
    the job calls this; under MPI the ranks agree through ``rt.comm``: first that they see the same
    complete steps, then, for each step tried, every rank's outcome, so that every rank takes the same
    path, raises the same error and no rank waits in a collective its peers left).

    Returns:
      ``(step, meta)``, or None if ``root`` holds no complete step.

    Raises:
      CheckpointError: the ranks see different complete steps (:func:`agree_steps`).
      CheckpointMismatch: the step tried was written for another model / data set-up (on some rank).
      CheckpointCorrupt: every complete step is corrupt (the message names each fault and the ranks
        that found it).
      All three with the same message on every rank.
    """
    comm = rt.comm
    size = comm.size if comm is not None else 1
    steps = complete_steps(root, rt.config.num_hidden_layers)
    agree_steps(comm, steps, root)
    if not steps:
        return None
    errors = []
    for step in steps:
        trees, meta, mine = None, None, None
        try:
            meta = read_meta(root, step)
            check_compatible(meta, config, global_batch_size, where=f"checkpoint {step_dir(root, step)}")
            trees = _read_step(rt, Path(root), step)
        except CheckpointMismatch as e:
            mine = "M" + str(e)
        except CheckpointCorrupt as e:
            mine = "C" + str(e)
        found = _gather_text(comm, mine)
        mismatched = {r: t[1:] for r, t in found.items() if t.startswith("M")}
        if mismatched:
            raise CheckpointMismatch(by_ranks(mismatched, size))
        if not found:
            for key, t in trees.items():
                _load_stage(rt.stages[key], t)
            return step, meta
        errors.append(by_ranks({r: t[1:] for r, t in found.items()}, size))
        if step != steps[-1]:
            warn(f"warning: checkpoint step {step} is corrupt ({errors[-1]}); falling back to the previous "
                 f"complete step")
    raise CheckpointCorrupt(f"every complete checkpoint in {root} is corrupt: " + " | ".join(errors))


# ---------------------------------------------------------------------------------------------------
# the output directory: lock and write probe

class DirLock:
    """An exclusive lock of an output directory (``fcntl.flock`` on the file ``path``, which holds the
    holder's pid, host and start time).

    :meth:`release` (a clean exit, or an exception the run handles) deletes the file, so a finished run
    leaves nothing behind. A run that dies without releasing (a crash, SIGKILL) leaves the file, but
    not the lock: the kernel drops a dead process's ``flock``, and the next run takes the file over (a
    stale file never blocks). Only a live holder blocks, and the error names it.

    Taking the lock: open (creating) ``path``, ``flock`` it without waiting, then check that ``path``
    still names the locked file: a holder releasing at that moment deletes it, and the lock of a
    deleted file would exclude nobody, so then it tries again.

    Raises:
      CheckpointError: another live process holds the lock (the message names its pid and host, and
        the lock file).
    """

    def __init__(self, path: str | os.PathLike):
        import fcntl
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            f = open(self.path, "a+")
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                f.close()
                raise CheckpointError(
                    f"{self.path.parent} is in use by another run ({holder}; lock file {self.path}); one "
                    f"output directory is written by one run at a time. A run that has ended holds no lock "
                    f"(the kernel releases it), so if that process is gone, the file system does not "
                    f"support flock: delete {self.path}") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()  # locked a file its holder deleted on release: take the new one
        else:
            raise CheckpointError(f"cannot lock {self.path}: it keeps being deleted by other runs")
        self._f = f
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on host {socket.gethostname()} since "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
        f.flush()

    def release(self) -> None:
        """Deletes the lock file (while still holding the lock), then unlocks. Idempotent."""
        import fcntl
        if not self._f.closed:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            fcntl.flock(self._f.fileno(), fcntl.LOCK_UN)
            self._f.close()


def probe_writable(directory: str | os.PathLike, nbytes: int = 1 << 20) -> None:
    """Write ``nbytes`` (bytes) to a probe file in ``directory`` (created if missing) and sync it.

    The probe leaves nothing behind even if the process is killed while writing it (e.g. aborted by
    another rank's failed check): it is an unnamed temporary file (``tempfile.TemporaryFile``: Linux
    ``O_TMPFILE``, elsewhere a ``.probe.*`` file unlinked right after creation, before the write), and
    ``.probe.*`` leftovers older than :data:`STALE_PROBE_S` (of older versions, which named the probe
    ``.probe.<pid>`` and deleted it at the end) are removed first.

    Raises:
      OSError: with a message naming the directory (unwritable, full disk)."""
    import tempfile
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        _remove_stale_probes(d)
        with tempfile.TemporaryFile(prefix=".probe.", dir=d) as f:
            f.write(b"\0" * nbytes)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise OSError(f"{d} is not writable ({e.strerror or e})") from None


#: seconds after which a ``.probe.*`` file in an output directory is a leftover (a probe takes < 1 s)
STALE_PROBE_S = 600.0


def _remove_stale_probes(d: Path) -> None:
    """Delete ``.probe.*`` files in ``d`` last modified more than :data:`STALE_PROBE_S` ago."""
    now = time.time()
    for p in d.glob(".probe.*"):
        try:
            if p.is_file() and now - p.stat().st_mtime > STALE_PROBE_S:
                p.unlink()
        except OSError:  # gone meanwhile, or not ours to delete: the write probe decides
            pass
