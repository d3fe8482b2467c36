"""Training entry point: ``python -m hethub_jax.train [--config PATH] [flags]`` (docs/training.md).

``main`` runs four parts, each a function here:

1. set-up (``_set_up``): parse the command line -> load and validate the config
   (``hethub_jax.config``) -> under ``mpiexec``, start this rank's island -> the plan
   (``Plan.validate``) -> the datasets (``hethub_jax.data``) -> launch checks -> the pipeline runtime
   (``hethub_jax.parallel.runtime``). Every failure here is a configuration error. A run whose newest
   checkpoint already reaches ``train.steps`` ends here with one line and status 0 (``finished_step``;
   plan-less training before it profiles or plans).
2. warm-up (``_warm_up_batch_shares``, ``_warm_up_grad_allreduce``): heterogeneous DP without shares in
   the plan measures them; with ``train.grad_bucket_mb: auto`` (default) it then times the gradient
   all-reduce in buckets and after the backward and keeps the faster.
3. resume (``_resume``) from the newest checkpoint with ``train.resume``; the banner.
4. the loop (``_train_loop``): ``train.steps`` optimizer steps; after each, the hooks built by
   ``_build_hooks`` (``hethub_jax.train_hooks``: validation, checkpoints, Chrome trace, metrics,
   progress bar, text lines) see a ``TrainState``.

With no flags it trains the ``tiny`` preset on the Shakespeare corpus on the local CPU (one island,
one stage). A configuration error (unknown key, impossible value, missing corpus, invalid plan)
ends the program with a one-line message on stderr and exit status 2, before anything is compiled.

Metrics file (JSON lines; field units in docs/training.md):
  * ``{"kind": "run", ...}``: first line; config, plan, batch shares, emulation, versions, host.
  * ``{"kind": "eval", "step": 0, "val_loss": ...}``: evaluation before the first step.
  * ``{"kind": "step", "step": N, "loss", "tokens_per_s", "step_time_s", "grad_norm", "lr",
    "num_tokens", "wall_s"[, "val_loss"][, "emulated": true]}``: one per optimizer step.
  * ``{"kind": "end", ...}``: summary (final losses, mean throughput, checkpoint path).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform as _platform
import sys
import time
from typing import Any, Sequence

from hethub_jax.train_hooks import (CheckpointHook, Console, ConsoleHook, EvalHook, Hook, MetricsHook,
                                    MetricsWriter, ProgressHook, TraceHook, TrainState)

__all__ = ["main", "build_parser", "default_plan", "warm_up_grad_allreduce", "EXIT_CONFIG_ERROR"]

EXIT_CONFIG_ERROR = 2
_PROG = "python -m hethub_jax.train"


#: argparse dest -> the config field its flag sets (``_flags``), whose default ``--help`` shows
_FIELD_OF_DEST = {"steps": "train.steps", "global_batch_size": "train.global_batch_size",
                  "microbatch_size": "train.microbatch_size", "seq_len": "data.seq_len",
                  "lr": "optim.learning_rate", "seed": "train.seed", "eval_every": "train.eval_every",
                  "checkpoint_every": "train.checkpoint_every", "metrics_file": "train.metrics_file",
                  "checkpoint_dir": "train.checkpoint_dir", "trace_file": "train.trace_file"}


def config_field_default(field: str) -> Any:
    """The built-in default of a config field ``"section.name"`` (imports ``hethub_jax.config``, which
    imports JAX: call it only when help is printed)."""
    from hethub_jax.config import DataConfig, OptimConfig, TrainSettings
    section, name = field.split(".", 1)
    model = {"train": TrainSettings, "data": DataConfig, "optim": OptimConfig}[section]
    return model.model_fields[name].get_default(call_default_factory=True)


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's real default, once: a flag that sets a config field shows that field's built-in
    default (the flag's own default None means "not given"); a help text that already says its default
    gets nothing more; switches (store_true) show none; other flags show a non-None default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or action.nargs == 0:
            return text
        if action.dest in _FIELD_OF_DEST and action.default is None:
            value = config_field_default(_FIELD_OF_DEST[action.dest])
            return f"{text} (default: {'none' if value is None else value})"
        if action.default not in (None, []):
            return f"{text} (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    """The command line. Dedicated flags override ``--set``, which overrides the config file."""
    p = argparse.ArgumentParser(
        prog=_PROG, description="Train a Llama-family model with hethub-jax (docs/training.md).",
        formatter_class=_HelpFormatter)
    p.add_argument("--config", metavar="PATH", default=None,
                   help="YAML config (sections model, data, optim, train; see configs/tiny.yaml); "
                        "default: built-in defaults (tiny preset on the Shakespeare corpus)")
    p.add_argument("--set", dest="overrides", metavar="SECTION.FIELD=VALUE", action="append", default=[],
                   help="override one config field, VALUE parsed as YAML (repeatable), "
                        "e.g. --set optim.learning_rate=1e-3 --set model=tiny")
    p.add_argument("--steps", type=int, default=None, help="train.steps: optimizer steps")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="train.global_batch_size (samples) (default: the plan's, 16 without a plan)")
    p.add_argument("--microbatch-size", type=int, default=None,
                   help="train.microbatch_size (samples) (default: the plan's, the global batch without a plan)")
    p.add_argument("--seq-len", type=int, default=None, help="data.seq_len (tokens per sample)")
    p.add_argument("--lr", type=float, default=None, help="optim.learning_rate (peak)")
    p.add_argument("--seed", type=int, default=None, help="train.seed: parameter initialisation seed")
    p.add_argument("--eval-every", type=int, default=None, help="train.eval_every (steps)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="train.checkpoint_every: also checkpoint every N steps (0: only at the end)")
    p.add_argument("--metrics-file", metavar="PATH", default=None, help="train.metrics_file (JSON lines)")
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="train.checkpoint_dir")
    p.add_argument("--no-checkpoint", action="store_true", help="set train.checkpoint_dir to null")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", default=None,
                     help="train.resume true: continue from the newest complete checkpoint in checkpoint_dir "
                          "(any plan); none is an error (default, train.resume null: resume when there is "
                          "one, else start from step 0)")
    how.add_argument("--resume-or-start", action="store_true", default=None,
                     help="train.resume and train.resume_or_start: as --resume, but start from step 0 "
                          "when there is no complete checkpoint")
    how.add_argument("--no-resume", action="store_true", default=None,
                     help="train.resume false: start from step 0 even when checkpoint_dir holds checkpoints "
                          "(they move to checkpoint_dir/earlier_run_<N>/; the metrics file to "
                          "<metrics_file>.<N>)")
    p.add_argument("--plan", metavar="PLAN.json", default=None,
                   help="train.plan: parallel plan JSON (default: one island, one stage, one device)")
    p.add_argument("--trace-file", metavar="PATH", default=None,
                   help="train.trace_file: Chrome trace of the last step's actions")
    p.add_argument("--island", metavar="NAME", default=None,
                   help="this process's island (MPI runs; else $HETHUB_ISLAND); single-process runs "
                        "run every island of the plan in-process")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (text lines only)")
    p.add_argument("--progress", choices=("auto", "bar", "lines"), default="auto",
                   help="progress on stderr: bar (redrawn in place), lines (a plain line every 30 s, for log "
                        "files and pipes), auto: bar when stderr is a terminal, else lines (also under mpiexec)")
    _add_insight_flags(p)
    return p


def _add_insight_flags(p: argparse.ArgumentParser) -> None:
    """Plan-less training and the PREDICTED-vs-measured outputs (issue 17; ``hethub_jax.train_predict``)."""
    p.add_argument("--cluster", metavar="CLUSTER.yaml", default=None,
                   help="plan-less training: profile (or reuse --profiles), ask the planner for the best plan "
                        "on this cluster (docs/cluster_spec.md), write it as plan.json beside the metrics, train "
                        "it; not with --plan")
    p.add_argument("--profiles", metavar="DIR", default=None,
                   help="saved device profiles (<DIR>/<device or island>.json, python -m hethub_jax.profile) "
                        "for the prediction; with --cluster, missing cpu profiles are measured into DIR")
    p.add_argument("--timeline-png", metavar="PATH", default=None,
                   help="Gantt chart of the last step, measured and PREDICTED (default: beside --trace-file)")
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="TensorBoard scalars into DIR (needs the tensorboard extra: tensorboardX)")


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train.steps": args.steps, "train.global_batch_size": args.global_batch_size,
        "train.microbatch_size": args.microbatch_size, "data.seq_len": args.seq_len,
        "optim.learning_rate": args.lr, "train.seed": args.seed, "train.eval_every": args.eval_every,
        "train.checkpoint_every": args.checkpoint_every,
        "train.metrics_file": args.metrics_file, "train.checkpoint_dir": args.checkpoint_dir,
        "train.resume": True if args.resume_or_start else False if args.no_resume else args.resume,
        "train.resume_or_start": args.resume_or_start, "train.plan": args.plan,
        "train.trace_file": args.trace_file,
    }


def _fail(msg: str, args: argparse.Namespace | None = None) -> int:
    """Print the one-line error; under MPI end every rank of the job: before MPI started, through
    the start-up gate (``_fail_before_mpi``); after, with an MPI abort."""
    if mpi_world_size() > 1 and "mpi4py.MPI" not in sys.modules:
        return _fail_before_mpi(msg, args)
    _say(f"{_PROG}: error: {msg}")
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            time.sleep(1.0)  # let mpiexec forward the message before the abort ends the job
            MPI.COMM_WORLD.Abort(EXIT_CONFIG_ERROR)
    return EXIT_CONFIG_ERROR


def _fail_before_mpi(msg: str | None, args: argparse.Namespace | None, held: str | None = None) -> int:
    """A rank of an MPI job failed before starting MPI (configuration, command line): print the error
    as one line naming this rank and island where known (``msg`` None: argparse's error, printed by
    argparse or ``held``), start MPI and report the failure at the start-up gate (``cluster.join_job``),
    which ends every rank of the job with status 2 within seconds instead of leaving them waiting in
    ``MPI_Init``. Returns 2.

    The launcher's rank 0 (or a rank the launcher does not name) prints at once; every other rank holds
    its error until the gate has told it the other ranks' errors, and prints it only when no lower rank
    failed with the same message (an identical configuration error appears once, not once per rank).
    ``held``: argparse's output of this rank, captured (``msg`` None), printed under the same rule."""
    from hethub_jax import cluster

    first = cluster.launcher_rank() in (None, 0)
    text = held if msg is None else f"{_PROG}: error: {_rank_label(args)}{msg}\n"
    if first and text:
        _say(text.rstrip("\n"))
    try:
        cluster.join_job(error=msg or "command-line error (see argparse's message)")
    except cluster.StartFailed as e:  # always raised here: this rank's own failure
        mine = e.failed.get(e.rank)
        if not first and text and min(r for r, m in e.failed.items() if m == mine) == e.rank:
            _say(text.rstrip("\n"))
    return EXIT_CONFIG_ERROR


def _rank_label(args: argparse.Namespace | None) -> str:
    """``"rank R (island X): "`` from the launcher's environment, ``--island`` / ``$HETHUB_ISLAND`` or
    the plan given with ``--plan`` (when it reads and matches the job's size); less where unknown."""
    from hethub_jax import cluster

    rank = cluster.launcher_rank()
    if rank is None:
        return ""
    island = (args.island if args is not None else None) or os.environ.get(cluster.ENV_ISLAND)
    if island is None and args is not None and args.plan:
        try:
            from hethub_jax.parallel.plan import Plan
            plan = Plan.from_json(args.plan)
            if plan.world_size == mpi_world_size():
                island = plan.rank_island(rank).name
        except Exception:  # noqa: BLE001 - a label only; the plan's own error is reported elsewhere
            pass
    return f"rank {rank} (island {island}): " if island else f"rank {rank}: "


def _peers_failed(e) -> int:
    """This rank is fine but others failed before MPI started (``cluster.StartFailed``): they printed
    their errors; the lowest healthy rank says why the job stops (one line, for per-rank logs). Returns 2."""
    healthy = [r for r in range(e.size) if r not in e.failed]
    if healthy and e.rank == healthy[0]:
        _say(f"rank {e.rank}: stopping: {e}")
    return EXIT_CONFIG_ERROR


def _set_up_failed(e, args: argparse.Namespace | None) -> int:
    """Some ranks of an MPI job found a configuration error after MPI started (``cluster.SetUpFailed``,
    raised on every rank at an agreement point): each distinct error is printed once, as one line by
    the lowest rank that found it (naming the other ranks that found the same); every other rank,
    failed with the same error or healthy, ends quietly. Returns 2 on every rank (no MPI abort: every
    rank ends by itself, so ``mpiexec`` exits with 2)."""
    if e.first_rank_of_own_error():
        others = e.same_on()
        also = f" (the same on rank(s) {', '.join(map(str, others))})" if others else ""
        _say(f"{_PROG}: error: {_rank_label(args)}{e.failed[e.rank]}{also}")
    return EXIT_CONFIG_ERROR


def _say(line: str) -> None:
    """``line`` and its newline to stderr in one write: ``print`` writes the newline separately, and
    mpiexec, forwarding several ranks' stderr, then merged two ranks' lines into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------------
# plan

def default_plan(global_batch_size: int, microbatch_size: int, num_layers: int, platform: str = "cpu"):
    """The plan used without ``--plan``: island ``main`` (one process, one device of ``platform``),
    one stage holding all ``num_layers`` layers with ``dp = tp = 1``, schedule ``1f1b``, no
    recompute."""
    from hethub_jax.parallel.plan import Plan

    return Plan.from_dict({
        "description": "built-in default: one island, one stage, one device",
        "islands": [{"name": "main", "platform": platform, "num_processes": 1, "devices_per_process": 1}],
        "stages": [{"island": "main", "dp": 1, "tp": 1, "first_layer": 0, "last_layer": num_layers - 1}],
        "global_batch_size": global_batch_size, "microbatch_size": microbatch_size,
        "schedule": "1f1b", "recompute": "none"})


def check_plan_seq_len(plan, seq_len: int, where: str = "the plan") -> str | None:
    """Compare the sequence length a plan was made for (``plan.seq_len``, tokens per sample; written by
    the planner) with the training run's ``data.seq_len``.

    Returns None when they agree or the plan records none (hand-written plans), else a warning line
    for a SHORTER training sequence: every stage's memory is at most what the plan predicted
    (activations grow with the tokens per sample), so the plan still fits, but the planner might
    choose another plan for this length.

    Raises:
      ValueError: for a LONGER training sequence: the planner's memory check (and step time) was
        made for fewer tokens per microbatch and no longer holds; the message names both lengths and
        the two ways out (re-plan with ``--seq-len``, or train with the plan's length).
    """
    made = getattr(plan, "seq_len", None)
    if made is None or made == seq_len:
        return None
    if seq_len > made:
        raise ValueError(
            f"{where} was made for sequence length {made} (its seq_len) but training uses data.seq_len "
            f"{seq_len}: activation memory per device grows with the tokens per sample, so the plan's "
            f"memory check no longer holds. Re-plan for it (python -m hethub_jax.plan ... --seq-len {seq_len} --out PLAN.json) or train "
            f"with --seq-len {made}; to run this plan anyway at your own risk, set the plan's \"seq_len\" "
            f"to {seq_len}")
    return (f"WARNING: {where} was made for sequence length {made} (its seq_len), training uses data.seq_len "
            f"{seq_len}: it fits memory (less activation memory per device), but the planner chose it for "
            f"{made} tokens per sample and another plan may be faster at {seq_len}; re-plan with python -m "
            f"hethub_jax.plan ... --seq-len {seq_len}")


def _resolve_plan(cfg, platform: str):
    """The plan of the run with the config's batch sizes applied, validated against the model.

    Returns ``(plan, notes)``; notes say where batch sizes came from. Raises ValueError (plan
    validation) or OSError (unreadable plan file)."""
    from hethub_jax.config import DEFAULT_BATCH_SIZE
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.rules import check_batch

    t = cfg.train
    notes = []
    if t.plan is None:
        gbs = t.global_batch_size or DEFAULT_BATCH_SIZE
        mbs = t.microbatch_size or gbs
        check_batch(gbs, mbs, prefix="train.")
        plan = default_plan(gbs, mbs, cfg.model.num_hidden_layers, platform)
    else:
        try:
            plan = Plan.from_json(t.plan)
        except FileNotFoundError:
            raise ValueError(f"train.plan: file not found: {t.plan}") from None
        except ValueError as e:
            raise ValueError(f"train.plan {t.plan}: {e}") from None
        changes = {}
        if t.global_batch_size is not None and t.global_batch_size != plan.global_batch_size:
            changes["global_batch_size"] = t.global_batch_size
        if t.microbatch_size is not None and t.microbatch_size != plan.microbatch_size:
            changes["microbatch_size"] = t.microbatch_size
        if changes:
            notes.append("config overrides the plan's " + ", ".join(
                f"{k} {getattr(plan, k)} -> {v}" for k, v in changes.items()))
            plan = plan.replace(**changes)
        note = check_plan_seq_len(plan, cfg.data.seq_len, f"train.plan {t.plan}")
        if note:
            notes.append(note)
    try:
        plan.validate(cfg.model)
    except ValueError as e:
        where = f"train.plan {t.plan}" if t.plan else "built-in plan"
        raise ValueError(f"{where}: {e}") from None
    return plan, notes


def _prepare_devices(plan_path: str | None, island: str | None) -> None:
    """Before any JAX backend starts: in a CPU process running a multi-device plan, ask XLA for
    enough host devices (``--xla_force_host_platform_device_count``): the most any island of this
    process needs (under ``mpiexec``, this rank's island: ``island``, ``$HETHUB_ISLAND`` or the plan's
    island of the launcher's rank, so that no rank gets devices it leaves idle). Reads the plan JSON
    with the pure-Python plan module; errors are left to the validated load later."""
    if plan_path is None or "--xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        from hethub_jax.parallel.plan import Plan
        plan = Plan.from_json(plan_path)
    except Exception:  # reported properly by _resolve_plan
        return
    island = island or os.environ.get("HETHUB_ISLAND")
    if island is None and mpi_world_size() > 1 and plan.world_size == mpi_world_size():
        from hethub_jax.cluster import launcher_rank
        rank = launcher_rank()  # this rank's island in the plan: it gets only the devices that island uses
        island = plan.rank_island(rank).name if rank is not None and 0 <= rank < plan.world_size else None
    islands = [i for i in plan.islands if island is None or i.name == island]
    cpu = [i.devices_per_process for i in islands if i.platform == "cpu"]
    if cpu and max(cpu) > 1 and all(i.platform == "cpu" for i in islands):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={max(cpu)}").strip()


def mpi_world_size() -> int:
    """Ranks of the MPI job this process was launched in (1 without ``mpiexec``), read from the
    launcher's environment so that MPI is not initialised for single-process runs."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def start_mpi(plan_path: str | None, island: str | None, size: int, timeout: float = 300.0):
    """Multi-process start-up (DESIGN.md section 3) before any JAX backend starts: find this rank's
    island (``--island``, ``$HETHUB_ISLAND``, else the plan's island of this MPI rank), set its
    platform, split the world by island (``hethub_jax.cluster.start``). Returns the Island.

    Raises:
      ValueError: no plan, an unreadable plan or a job size other than the plan's (before MPI starts:
        the caller reports them with ``cluster.join_job(error)``).
      hethub_jax.cluster.StartFailed: another rank failed before MPI started.
      hethub_jax.cluster.SetUpFailed: on every rank, when a rank's island is not in the plan or
        disagrees with the plan's island of its rank (an agreement point after MPI started).
    """
    from hethub_jax.parallel.plan import Plan

    if plan_path is None:
        raise ValueError(f"an MPI job of {size} ranks needs a plan: train.plan / --plan PLAN.json")
    try:
        plan = Plan.from_json(plan_path)
    except FileNotFoundError:
        raise ValueError(f"train.plan: file not found: {plan_path}") from None
    if plan.world_size != size:
        raise ValueError(f"the plan needs {plan.world_size} MPI ranks (sum of the islands' num_processes), "
                         f"the job has {size}")
    from hethub_jax import cluster

    rank = cluster.join_job()  # MPI_Init and the start-up gate (raises cluster.StartFailed)

    name = island or os.environ.get(cluster.ENV_ISLAND) or plan.rank_island(rank).name
    error = None
    if name not in [i.name for i in plan.islands]:
        error = f"--island {name!r} is not an island of the plan: {[i.name for i in plan.islands]}"
    elif plan.rank_island(rank).name != name:
        error = (f"rank {rank} runs island {name!r} but the plan gives rank {rank} to island "
                 f"{plan.rank_island(rank).name!r} (islands take consecutive ranks in plan order; "
                 f"list the mpiexec parts in that order)")
    cluster.agree_errors(error, timeout)  # every rank ends (cluster.SetUpFailed) if one found an error
    cluster.install_abort_on_exception(rank=rank, island=name)
    island_ = cluster.start(island=name, platform=plan.island(name).platform, timeout=timeout)
    # one line per rank, so that a launcher's report of a dead pid ("BAD TERMINATION ... PID 4852")
    # names the rank and island
    import socket
    _say(f"rank {rank} (island {name}): pid {os.getpid()} on host {socket.gethostname()}")
    return island_


# ---------------------------------------------------------------------------------------------------
# reporting

def plan_summary(plan, model_config, shares=None) -> list[str]:
    """Human-readable lines: islands, each replica's stages (layer ranges, dp x tp, devices),
    batch shares (samples; default the plan's), microbatches, schedule."""
    lines = []
    for isl in plan.islands:
        emu = f", EMULATED {isl.slowdown:g}x slower" if isl.slowdown > 1 else ""
        lines.append(f"  island {isl.name}: platform {isl.platform}, {isl.num_processes} process(es) x "
                     f"{isl.devices_per_process} device(s){emu}")
    shares = plan.batch_shares() if shares is None else shares
    for r, rep in enumerate(plan.replicas):
        head = f"  replica {r}: " if plan.num_replicas > 1 else "  "
        lines.append(f"{head}{rep.num_stages} stage(s), batch share {shares[r]} samples = "
                     f"{shares[r] // plan.microbatch_size} microbatch(es) of {plan.microbatch_size}")
        for s, st in enumerate(rep.stages):
            extra = []
            if st.is_first:
                extra.append("embedding")
            if st.is_last:
                extra.append("norm+head+loss")
            lines.append(f"    stage {s} on {st.island}: layers {st.first_layer}-{st.last_layer} "
                         f"({st.num_layers} of {model_config.num_hidden_layers}), dp {st.dp} x tp {st.tp}, "
                         f"devices {plan.stage_devices(r, s)}" + (f" [+{', '.join(extra)}]" if extra else ""))
    lines.append(f"  global batch {plan.global_batch_size} samples, schedule {plan.schedule}, "
                 f"recompute {plan.recompute}")
    return lines


def _versions() -> dict[str, str]:
    import importlib.metadata as md
    out = {"python": _platform.python_version()}
    for name in ("hethub-jax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


# ---------------------------------------------------------------------------------------------------
# set-up: every failure here is a configuration error (_ConfigError), reported before any compilation

class _ConfigError(Exception):
    """A configuration error found during set-up: ``main`` prints it as one line and returns 2."""


@dataclasses.dataclass
class _Run:
    """What set-up produces and the rest of ``main`` reads.

    Attributes:
      args: the parsed command line.
      cfg: the validated config (``hethub_jax.config``).
      plan: the validated plan (config batch sizes applied).
      plan_notes: where the batch sizes came from (lines for the banner).
      comm, rank, world_size, island: this process's place in an MPI job (None, 0, 1, None without).
      train_ds, val_ds: the ``hethub_jax.data.TokenDataset`` splits.
      rt: the ``PipelineRuntime``.
      log: whether this rank prints and writes the metrics file and trace (the logging rank).
      emulation: the runtime's EMULATED lines (empty without emulated slowdowns).
      share_source: where the heterogeneous-DP batch shares came from (``"plan"`` or the warm-up).
      start_step: steps already done (resume), 0 otherwise.
      resuming: whether this run resumes: ``train.resume``, or with ``train.resume`` null whether
        ``checkpoint_dir`` holds a complete checkpoint (:func:`_resolve_resume`).
      idle_devices: the devices of the run's processes that no stage uses (:func:`idle_devices`; the run
        record's ``idle_devices``).
    """

    args: argparse.Namespace
    cfg: Any
    plan: Any
    plan_notes: list[str]
    comm: Any
    rank: int
    world_size: int
    island: Any
    train_ds: Any
    val_ds: Any
    rt: Any = None
    log: bool = True
    emulation: list[str] = dataclasses.field(default_factory=list)
    share_source: str = "plan"
    start_step: int = 0
    prediction: Any = None  # train_predict.RunPrediction of the plan (PREDICTED), or None
    prediction_note: str = ""  # why there is none
    locks: list = dataclasses.field(default_factory=list)
    saver: Any = None
    resumed_from: dict | None = None
    resuming: bool = False  # train.resume, with null resolved (``_resolve_resume``)
    idle_devices: list = dataclasses.field(default_factory=list)  # ``idle_devices``: devices no stage uses


def _load_config(args: argparse.Namespace):
    """The validated config: file, then ``--set``, then the dedicated flags."""
    overrides = list(args.overrides)
    if args.no_checkpoint:
        overrides.append("train.checkpoint_dir=null")
    _prepare_devices(args.plan, args.island)
    try:
        from hethub_jax.config import load_config
        return load_config(args.config, overrides, _flags(args))
    except ValueError as e:  # ConfigError is a ValueError
        raise _ConfigError(str(e)) from None


def _start_processes(cfg, args: argparse.Namespace):
    """``(comm, rank, world_size, island)``: under ``mpiexec`` this rank's island is started
    (``start_mpi``, before JAX is imported); a single process gets ``(None, 0, 1, None)``."""
    size = mpi_world_size()
    if size <= 1:
        return None, 0, 1, None
    try:
        island = start_mpi(cfg.train.plan, args.island, size, timeout=cfg.train.message_timeout_s)
    except ValueError as e:
        raise _ConfigError(str(e)) from None
    return island.world, island.world.rank, island.world.size, island


def _load_plan_and_data(cfg):
    """``(plan, notes, train_ds, val_ds)``: the plan (``_resolve_plan``; checked for checkpointing if
    checkpoints are on) and the datasets, checked against the model's vocabulary and the global batch."""
    import jax

    from hethub_jax import checkpoint as ckpt
    from hethub_jax.data import build_datasets

    try:
        plan, notes = _resolve_plan(cfg, jax.default_backend())
        if cfg.train.checkpoint_dir is not None:
            ckpt.check_supported(plan)
    except (ValueError, OSError) as e:
        raise _ConfigError(str(e)) from None
    try:
        train_ds, val_ds, tokenizer = build_datasets(cfg.data)
    except (ValueError, OSError, TypeError) as e:
        raise _ConfigError(f"data: {e}") from None
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise _ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) must be >= the tokenizer's vocabulary "
                           f"({tokenizer.vocab_size} ids)")
    try:
        train_ds.batches(plan.global_batch_size)  # checks the batch size against the split at the call
        val_ds.batches(plan.global_batch_size)
    except ValueError as e:
        raise _ConfigError(f"train.global_batch_size: {e}") from None
    return plan, notes, train_ds, val_ds


def _check_launch(run: _Run) -> None:
    """``--island`` needs ``mpiexec``; this process's devices (``_check_devices``); under MPI every rank
    then checks that all ranks run the same config and plan (``cluster.handshake``). The per-rank checks
    come first, so that a rank failing them is aborted while its peers wait in the handshake, before
    any of them locks or probes an output directory (``_check_outputs``)."""
    plan = run.plan
    if run.comm is None and plan.world_size > 1 and run.args.island is not None:
        raise _ConfigError(f"--island {run.args.island}: the plan has {plan.world_size} ranks; run it under "
                           f"mpiexec -n {plan.world_size}, or without --island to run every island in one "
                           f"process")
    counts = _agreed(run.comm, lambda: _check_devices(run), run.cfg.train.message_timeout_s)
    if run.comm is not None:
        import jax

        from hethub_jax import cluster
        digest = cluster.config_hash(run.cfg.to_dict(), plan.to_dict())

        def shake():
            try:
                return cluster.handshake(run.comm, cluster.handshake_record(
                    digest, run.island.name, run.island.platform, jax.local_device_count(),
                    config={"config": run.cfg.to_dict(), "plan": plan.to_dict()}),
                    timeout=run.cfg.train.message_timeout_s)
            except cluster.HandshakeError as e:  # the same message on every rank: printed once
                raise _ConfigError(str(e)) from None
        records = _agreed(run.comm, shake, run.cfg.train.message_timeout_s)
        counts = {r: rec["local_device_count"] for r, rec in enumerate(records)}
    run.idle_devices = idle_devices(plan, counts)
    note = unused_devices_note(plan, counts, built_in=run.cfg.train.plan is None, planned=run.args.cluster)
    if note:
        run.plan_notes.append(note)


def _check_devices(run: _Run) -> dict:
    """The islands this process runs (all of them without MPI) have their platform here and no more
    devices per process than this process has. Returns the devices this process has: ``{platform:
    count}`` without MPI, ``{rank: count}`` (this rank's local devices) under MPI."""
    import jax

    islands = [run.plan.island(run.island.name)] if run.island is not None else list(run.plan.islands)
    counts: dict = {}
    for isl in islands:
        try:
            devs = jax.devices(isl.platform) if run.island is None else jax.local_devices()
        except RuntimeError:
            raise _ConfigError(f"island {isl.name!r} has platform {isl.platform!r}, which this machine does not "
                               f"have (JAX backend: {jax.default_backend()})") from None
        if isl.devices_per_process > len(devs):
            raise _ConfigError(f"island {isl.name!r} needs devices_per_process={isl.devices_per_process} "
                               f"{isl.platform} devices, this process has {len(devs)}")
        counts[isl.platform if run.island is None else run.rank] = len(devs)
    return counts


def used_device_indices(plan, island: str, process: int | None = None) -> set[int]:
    """The island-local device indices (``Plan.stage_devices``) that the stages of ``island`` run on;
    with ``process``, only that process's (indices ``process * devices_per_process`` onwards), counted
    from 0 inside the process."""
    isl = plan.island(island)
    used = {i for r, rep in enumerate(plan.replicas) for s, st in enumerate(rep.stages) if st.island == island
            for i in plan.stage_devices(r, s)}
    if process is None:
        return used
    lo = process * isl.devices_per_process
    return {i - lo for i in used if lo <= i < lo + isl.devices_per_process}


def _ranges(idx: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    out: list[str] = []
    for i in sorted(idx):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def idle_devices(plan, counts: dict) -> list[dict]:
    """The JAX devices of the run's processes that no stage of ``plan`` uses, one record per process that
    has any (``[]`` when every device is used); the run record's ``idle_devices`` (metrics file).

    Args:
      plan: the validated plan.
      counts: devices present: ``{platform: count}`` for a single process running every island (the
        islands of one platform then share that process's devices, indices from 0), or ``{rank:
        count}`` (local devices of each MPI rank, from the start-up handshake).

    Returns:
      Single process: ``{"platform", "devices" (count), "used", "idle"}`` per platform; under MPI:
      ``{"rank", "island", "platform", "devices", "used", "idle"}`` per rank; ``used`` and ``idle`` are
      sorted local device indices.
    """
    out = []
    if all(isinstance(k, str) for k in counts):  # one process runs every island
        for platform, have in counts.items():
            used = set().union(*(used_device_indices(plan, i.name) for i in plan.islands if i.platform == platform))
            idle = [i for i in range(have) if i not in used]
            if idle:
                out.append({"platform": platform, "devices": have, "used": sorted(used), "idle": idle})
    else:
        for rank, have in sorted(counts.items()):
            isl = plan.rank_island(rank)
            used = used_device_indices(plan, isl.name, plan.process_index(rank))
            idle = [i for i in range(have) if i not in used]
            if idle:
                out.append({"rank": rank, "island": isl.name, "platform": isl.platform, "devices": have,
                            "used": sorted(used), "idle": idle})
    return out


def _idle_summary(records: list[dict]) -> str:
    """``"1 of 2 on island fast, 2 of 4 on island slow"`` (per island, summed over its ranks), or for one
    process running every island ``"3 of 4 cpu devices of this process"``."""
    per: dict[str, list[int]] = {}
    for r in records:
        key = f"island {r['island']}" if "island" in r else f"{r['platform']} devices of this process"
        n = per.setdefault(key, [0, 0])
        n[0], n[1] = n[0] + len(r["idle"]), n[1] + r["devices"]
    return ", ".join(f"{idle} of {have} {'on ' if k.startswith('island') else ''}{k}"
                     for k, (idle, have) in per.items())


def unused_devices_note(plan, counts: dict, built_in: bool = False, planned: str | None = None) -> str | None:
    """A line when processes of the run have JAX devices that no stage of ``plan`` uses
    (:func:`idle_devices`), else None. A WARNING, not an error: the plan is explicit (unlike MaxText,
    whose mesh is derived from every visible device and which fails when the product of the parallel
    degrees differs from the device count, or Megatron, which derives DP from the world size), and the
    built-in one-device plan must run on a multi-device machine; but idle accelerators are almost never
    what a user wants.

    Args:
      plan: the validated plan.
      counts: devices present, as :func:`idle_devices` takes them.
      built_in: the plan is the built-in default (no ``--plan``): the advice says so.
      planned: the cluster spec of plan-less training (``--cluster``): the plan is the planner's choice,
        which left the devices idle on purpose (the fastest plan it PREDICTED); the line (a plan note,
        which the banner prints after ``note:``) is then a short summary, per island how many of its
        devices are idle and why, under 120 characters; the per-rank device indices are in the metrics
        file's run record (``idle_devices``).
    """
    records = idle_devices(plan, counts)
    if not records:
        return None
    if planned is not None:
        return f"devices left idle: {_idle_summary(records)}: unused by the planner's fastest PREDICTED plan"
    parts = []
    for r in records:
        if "rank" in r:
            parts.append(f"rank {r['rank']} (island {r['island']}) has {r['devices']} {r['platform']} device(s), "
                         f"the plan uses {len(r['used'])}; unused local device(s): {_ranges(r['idle'])}")
        else:
            parts.append(f"this process has {r['devices']} {r['platform']} device(s), the plan uses "
                         f"{len(r['used'])} (indices {_ranges(r['used'])}); unused: {_ranges(r['idle'])}")
    head = "the built-in plan (one island, one stage, one device)" if built_in else "the plan"
    return (f"WARNING: unused devices: {'; '.join(parts)}. They stay idle: {head} does not use them. To use "
            f"them, give a plan whose stages cover them (python -m hethub_jax.train --plan PLAN.json): more data "
            f"parallelism (a stage's dp), tensor parallelism (tp) or more stages on the island, with its "
            f"devices_per_process raised to the devices each process has (docs/plan_format.md), or let the "
            f"planner choose (--cluster CLUSTER.yaml, docs/planner.md); to silence this, hide them "
            f"(CUDA_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES, or XLA_FLAGS "
            f"--xla_force_host_platform_device_count for CPU devices)")


def _check_outputs(run: _Run) -> None:
    """Before anything is compiled: the logging rank locks the output directories (checkpoint
    directory; the metrics file's directory) against a second run (``checkpoint.DirLock``); every rank
    probes that the checkpoint directory is writable with free space (``checkpoint.probe_writable``).
    Then (``_check_resume``) ``--resume`` (without ``--resume-or-start``) needs a complete checkpoint."""
    from hethub_jax import checkpoint as ckpt

    t = run.cfg.train
    outputs = [("train.checkpoint_dir", t.checkpoint_dir, os.path.join(t.checkpoint_dir or "", ".lock")),
               ("train.metrics_file", t.metrics_file and os.path.dirname(os.path.abspath(t.metrics_file)),
                os.path.abspath(t.metrics_file or "") + ".lock")]
    for field, directory, lock in outputs:
        if directory is None:
            continue
        try:
            ckpt.probe_writable(directory, nbytes=(1 << 20) if field == "train.checkpoint_dir" else 4096)
            if run.rank == 0:
                run.locks.append(ckpt.DirLock(lock))
        except (OSError, ckpt.CheckpointError) as e:
            raise _ConfigError(f"{field}: {e}") from None


def _check_resume(run: _Run) -> None:
    """``--resume`` (without ``--resume-or-start``) needs a complete checkpoint; a checkpoint to resume
    from must be of this model and data set-up (``checkpoint.check_compatible``: the newest step whose
    ``meta.json`` reads; an unreadable one is left to resuming, which falls back past it with a warning)."""
    from hethub_jax import checkpoint as ckpt

    t = run.cfg.train
    steps = _resolve_resume(run)
    if t.resume and not t.resume_or_start and not steps:
        raise _ConfigError(f"train.resume: no complete checkpoint in {t.checkpoint_dir} to resume from "
                           f"(use --resume-or-start / train.resume_or_start to start from step 0 then)")
    try:
        for step in steps if run.resuming else []:
            try:
                meta = ckpt.read_meta(t.checkpoint_dir, step)
            except ckpt.CheckpointCorrupt:
                continue  # resuming warns and falls back to the previous step (checkpoint.restore_latest)
            ckpt.check_compatible(meta, run.cfg.to_dict(), run.plan.global_batch_size,
                                  where=f"checkpoint {ckpt.step_dir(t.checkpoint_dir, step)}")
            break
    except (ckpt.CheckpointMismatch, ckpt.CheckpointError) as e:
        raise _ConfigError(f"train.resume: {e}{_null_resume_hint(t)}") from None


class _NothingToDo(Exception):
    """Set-up found that the newest checkpoint already reaches ``train.steps`` (:func:`finished_step`,
    agreed by every rank): ``main`` prints :func:`nothing_to_do_line` on rank 0 and returns 0 on every rank."""

    def __init__(self, step: int, train: Any, rank: int):
        self.step, self.train, self.rank = step, train, rank
        super().__init__(nothing_to_do_line(step, train))


def finished_step(cfg, global_batch_size: int) -> int | None:
    """The step of the newest complete checkpoint in ``train.checkpoint_dir`` when this run would resume
    from it (``train.resume`` null or true) and it already reaches ``train.steps``, so that there is
    nothing to train; else None. Reads only the directory listing, that step's ``meta.json`` and its CRC
    files (``checkpoint.looks_saved``), so that a rerun of a finished run is found before profiling,
    planning, compiling or any warm-up.

    None also when the directory, that step's ``meta.json`` or a CRC file does not read (or a unit
    directory is empty), or the step was written for another model / data set-up / global batch
    (``checkpoint.check_compatible`` with ``global_batch_size``, samples): the usual resume path then
    reports the mismatch or the corrupt step, or falls back past it. The step's arrays are not read (their
    checksums are verified when a run restores them, e.g. with a larger ``--steps``).

    Args:
      cfg: the validated config (``hethub_jax.config.TrainConfig``).
      global_batch_size: the run's global batch (samples): the plan's, or for plan-less training the one
        the planner is asked for (``train.global_batch_size``, else ``config.DEFAULT_BATCH_SIZE``).
    """
    from hethub_jax import checkpoint as ckpt

    t = cfg.train
    if t.checkpoint_dir is None or t.resume is False:
        return None
    try:
        steps = ckpt.complete_steps(t.checkpoint_dir, cfg.model.num_hidden_layers)
    except OSError:  # an unreadable directory: reported by the output checks that follow
        return None
    if not steps or steps[0] < t.steps or not ckpt.looks_saved(t.checkpoint_dir, steps[0], cfg.model.num_hidden_layers):
        return None
    try:
        meta = ckpt.read_meta(t.checkpoint_dir, steps[0])
        ckpt.check_compatible(meta, cfg.to_dict(), global_batch_size, where=f"checkpoint step {steps[0]}")
    except (ckpt.CheckpointError, ckpt.CheckpointMismatch):
        return None
    return steps[0]


def nothing_to_do_line(step: int, t) -> str:
    """The one line a run prints when its checkpoint ``step`` already reaches ``train.steps`` (``t``:
    ``TrainSettings``): the step, that nothing was changed, and how to train further."""
    return (f"nothing to do: the newest checkpoint, step {step} in {t.checkpoint_dir}, already reaches "
            f"train.steps={t.steps} (the outputs are kept). To train further: --steps M with M > {step} resumes from "
            f"step {step} (optim.decay_steps defaults to train.steps, so the cosine decay then spans M steps: "
            f"README); --no-resume starts again from step 0")


def _agreed_finished_step(cfg, global_batch_size: int, size: int, timeout: float) -> int | None:
    """:func:`finished_step` when every rank found the same (one checkpoint directory that every rank
    sees: a shared file system), else None on every rank: the run then goes on to the usual resume
    checks, which report ranks that see different checkpoint steps (``checkpoint.agree_steps``), so that
    every rank takes the same path and none waits for a rank that has left. ``size``: the MPI job's ranks
    (1: no MPI; else MPI has started, and every rank calls this at the same point).

    Raises:
      TimeoutError: under MPI, a rank did not arrive within ``timeout`` seconds (``cluster.gather_texts``).
    """
    step = finished_step(cfg, global_batch_size)
    if size <= 1:
        return step
    from hethub_jax import cluster

    seen = cluster.gather_texts("none" if step is None else str(step), timeout,
                                what="the check of the newest checkpoint")
    return step if len(set(seen.values())) == 1 else None


def _null_resume_hint(t) -> str:
    """For an error about the checkpoints a run resumes from: with ``train.resume`` null (the run
    resumes because it found them, not because it was asked), how to start from step 0 instead."""
    return ("" if t.resume else f" (train.resume is null: a run resumes from the checkpoints in "
            f"{t.checkpoint_dir} when there are any; --no-resume starts from step 0 and moves them aside, "
            f"or give another --checkpoint-dir)")


def _resolve_resume(run: _Run) -> list[int]:
    """Sets ``run.resuming`` and returns the complete checkpoint steps in ``train.checkpoint_dir`` (newest
    first). ``train.resume`` null (the default): resume when there is one. False with checkpoints
    there: rank 0 moves every ``step_*`` directory into ``checkpoint_dir/earlier_run_<N>/`` (said at
    start; nothing is deleted) so that this run's saves never mix with them. Under MPI the ranks must see
    the same checkpoints (a shared file system).

    Raises:
      _ConfigError: the ranks of an MPI job see different complete steps (``checkpoint.agree_steps``),
        with the same message on every rank."""
    import re
    from pathlib import Path

    from hethub_jax import checkpoint as ckpt

    t = run.cfg.train
    steps = ckpt.complete_steps(t.checkpoint_dir, run.cfg.model.num_hidden_layers) if t.checkpoint_dir else []
    try:
        ckpt.agree_steps(run.comm, steps, t.checkpoint_dir)  # under MPI: every rank sees the same steps
    except ckpt.CheckpointError as e:  # the same message on every rank: printed once
        raise _ConfigError(f"train.checkpoint_dir: {e}") from None
    run.resuming = bool(t.resume) or (t.resume is None and bool(steps))
    say = (lambda m: print(m, flush=True)) if run.rank == 0 else (lambda m: None)
    if t.resume is None and steps:
        say(f"resume: {t.checkpoint_dir} holds complete checkpoint step(s) {', '.join(map(str, steps))}: "
            f"continuing from step {steps[0]} (train.resume null resumes when there is one; --no-resume "
            f"starts from step 0)")
    elif t.resume is False and steps and run.rank == 0:
        root = Path(t.checkpoint_dir)
        n = 1
        while (root / f"earlier_run_{n}").exists():
            n += 1
        aside = root / f"earlier_run_{n}"
        aside.mkdir()
        for p in sorted(root.iterdir()):
            if p.is_dir() and re.fullmatch(r"step_\d+", p.name):
                p.rename(aside / p.name)
        say(f"--no-resume: starting from step 0; the earlier run's checkpoint step(s) "
            f"{', '.join(map(str, steps))} moved to {aside}")
    return steps


def _agreed(comm, step, timeout: float):
    """``step()``'s result. Under MPI (``comm`` not None: every rank started) every rank then passes an
    agreement point (``cluster.agree_errors``), so that a configuration error found by some ranks ends
    every rank with status 2 (``main`` prints each distinct error once) and none waits in a later
    collective. Without MPI a ``_ConfigError`` propagates as it is.

    Raises:
      _ConfigError: without MPI, ``step``'s.
      hethub_jax.cluster.SetUpFailed: under MPI, on every rank, when ``step`` failed on any rank.
    """
    if comm is None:
        return step()
    from hethub_jax import cluster

    error, result = None, None
    try:
        result = step()
    except _ConfigError as e:
        error = str(e)
    cluster.agree_errors(error, timeout)
    return result


def _set_up(args: argparse.Namespace) -> _Run:
    """Config, processes, plan, data, launch checks and the pipeline runtime, in that order.

    Raises:
      _NothingToDo: the newest checkpoint already reaches ``train.steps`` (:func:`finished_step`, agreed by
        every rank): plan-less training finds it before profiling and planning, other runs after the
        launch checks, before any output is locked or anything compiled.
      _ConfigError: any configuration error, before anything is compiled.
    """
    cfg = _load_config(args)
    _check_insight_deps(args)
    if "cpu" in os.environ.get("JAX_PLATFORMS", "cpu") or not os.environ.get("JAX_PLATFORMS"):
        # CPU islands: the steady host allocator before the JAX backend starts (its threads then allocate
        # from the one glibc arena; hethub_jax.host_allocator); a JAX_PLATFORMS without cpu is left alone
        from hethub_jax.host_allocator import steady_host_allocator
        try:
            steady_host_allocator()
        except ValueError as e:  # a malformed $HETHUB_HOST_ALLOCATOR_MMAP_MIB
            raise _ConfigError(str(e)) from None
    if args.cluster:
        _pin_cpu_islands(args.cluster)
    planned = _plan_from_cluster(args, cfg) if args.cluster else None
    if planned is not None:
        cfg = _load_config(args)  # with train.plan = the written plan.json
    comm, rank, world_size, island = _start_processes(cfg, args)
    timeout = cfg.train.message_timeout_s
    plan, notes, train_ds, val_ds = _agreed(comm, lambda: _load_plan_and_data(cfg), timeout)
    run = _Run(args=args, cfg=cfg, plan=plan, plan_notes=notes, comm=comm, rank=rank,
               world_size=world_size, island=island, train_ds=train_ds, val_ds=val_ds)
    _check_launch(run)
    if planned is None:  # (plan-less training checked before planning) a finished run ends before any warm-up
        done = _agreed_finished_step(cfg, plan.global_batch_size, world_size, timeout)
        if done is not None:
            raise _NothingToDo(done, cfg.train, rank)
    try:
        _agreed(comm, lambda: _check_outputs(run), timeout)
        _agreed(comm, lambda: _check_resume(run), timeout)
        from hethub_jax.parallel.runtime import PipelineRuntime

        def runtime():
            try:
                return PipelineRuntime(plan, cfg.model, cfg.optim, seed=cfg.train.seed, comm=comm, rank=rank,
                                       timeout_s=timeout)
            except ValueError as e:
                raise _ConfigError(str(e)) from None
        run.rt = _agreed(comm, runtime, timeout)
        run.rt.set_grad_buckets(cfg.train.grad_bucket_mb)
        run.log = run.rt.is_logging_rank
        run.emulation = run.rt.emulation_lines()
        _attach_prediction(run, planned)
    except BaseException:
        _release_locks(run)  # main() never sees this run: its lock files go here
        raise
    return run


def _release_locks(run: _Run) -> None:
    """Releases (and deletes) the run's output-directory lock files (``checkpoint.DirLock``)."""
    while run.locks:
        run.locks.pop().release()


def _plan_from_cluster(args: argparse.Namespace, cfg):
    """``--cluster``: rank 0 profiles (or reuses ``--profiles``), a 2-rank job measures the bridge's all-reduce
    between its ranks (or reuses the saved one), rank 0 plans, every rank gets the same plan
    (``train_predict.plan_from_cluster``); sets ``args.plan`` to the written plan.json. Returns the
    ``RunPrediction``. Raises _ConfigError for ``--plan`` with ``--cluster`` or (one process) a planning
    error; under MPI a planning error ends every rank at an agreement point (``cluster.SetUpFailed``)."""
    from hethub_jax.config import DEFAULT_BATCH_SIZE
    from hethub_jax.train_predict import plan_from_cluster

    if cfg.train.plan is not None:
        raise _ConfigError("--cluster plans the run itself: give --cluster or --plan (train.plan), not both")
    size = mpi_world_size()
    rank = 0
    if size > 1:
        from hethub_jax import cluster
        rank = cluster.join_job()  # every rank passed its own checks before rank 0 profiles and plans
    t = cfg.train
    # a rerun of a finished run ends here, before the profile is measured or reused and before planning
    done = _agreed_finished_step(cfg, t.global_batch_size or DEFAULT_BATCH_SIZE, size, t.message_timeout_s)
    if done is not None:
        raise _NothingToDo(done, t, rank)
    out_dir = planned_dir(t.metrics_file)
    spec = cfg.model_spec
    preset = spec if isinstance(spec, str) else spec.get("preset", "tiny") if isinstance(spec, dict) else "tiny"
    say = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)

    def plan_it():
        try:
            return plan_from_cluster(
                cfg.model, preset, args.cluster, global_batch=t.global_batch_size or DEFAULT_BATCH_SIZE,
                seq_len=cfg.data.seq_len, microbatch_size=t.microbatch_size, profiles_dir=args.profiles,
                out_dir=out_dir, rank=rank, world_size=size, log=say, grad_bucket_mb=t.grad_bucket_mb,
                timeout_s=t.message_timeout_s)
        except (ValueError, OSError) as e:  # a planning error is shared by every rank: printed once
            raise _ConfigError(str(e)) from None
    path, pred, lines = _agreed(True if size > 1 else None, plan_it, t.message_timeout_s)
    for line in lines:
        say(line)
    args.plan = os.path.normpath(path)
    return pred


def _pin_cpu_islands(cluster_path: str) -> None:
    """Plan-less training of a cluster whose groups are all CPU islands, under a launcher of several
    ranks on this host: pins this rank to its own share of the host's cores before MPI, the profile and
    JAX start (``core_pinning.pin_local_rank``: the islands then compute on disjoint cores, as islands
    of a real cluster own their devices, and rank 0's profile is measured on its island's cores, so
    that the PREDICTED step follows how the run executes; issue 17). Prints one line per rank. A
    cluster spec that does not load is left to the planner's error."""
    if mpi_world_size() <= 1:
        return
    try:
        from hethub_jax.planner.cluster import load_cluster
        groups = load_cluster(cluster_path).resolved().groups
    except Exception:  # reported by _plan_from_cluster
        return
    if not groups or not all(g.platform == "cpu" for g in groups):
        return
    from hethub_jax.core_pinning import pin_local_rank
    line = pin_local_rank()
    if line:
        _say(line)


def planned_dir(metrics_file: str | None) -> str:
    """Where plan-less training writes ``plan.json`` (and, without ``--profiles``, ``profiles/``): the
    metrics file's directory in the form the user gave it (relative stays relative: every path the run
    prints, e.g. its ``outputs:`` line, is as given or derived from one as given), ``os.curdir`` for a
    metrics file without a directory part; ``runs/planned`` without a metrics file."""
    if not metrics_file:
        return os.path.join("runs", "planned")
    return os.path.dirname(metrics_file) or os.curdir


def _check_insight_deps(args: argparse.Namespace) -> None:
    """``--tensorboard`` needs tensorboardX, ``--timeline-png`` matplotlib: a configuration error up front."""
    import importlib.util

    from hethub_jax.train_insight import TENSORBOARD_MISSING
    if args.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise _ConfigError(TENSORBOARD_MISSING)
    if args.timeline_png and importlib.util.find_spec("matplotlib") is None:
        raise _ConfigError("--timeline-png needs matplotlib (a dependency of hethub-jax): pip install matplotlib")
    if args.cluster and args.plan:
        raise _ConfigError("--cluster plans the run itself: give --cluster or --plan, not both")


def _attach_prediction(run: _Run, planned) -> None:
    """The run's PREDICTED step (``train_predict.predict_run``): the planner's when plan-less, else from
    ``--profiles`` or the catalog's ``cpu`` entry. A plan the predictor cannot cost gets a note instead."""
    if planned is not None:
        run.prediction = planned
        return
    from hethub_jax.train_predict import predict_run
    try:
        run.prediction = predict_run(run.cfg.model, run.plan, run.cfg.data.seq_len, profiles_dir=run.args.profiles,
                                     grad_bucket_mb=run.cfg.train.grad_bucket_mb)
    except (ValueError, OSError) as e:
        run.prediction_note = f"no prediction: {e}"


# ---------------------------------------------------------------------------------------------------
# warm-up and resume

def _warm_up_batch_shares(run: _Run) -> None:
    """Heterogeneous DP: unless the plan gives batch shares or throughputs, measure each replica's
    step on one batch (``PipelineRuntime.measure_step_costs``: seconds per sample with the gradient
    all-reduce as in training, and the fixed update time; no update is applied) and give the shares
    that balance the replicas' step times (``plan.balanced_shares``, in whole microbatches). Sets
    ``run.share_source``."""
    plan, rt = run.plan, run.rt
    if plan.num_replicas == 1 or any(r.batch_share is not None or r.throughput is not None
                                     for r in plan.replicas):
        return
    from hethub_jax.parallel.plan import balanced_shares

    if run.log:
        print("heterogeneous DP: measuring replica step costs in a warm-up (forward/backward with the "
              "gradient all-reduce on one batch, the update on copies)...", flush=True)
    warm = next(iter(run.train_ds.batches(plan.global_batch_size)))
    unit_s, fixed_s = rt.measure_step_costs(warm, steps=2)
    mbs = plan.microbatch_size
    units = balanced_shares(plan.global_batch_size // mbs, [u * mbs for u in unit_s], fixed_s)
    rt.set_batch_shares([u * mbs for u in units])
    run.share_source = "warm-up: " + ", ".join(f"replica {r} {1 / u:.6g} samples/s + {f:.6g} s/step fixed"
                                               for r, (u, f) in enumerate(zip(unit_s, fixed_s)))
    if run.log:
        print(f"heterogeneous DP: measured {run.share_source}"
              + (" (EMULATED slowdowns included)" if run.emulation else "")
              + f" -> batch shares {rt.shares}", flush=True)


def _warm_up_grad_allreduce(run: _Run) -> None:
    """``train.grad_bucket_mb: auto``: :func:`warm_up_grad_allreduce` on the run's runtime, its warm-up
    batch the training set's first global batch (read only when something is timed)."""
    warm_up_grad_allreduce(run.rt, lambda: next(iter(run.train_ds.batches(run.plan.global_batch_size))),
                           log=run.log, emulated=bool(run.emulation))


def warm_up_grad_allreduce(rt: Any, batch: Any, log: bool = False, emulated: bool = False) -> dict | None:
    """``train.grad_bucket_mb: auto``'s decision, the ONE copy (training's warm-up and
    ``benchmarks/hetero_e2e.py`` call it): after the batch shares are set, time the step's forward/backward
    with the gradient all-reduce in buckets and after the whole backward on one batch and keep the faster
    (``PipelineRuntime.choose_grad_buckets``: each path once untimed, then 3 each interleaved, the slowest
    rank's seconds, the fastest step per path; ``plan.keeps_bucketed_allreduce``: bucketed only when faster
    by more than 2%; no update is applied); with ``log`` prints both MEASURED seconds and the kept path.

    Args:
      rt: a ``PipelineRuntime`` (its ``set_grad_buckets("auto")`` called; anything else: nothing to do).
      batch: the warm-up batch (the global batch's arrays, the same on every rank) or a function of no
        arguments returning it, called only when something is timed.
      log: print the lines (rank 0); emulated: say that the seconds include EMULATED slowdowns.

    Returns:
      the runtime's record (``rt.grad_bucket_choice``: ``{"path", "bucketed_s", "unbucketed_s", "bucket_mb",
      "steps", "reason"}``, seconds MEASURED; ``path`` None and ``reason`` set when the plan cannot bucket,
      nothing timed), or None when ``auto`` is not pending (a number, null, or already decided).
      Collective: every rank of the runtime calls it with the same batch.
    """
    if not getattr(rt, "grad_bucket_auto_pending", False):
        return None
    if rt.grad_bucket_off_reason() is not None:
        return rt.choose_grad_buckets({})  # records why nothing is timed (no batch is read)
    if log:
        print("heterogeneous DP: train.grad_bucket_mb auto: timing the gradient all-reduce in buckets and after "
              "the backward in a warm-up (forward/backward on one batch, no update)...", flush=True)
    c = rt.choose_grad_buckets(batch() if callable(batch) else batch)
    if log:
        print(f"heterogeneous DP: MEASURED step forward/backward + all-reduce: bucketed ({c['bucket_mb']:g} MiB) "
              f"{c['bucketed_s']:.4g} s, after the backward {c['unbucketed_s']:.4g} s (fastest of {c['steps']}"
              + (", EMULATED slowdowns included" if emulated else "")
              + f") -> keeps the {'bucketed' if c['path'] == 'bucketed' else 'unbucketed (after the backward)'} "
                f"all-reduce", flush=True)
    return c


def _predict_kept_path(run: _Run) -> None:
    """After ``train.grad_bucket_mb: auto``'s warm-up: when the MEASURED choice (``rt.grad_bucket_choice``)
    keeps the other gradient all-reduce path than the PREDICTED one (``Prediction.grad_allreduce``, the
    path ``plan.keeps_bucketed_allreduce`` keeps on the two PREDICTED steps), the run's prediction is
    made again on the kept path (``train_predict.prediction_on_kept_path``, which
    ``benchmarks/hetero_e2e.py`` calls too), so that the banner, the metrics' ``run.prediction`` and the
    measured against PREDICTED step time all speak of the path this run trains (both paths' PREDICTED
    steps are kept beside it). No-op without a prediction, a choice, or a plan that cannot bucket."""
    rp = run.prediction
    if rp is None:
        return
    from hethub_jax.train_predict import prediction_on_kept_path
    p = rp.prediction
    new = prediction_on_kept_path(run.cfg.model, run.plan, p, rp.costs, rp.seq_len, rp.bridge,
                                  getattr(run.rt, "grad_bucket_choice", None))
    if new is p:
        return
    run.prediction = dataclasses.replace(rp, prediction=new)
    if run.log:
        print(f"PREDICTED step on the kept {new.grad_allreduce} all-reduce: {new.step_time_s:.4g} s (the predictor "
              f"expected the {p.grad_allreduce} path to be kept, {p.step_time_s:.4g} s)", flush=True)


def _plan_brief(plan: dict) -> str:
    """One line for a plan dict (``Plan.to_dict()``): islands and each replica's layer split."""
    try:
        isl = ", ".join(f"{i['name']} ({i.get('platform')} "
                        f"x{i.get('num_processes', 1) * i.get('devices_per_process', 1)})" for i in plan["islands"])
        reps = "; ".join(", ".join(f"layers {s['first_layer']}-{s['last_layer']} on {s['island']} "
                                   f"(dp {s.get('dp', 1)} tp {s.get('tp', 1)})" for s in r["stages"])
                         for r in plan["replicas"])
        return f"islands {isl}; {reps}"
    except (KeyError, TypeError):
        return "unknown plan"


def _resume(run: _Run) -> None:
    """With ``train.resume``: restore the newest complete, intact checkpoint into the runtime (under
    this run's plan, whatever plan wrote it) and set ``run.start_step`` to its step. Without one,
    ``train.resume_or_start`` starts from step 0 (set-up already refused it otherwise). Under MPI every
    rank calls it (``checkpoint.restore_latest`` agrees on every step tried), and ``_main`` then passes an
    agreement point, so that an error prints once and every rank ends with status 2.

    Raises:
      _ConfigError: the checkpoint is of another model / data set-up, every checkpoint is corrupt, or
        the ranks see different checkpoint steps (under MPI the same message on every rank, naming the
        ranks that found each fault)."""
    from hethub_jax import checkpoint as ckpt

    t = run.cfg.train
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if run.log else (lambda m: None)
    try:
        got = ckpt.restore_latest(run.rt, t.checkpoint_dir, run.cfg.to_dict(), run.plan.global_batch_size,
                                  warn=say)
    except (ckpt.CheckpointMismatch, ckpt.CheckpointError) as e:  # CheckpointCorrupt is a CheckpointError
        raise _ConfigError(f"train.resume: {e}{_null_resume_hint(t)}") from None
    if got is None:
        if run.log:
            print(f"resume: no complete checkpoint in {t.checkpoint_dir}; starting from step 0", flush=True)
        return
    run.start_step, meta = got
    run.resumed_from = {"step": run.start_step, "plan": meta.get("plan"), "plan_file": meta.get("plan_file")}
    if run.log:
        print(resume_line(run.start_step, t.checkpoint_dir, meta, run.plan.to_dict(), t.plan), flush=True)


def resume_line(step: int, checkpoint_dir: str, meta: dict, plan: dict, plan_file: str | None) -> str:
    """What ``--resume`` prints: the checkpoint's step and the plan that wrote it, as recorded in its
    ``meta.json`` (``plan``, ``plan_file``). When that plan differs from this run's ``plan`` (plan-less
    ``--cluster`` training re-plans and rewrites ``plan.json``; or another ``--plan``), the line says so,
    where the old plan is recorded, and that this run trains its own plan (a checkpoint restores under
    any plan), instead of naming a file that now holds another plan."""
    from hethub_jax import checkpoint as ckpt

    old, old_file = meta.get("plan") or {}, meta.get("plan_file")
    head = f"resume: step {step} of {checkpoint_dir}"
    if old == plan:
        return f"{head}, written under plan {old_file or 'built-in'} (the plan this run trains): {_plan_brief(old)}"
    where = os.path.join(str(ckpt.step_dir(checkpoint_dir, step)), "meta.json")
    rewritten = (f"; {old_file} now holds this run's new plan" if old_file and plan_file and
                 os.path.abspath(old_file) == os.path.abspath(plan_file) else "")
    return (f"{head}, written under ANOTHER plan than this run's: {_plan_brief(old)} (recorded in {where}"
            f"{rewritten}); this run trains plan {plan_file or 'built-in'}: {_plan_brief(plan)} (a checkpoint "
            f"restores under any plan)")


def _save_checkpoint(run: _Run, step: int):
    """Save this rank's units at ``step`` (asynchronously, ``checkpoint.AsyncSaver``); the logging
    rank also writes the step's ``meta.json``. Returns the step's checkpoint directory."""
    from hethub_jax import checkpoint as ckpt

    t = run.cfg.train
    if run.saver is None:
        run.saver = ckpt.AsyncSaver(t.checkpoint_dir, run.cfg.model.num_hidden_layers, t.keep_checkpoints)
    meta = None
    if run.log:
        meta = {"step": step, "world_size": run.plan.world_size, "config": run.cfg.to_dict(),
                "plan": run.plan.to_dict(), "plan_file": t.plan, "time_unix": time.time(),
                "data": {"next_step": step + 1, "samples_consumed": step * run.plan.global_batch_size,
                         "global_batch_size": run.plan.global_batch_size, "seed": run.cfg.data.seed},
                "random_state": {"train.seed": t.seed, "data.seed": run.cfg.data.seed,
                                 "note": "no other random state: no dropout; the data order is a "
                                         "function of data.seed and the step"}}
    return run.saver.save(step, ckpt.runtime_units(run.rt), meta, arrays=ckpt.runtime_arrays(run.rt))


# ---------------------------------------------------------------------------------------------------
# reporting at start

def _model_name(cfg) -> str:
    if isinstance(cfg.model_spec, dict) and "preset" in cfg.model_spec:
        return f"{cfg.model_spec['preset']} (with overrides)"
    return cfg.model_spec if isinstance(cfg.model_spec, str) else "custom"


def single_process_note(plan: Any) -> str | None:
    """For a plan of several islands run in ONE process (no ``mpiexec``, or ``mpiexec -n 1``): the note
    that every island runs in this process (an emulation of the plan's processes), and the command that
    gives one process per island; None for a one-island plan."""
    if len(plan.islands) < 2:
        return None
    names = ", ".join(i.name for i in plan.islands)
    return (f"all {len(plan.islands)} islands ({names}) run in this one process (an emulation "
            f"of the plan's {plan.world_size} processes); `mpiexec -n {plan.world_size} python -m "
            f"hethub_jax.train ...` runs one process per island")


def _banner(run: _Run) -> list[str]:
    """The start-up banner (docs/training.md): model, data, plan, devices, optimizer, steps, EMULATED."""
    import jax

    cfg, plan, t, o, m = run.cfg, run.plan, run.cfg.train, run.cfg.optim, run.cfg.model
    gbs = plan.global_batch_size
    where = f"plan ({t.plan or 'built-in'}):"
    lines = [
        f"hethub-jax training: model {_model_name(cfg)}, {m.num_params():,} parameters "
        f"({m.num_hidden_layers} layers, d={m.hidden_size}, vocab {m.vocab_size}, {m.dtype})",
        f"data: {len(run.train_ds.stream):,} train / {len(run.val_ds.stream):,} validation tokens, seq_len "
        f"{cfg.data.seq_len}; {gbs * cfg.data.seq_len:,} tokens per step",
        f"{where} {plan.description}" if plan.description else where,
        *plan_summary(plan, m, run.rt.shares), *(f"  note: {n}" for n in run.plan_notes),
        f"jax {jax.__version__}, backend {jax.default_backend()}, {len(jax.devices())} local device(s)"
        + (f"; rank {run.rank} of {run.world_size}" if run.comm is not None else "; single process"),
        *([] if run.comm is not None else [f"  note: {n}" for n in [single_process_note(plan)] if n]),
        f"optimizer: AdamW peak lr {o.learning_rate:g}, warm-up {o.warmup_steps}, cosine "
        f"decay over {o.decay_steps} steps, clip {o.grad_clip_norm}",
        f"steps {run.start_step}->{t.steps}, eval every {t.eval_every} steps on "
        f"{t.eval_batches if t.eval_batches is not None else 'all'} validation batch(es); metrics "
        f"{t.metrics_file or 'off'}; checkpoints {t.checkpoint_dir or 'off'}",
    ]
    if o.warmup_steps >= o.decay_steps:
        lines.append(f"  note: optim.warmup_steps ({o.warmup_steps}) >= decay steps "
                     f"({o.decay_steps}): the peak learning rate is never reached")
    lines += run.prediction.banner() if run.prediction is not None else [run.prediction_note]
    lines += run.emulation
    bucket_line = getattr(run.rt, "grad_bucket_line", lambda: None)()
    lines += [bucket_line] if bucket_line else []
    if run.emulation:
        lines.append("EMULATED: step times and tokens/s include the emulated slowdown waits; they are "
                     "not measurements of real slower hardware.")
    return lines


def _run_record(run: _Run) -> dict[str, Any]:
    """The metrics file's first record (``kind: run``): config, plan, batch shares, emulation,
    versions, host."""
    import jax

    plan = run.plan
    return {
        "kind": "run", "start_step": run.start_step, "resumed_from": run.resumed_from,
        "time_unix": time.time(), "config": run.cfg.to_dict(),
        "plan": plan.to_dict(), "plan_file": run.cfg.train.plan, "batch_shares": list(run.rt.shares),
        "grad_allreduce": getattr(run.rt, "grad_bucket_choice", None),
        "batch_shares_source": run.share_source,
        "idle_devices": run.idle_devices,
        "num_params": run.cfg.model.num_params(),
        "emulation": {"active": bool(run.emulation), "lines": run.emulation,
                      "slowdown": {i.name: i.slowdown for i in plan.islands}},
        "versions": _versions(), "host": {"platform": _platform.platform(), "backend": jax.default_backend(),
                                          "local_devices": len(jax.devices()), "world_size": run.world_size},
        "tokens_per_s_counts": "non-pad (loss_mask 1) tokens of the global batch / step_time_s",
        "prediction": run.prediction.summary() if run.prediction is not None else run.prediction_note,
    }


# ---------------------------------------------------------------------------------------------------
# the loop and its hooks

def _open_metrics(run: _Run) -> MetricsWriter:
    """The metrics file (the logging rank's; appended to when resuming), its ``run`` record written."""
    t = run.cfg.train
    path = t.metrics_file if run.log else None
    if path is not None and run.resuming and os.path.exists(path):
        _supersede_metrics(path, run.start_step)
    if path is not None and not run.resuming and os.path.exists(path) and os.path.getsize(path) > 0:
        n = 1
        while os.path.exists(f"{path}.{n}"):
            n += 1
        os.replace(path, f"{path}.{n}")
        print(f"metrics: this run starts from step 0 in a new {path}; the earlier run's records are kept in "
              f"{path}.{n}", flush=True)
    metrics = MetricsWriter(path, append=run.resuming)
    metrics.write(_run_record(run))
    return metrics


def _supersede_metrics(path: str, start_step: int) -> None:
    """Resuming at ``start_step``: the records of later steps (written by the interrupted run after
    its last checkpoint) become ``{"kind": "superseded", "record": ...}``, so that the file never holds
    two ``step`` records of one step and loses nothing. Rewritten atomically."""
    import json
    out, changed = [], False
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut by a crash
                continue
            if rec.get("kind") in ("step", "eval") and rec.get("step", 0) > start_step:
                rec, changed = {"kind": "superseded", "resumed_at_step": start_step, "record": rec}, True
            out.append(json.dumps(rec))
    if changed:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in out))
        os.replace(tmp, path)


def _build_hooks(run: _Run, metrics: MetricsWriter, console: Console) -> list[Hook]:
    """The hooks of the run, in the order they are called (see ``hethub_jax.train_hooks``).

    This is the place to add a hook (e.g. one comparing a predicted step time with
    ``state.step_time_s``): construct it here from ``run`` (plan, model config, runtime) and put it
    before ``MetricsHook`` if it adds fields to the step records through ``state.extra``.
    """
    t = run.cfg.train
    val_batches = run.val_ds.batches(run.plan.global_batch_size, max_batches=t.eval_batches)
    hooks: list[Hook] = [EvalHook(run.rt.eval_loss, val_batches, t.eval_every, t.eval_at_start)]
    if t.checkpoint_dir is not None:
        hooks.append(CheckpointHook(lambda step: _save_checkpoint(run, step), t.checkpoint_every,
                                    wait=lambda: run.saver and run.saver.wait()))
    predicted = (lambda t0: run.prediction.records(run.cfg.model, run.plan, t0)) if run.prediction else None
    if run.comm is not None and (t.trace_file is not None or run.args.timeline_png):
        from hethub_jax.train_insight import GatherRecordsHook
        hooks.append(GatherRecordsHook(run.comm, run.log))  # every stage's records on the logging rank
    if t.trace_file is not None and run.log:
        hooks.append(TraceHook(t.trace_file, predicted=predicted))
    hooks += _insight_hooks(run, metrics, console, predicted)
    hooks.append(MetricsHook(metrics, emulated=bool(run.emulation), trace_file=t.trace_file))
    if console.bar is not None:
        hooks.append(ProgressHook(console, emulated=bool(run.emulation)))
    if run.log:
        outputs = [("metrics", t.metrics_file), ("plan", t.plan), ("trace", t.trace_file),
                   ("timeline PNG", _timeline_png(run)), ("TensorBoard", run.args.tensorboard),
                   ("checkpoints", t.checkpoint_dir)]
        hooks.append(ConsoleHook(console, t.log_every, emulated=bool(run.emulation), outputs=outputs))
    return hooks


def _timeline_png(run: _Run) -> str | None:
    """The timeline PNG's path: ``--timeline-png``, else beside ``train.trace_file`` (``.png``) when
    matplotlib is installed, else None."""
    import importlib.util

    t, png = run.cfg.train, run.args.timeline_png
    if png is None and t.trace_file and importlib.util.find_spec("matplotlib") is not None:
        png = os.path.splitext(t.trace_file)[0] + ".png"
    return png


def _insight_hooks(run: _Run, metrics: MetricsWriter, console: Console, predicted) -> list[Hook]:
    """PREDICTED vs measured step time, the timeline PNG and TensorBoard (``hethub_jax.train_insight``)."""
    import importlib.util

    from hethub_jax.train_insight import PredictionHook, TensorBoardHook, TimelineHook, mfu_inputs

    t, args, hooks = run.cfg.train, run.args, []
    if run.prediction is not None:
        hooks.append(PredictionHook(run.prediction, metrics, console, t.log_every))
    png = _timeline_png(run)
    if png and run.log:
        hooks.append(TimelineHook(png, {i.name: i.slowdown for i in run.plan.islands}, predicted, console,
                                  run.prediction.prediction.step_time_s if run.prediction is not None else None))
    if args.tensorboard and run.log:
        hooks.append(TensorBoardHook(args.tensorboard, *mfu_inputs(run.cfg.model, run.plan, run.prediction,
                                                                      run.cfg.data.seq_len)))
    return hooks


def _train_loop(run: _Run, hooks: list[Hook], console: Console) -> TrainState:
    """Steps ``start_step + 1 .. train.steps``: one ``rt.train_step`` on the next global batch, then
    every hook's ``on_step``. Stops early (``state.status = 1``) at a non-finite loss. Calls
    ``on_start`` before the first step and ``on_end`` after the last."""
    from hethub_jax.optim import learning_rate_schedule

    t = run.cfg.train
    lr_at = learning_rate_schedule(run.cfg.optim)
    train_iter = run.train_ds.batches(run.plan.global_batch_size, start_step=run.start_step)
    state = TrainState(start_step=run.start_step, total_steps=t.steps, t_start=time.perf_counter(),
                       step=run.start_step)
    for hook in hooks:
        hook.on_start(state)
    try:
        for step in range(run.start_step + 1, t.steps + 1):
            result = run.rt.train_step(next(train_iter))
            state.record_step(step, result, lr=float(lr_at(step - 1)))
            for hook in hooks:
                hook.on_step(state)
            if not state.finite:
                if t.on_nonfinite_loss == "skip":
                    console.say(f"step {step}: loss is {state.loss}; update skipped "
                                f"(train.on_nonfinite_loss: skip)")
                    continue
                console.say(f"step {step}: loss is {state.loss}; stopping (the update was not applied)")
                state.status = 1
                break
    finally:
        console.close()
    state.wall_s = time.perf_counter() - state.t_start
    for hook in hooks:
        hook.on_end(state)
    return state


# ---------------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """Run training. Returns the exit status: 0 success, 2 configuration error (one line on stderr),
    1 training failure (non-finite loss). Other exceptions propagate with their traceback."""
    from hethub_jax.cluster import SetUpFailed, StartFailed

    import contextlib
    import io

    from hethub_jax.cluster import launcher_rank
    # under mpiexec, ranks other than the launcher's rank 0 hold argparse's output (usage, --help, an
    # error) and print an error only when it differs from rank 0's (_fail_before_mpi): once, not per rank
    hold = mpi_world_size() > 1 and launcher_rank() not in (None, 0)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out) if hold else contextlib.nullcontext(), \
                contextlib.redirect_stderr(err) if hold else contextlib.nullcontext():
            args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed its error; under MPI the other ranks must end too
        if e.code not in (0, None) and mpi_world_size() > 1 and "mpi4py.MPI" not in sys.modules:
            _fail_before_mpi(None, None, held=err.getvalue() if hold else None)
        raise
    try:
        run = _set_up(args)
    except _ConfigError as e:
        return _fail(str(e), args)
    except StartFailed as e:
        return _peers_failed(e)
    except SetUpFailed as e:
        return _set_up_failed(e, args)
    except _NothingToDo as e:  # every rank: the newest checkpoint already reaches train.steps
        if e.rank == 0:
            print(str(e), flush=True)
        return 0
    try:
        return _main(run, args)
    except _ConfigError as e:
        return _fail(str(e))
    except SetUpFailed as e:  # resuming (``_resume``): printed once, every rank ends with status 2
        return _set_up_failed(e, args)
    finally:
        _release_locks(run)


def _main(run: _Run, args: argparse.Namespace) -> int:
    """Warm-up, resume, banner, hooks and the loop of ``main``."""
    _warm_up_batch_shares(run)
    _warm_up_grad_allreduce(run)
    _predict_kept_path(run)
    t = run.cfg.train
    if run.resuming:
        _agreed(run.comm, lambda: _resume(run), t.message_timeout_s)
        if run.start_step >= t.steps:
            if run.log:  # (set-up ends such a run earlier unless the newest step's meta.json did not read)
                print(nothing_to_do_line(run.start_step, t), flush=True)
            return 0
    if run.log:
        print("\n".join(_banner(run)), flush=True)
    metrics = _open_metrics(run)
    console = Console(run.log, progress=not args.no_progress, total=t.steps, initial=run.start_step,
                      mode=args.progress)
    hooks = _build_hooks(run, metrics, console)
    return _train_loop(run, hooks, console).status


if __name__ == "__main__":
    sys.exit(main())
