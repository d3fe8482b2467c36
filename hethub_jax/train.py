"""Training entry point: ``python -m hethub_jax.train [--config PATH] [flags]`` (docs/training.md).

Steps: parse the command line -> load and validate the config (``hethub_jax.config``) and the plan
(``Plan.validate``) -> build the datasets (``hethub_jax.data``) -> build the pipeline runtime
(``hethub_jax.parallel.runtime``) -> train for ``train.steps`` optimizer steps with periodic
validation, a progress bar, JSON-lines metrics and orbax checkpoints.

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
import json
import math
import os
import platform as _platform
import sys
import time
from typing import Any, Sequence

__all__ = ["main", "build_parser", "default_plan", "EXIT_CONFIG_ERROR"]

EXIT_CONFIG_ERROR = 2
_PROG = "python -m hethub_jax.train"


def build_parser() -> argparse.ArgumentParser:
    """The command line. Dedicated flags override ``--set``, which overrides the config file."""
    p = argparse.ArgumentParser(
        prog=_PROG, description="Train a Llama-family model with hethub-jax (docs/training.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", metavar="PATH", default=None,
                   help="YAML config (sections model, data, optim, train; see configs/tiny.yaml); "
                        "default: built-in defaults (tiny preset on the Shakespeare corpus)")
    p.add_argument("--set", dest="overrides", metavar="SECTION.FIELD=VALUE", action="append", default=[],
                   help="override one config field, VALUE parsed as YAML (repeatable), "
                        "e.g. --set optim.learning_rate=1e-3 --set model=tiny")
    p.add_argument("--steps", type=int, default=None, help="train.steps: optimizer steps")
    p.add_argument("--global-batch-size", type=int, default=None, help="train.global_batch_size (samples)")
    p.add_argument("--microbatch-size", type=int, default=None, help="train.microbatch_size (samples)")
    p.add_argument("--seq-len", type=int, default=None, help="data.seq_len (tokens per sample)")
    p.add_argument("--lr", type=float, default=None, help="optim.learning_rate (peak)")
    p.add_argument("--seed", type=int, default=None, help="train.seed: parameter initialisation seed")
    p.add_argument("--eval-every", type=int, default=None, help="train.eval_every (steps)")
    p.add_argument("--metrics-file", metavar="PATH", default=None, help="train.metrics_file (JSON lines)")
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="train.checkpoint_dir")
    p.add_argument("--no-checkpoint", action="store_true", help="set train.checkpoint_dir to null")
    p.add_argument("--resume", action="store_true", default=None,
                   help="train.resume: continue from the newest complete checkpoint in checkpoint_dir")
    p.add_argument("--plan", metavar="PLAN.json", default=None, help="train.plan: parallel plan JSON")
    p.add_argument("--trace-file", metavar="PATH", default=None,
                   help="train.trace_file: Chrome trace of the last step's actions")
    p.add_argument("--island", metavar="NAME", default=None,
                   help="this process's island (MPI runs; else $HETHUB_ISLAND); single-process runs "
                        "run every island of the plan in-process")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (text lines only)")
    return p


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train.steps": args.steps, "train.global_batch_size": args.global_batch_size,
        "train.microbatch_size": args.microbatch_size, "data.seq_len": args.seq_len,
        "optim.learning_rate": args.lr, "train.seed": args.seed, "train.eval_every": args.eval_every,
        "train.metrics_file": args.metrics_file, "train.checkpoint_dir": args.checkpoint_dir,
        "train.resume": args.resume, "train.plan": args.plan, "train.trace_file": args.trace_file,
    }


def _fail(msg: str) -> int:
    print(f"{_PROG}: error: {msg}", file=sys.stderr)
    return EXIT_CONFIG_ERROR


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
    try:
        plan.validate(cfg.model)
    except ValueError as e:
        where = f"train.plan {t.plan}" if t.plan else "built-in plan"
        raise ValueError(f"{where}: {e}") from None
    return plan, notes


def _prepare_devices(plan_path: str | None, island: str | None) -> None:
    """Before any JAX backend starts: in a single CPU process running a multi-device plan, ask XLA for
    enough host devices (``--xla_force_host_platform_device_count``). Reads the plan JSON with the
    pure-Python plan module; errors are left to the validated load later."""
    if plan_path is None or "--xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        from hethub_jax.parallel.plan import Plan
        plan = Plan.from_json(plan_path)
    except Exception:  # reported properly by _resolve_plan
        return
    islands = [i for i in plan.islands if island is None or i.name == island]
    cpu = [i.devices_per_process for i in islands if i.platform == "cpu"]
    if cpu and max(cpu) > 1 and all(i.platform == "cpu" for i in islands):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={max(cpu)}").strip()


def _mpi_world_size() -> int:
    """Ranks of the MPI job this process was launched in (1 without ``mpiexec``), read from the
    launcher's environment so that MPI is not initialised for single-process runs."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def _start_mpi(plan_path: str | None, island: str | None, size: int):
    """Multi-process start-up (DESIGN.md section 3) before any JAX backend starts: find this rank's
    island (``--island``, ``$HETHUB_ISLAND``, else the plan's island of this MPI rank), set its
    platform, split the world by island (``hethub_jax.cluster.start``). Returns the Island.

    Raises:
      ValueError: no plan, an island not in the plan, or a rank/island mismatch with the plan.
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
    from mpi4py import MPI

    from hethub_jax import cluster

    rank = MPI.COMM_WORLD.Get_rank()
    name = island or os.environ.get(cluster.ENV_ISLAND) or plan.rank_island(rank).name
    if name not in [i.name for i in plan.islands]:
        raise ValueError(f"--island {name!r} is not an island of the plan: {[i.name for i in plan.islands]}")
    if plan.rank_island(rank).name != name:
        raise ValueError(f"rank {rank} runs island {name!r} but the plan gives rank {rank} to island "
                         f"{plan.rank_island(rank).name!r} (islands take consecutive ranks in plan order; "
                         f"list the mpiexec parts in that order)")
    cluster.install_abort_on_exception(rank=rank, island=name)
    return cluster.start(island=name, platform=plan.island(name).platform)


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


class _Metrics:
    """JSON-lines writer: one record per line, flushed after each line (a crash loses at most the
    line being written). Only the logging rank writes."""

    def __init__(self, path: str | None, append: bool):
        self.f = None
        if path is not None:
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            self.f = open(path, "a" if append else "w", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record, default=_json_default) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def _fmt_rate(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


# ---------------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """Run training. Returns the exit status: 0 success, 2 configuration error (one line on stderr),
    1 training failure (non-finite loss). Other exceptions propagate with their traceback."""
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.no_checkpoint:
        overrides.append("train.checkpoint_dir=null")

    # ---- set-up: every failure here is a configuration error, reported before any compilation ----
    _prepare_devices(args.plan, args.island)
    try:
        from hethub_jax.config import load_config
        cfg = load_config(args.config, overrides, _flags(args))
    except ValueError as e:  # ConfigError is a ValueError
        return _fail(str(e))

    comm, rank, world_size, island = None, 0, 1, None
    size = _mpi_world_size()
    if size > 1:
        try:
            island = _start_mpi(cfg.train.plan, args.island, size)
        except ValueError as e:
            return _fail(str(e))
        comm, rank, world_size = island.world, island.world.rank, island.world.size

    import jax

    from hethub_jax import checkpoint as ckpt
    from hethub_jax.data import build_datasets
    from hethub_jax.optim import learning_rate_schedule

    t = cfg.train
    try:
        plan, plan_notes = _resolve_plan(cfg, jax.default_backend())
        if t.checkpoint_dir is not None:
            ckpt.check_supported(plan)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    try:
        datasets = build_datasets(cfg.data)
    except (ValueError, OSError, TypeError) as e:
        return _fail(f"data: {e}")
    train_ds, val_ds, tokenizer = datasets
    if cfg.model.vocab_size < tokenizer.vocab_size:
        return _fail(f"model.vocab_size ({cfg.model.vocab_size}) must be >= the tokenizer's vocabulary "
                     f"({tokenizer.vocab_size} ids)")
    gbs = plan.global_batch_size
    try:
        train_ds.batches(gbs)  # checks the batch size against the split at the call
        val_ds.batches(gbs)
    except ValueError as e:
        return _fail(f"train.global_batch_size: {e}")

    if comm is None and plan.world_size > 1 and args.island is not None:
        return _fail(f"--island {args.island}: the plan has {plan.world_size} ranks; run it under "
                     f"mpiexec -n {plan.world_size}, or without --island to run every island in one process")
    if comm is not None:
        from hethub_jax import cluster
        digest = cluster.config_hash(cfg.to_dict(), plan.to_dict())
        cluster.handshake(comm, cluster.handshake_record(digest, island.name, island.platform,
                                                         jax.local_device_count()))

    from hethub_jax.parallel.runtime import PipelineRuntime
    try:
        rt = PipelineRuntime(plan, cfg.model, cfg.optim, seed=t.seed, comm=comm, rank=rank)
    except ValueError as e:
        return _fail(str(e))
    log = rt.is_logging_rank
    emulation = rt.emulation_lines()

    # ---- heterogeneous DP: shares measured in a warm-up unless the plan gives shares or throughputs --
    share_source = "plan"
    if plan.num_replicas > 1 and all(r.batch_share is None and r.throughput is None for r in plan.replicas):
        from hethub_jax.parallel.plan import proportional_shares

        if log:
            print("heterogeneous DP: measuring replica throughputs in a warm-up (forward/backward on one "
                  "batch, no update)...", flush=True)
        warm = next(iter(train_ds.batches(gbs)))
        thr = rt.measure_throughputs(warm, steps=2)
        units = proportional_shares(gbs // plan.microbatch_size, thr)
        rt.set_batch_shares([u * plan.microbatch_size for u in units])
        share_source = "warm-up: " + ", ".join(f"replica {r} {x:.1f} samples/s" for r, x in enumerate(thr))
        if log:
            print(f"heterogeneous DP: measured {share_source}" + (" (EMULATED slowdowns included)" if emulation else "")
                  + f" -> batch shares {rt.shares}", flush=True)

    # ---- resume -------------------------------------------------------------------------------
    start_step = 0
    if t.resume:
        latest = ckpt.latest_step(t.checkpoint_dir, plan.world_size)
        if latest is not None:
            rt.restore_checkpoint_state(ckpt.restore(t.checkpoint_dir, latest, rank, rt.checkpoint_state()))
            start_step = latest
        if start_step >= t.steps:
            if log:
                print(f"checkpoint step {start_step} already reaches train.steps={t.steps}; nothing to do")
            return 0

    # ---- banner and run record ------------------------------------------------------------------
    n_params = cfg.model.num_params()
    model_name = cfg.model_spec if isinstance(cfg.model_spec, str) else "custom"
    if isinstance(cfg.model_spec, dict) and "preset" in cfg.model_spec:
        model_name = f"{cfg.model_spec['preset']} (with overrides)"
    devs = jax.devices()
    banner = [
        f"hethub-jax training: model {model_name}, {n_params:,} parameters "
        f"({cfg.model.num_hidden_layers} layers, d={cfg.model.hidden_size}, vocab {cfg.model.vocab_size}, "
        f"{cfg.model.dtype})",
        f"data: {len(train_ds.stream):,} train / {len(val_ds.stream):,} validation tokens, seq_len "
        f"{cfg.data.seq_len}; {gbs * cfg.data.seq_len:,} tokens per step",
        f"plan ({t.plan or 'built-in'}): {plan.description}" if plan.description else
        f"plan ({t.plan or 'built-in'}):",
        *plan_summary(plan, cfg.model, rt.shares), *(f"  note: {n}" for n in plan_notes),
        f"jax {jax.__version__}, backend {jax.default_backend()}, {len(devs)} local device(s)"
        + (f"; rank {rank} of {world_size}" if comm is not None else "; single process"),
        f"optimizer: AdamW peak lr {cfg.optim.learning_rate:g}, warm-up {cfg.optim.warmup_steps}, cosine "
        f"decay over {cfg.optim.decay_steps} steps, clip {cfg.optim.grad_clip_norm}",
        f"steps {start_step}->{t.steps}, eval every {t.eval_every} steps on "
        f"{t.eval_batches if t.eval_batches is not None else 'all'} validation batch(es); metrics "
        f"{t.metrics_file or 'off'}; checkpoints {t.checkpoint_dir or 'off'}",
    ]
    if cfg.optim.warmup_steps >= cfg.optim.decay_steps:
        banner.append(f"  note: optim.warmup_steps ({cfg.optim.warmup_steps}) >= decay steps "
                      f"({cfg.optim.decay_steps}): the peak learning rate is never reached")
    banner += emulation if emulation else []
    if emulation:
        banner.append("EMULATED: step times and tokens/s include the emulated slowdown waits; they are "
                      "not measurements of real slower hardware.")
    if log:
        print("\n".join(banner), flush=True)

    metrics = _Metrics(t.metrics_file if log else None, append=start_step > 0)
    metrics.write({
        "kind": "run", "start_step": start_step, "time_unix": time.time(), "config": cfg.to_dict(),
        "plan": plan.to_dict(), "plan_file": t.plan, "batch_shares": list(rt.shares),
        "batch_shares_source": share_source,
        "num_params": n_params, "emulation": {"active": bool(emulation), "lines": emulation,
                                              "slowdown": {i.name: i.slowdown for i in plan.islands}},
        "versions": _versions(), "host": {"platform": _platform.platform(), "backend": jax.default_backend(),
                                          "local_devices": len(devs), "world_size": world_size},
        "tokens_per_s_counts": "non-pad (loss_mask 1) tokens of the global batch / step_time_s",
    })

    # ---- data ---------------------------------------------------------------------------------
    val_batches = list(val_ds.batches(gbs, max_batches=t.eval_batches))
    train_iter = train_ds.batches(gbs, start_step=start_step)
    lr_at = learning_rate_schedule(cfg.optim)

    def evaluate() -> float:
        s = n = 0.0
        for b in val_batches:
            ls, c = rt.eval_loss(b)
            s, n = s + ls, n + c
        return s / n

    bar = None
    if log and not args.no_progress:
        from tqdm import tqdm
        tty = sys.stderr.isatty()
        bar = tqdm(total=t.steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr,
                   mininterval=0.5 if tty else 10.0, smoothing=0.1, desc="train")

    def say(msg: str) -> None:
        if not log:
            return
        if bar is not None:
            bar.write(msg, file=sys.stdout)
        else:
            print(msg, flush=True)

    t_start = time.perf_counter()
    val_loss = None
    first_val = None
    if t.eval_at_start and start_step == 0:
        val_loss = first_val = evaluate()
        metrics.write({"kind": "eval", "step": 0, "val_loss": val_loss, "wall_s": time.perf_counter() - t_start})
        say(f"step 0: val_loss {val_loss:.4f}")

    tok_sum = time_sum = 0.0
    loss = float("nan")
    last_records = []
    status = 0
    try:
        for step in range(start_step + 1, t.steps + 1):
            batch = next(train_iter)
            res = rt.train_step(batch)
            loss, last_records = res.loss, res.records
            tps = res.num_tokens / res.step_time_s if res.step_time_s > 0 else float("nan")
            if step > start_step + 1:  # the first step includes compilation
                tok_sum, time_sum = tok_sum + res.num_tokens, time_sum + res.step_time_s
            rec = {"kind": "step", "step": step, "loss": res.loss, "tokens_per_s": tps,
                   "step_time_s": res.step_time_s, "grad_norm": res.grad_norm,
                   "lr": float(lr_at(step - 1)), "num_tokens": res.num_tokens,
                   "wall_s": time.perf_counter() - t_start}
            if emulation:
                rec["emulated"] = True
            evaluated = step % t.eval_every == 0 or step == t.steps
            if evaluated:
                val_loss = evaluate()
                rec["val_loss"] = val_loss
            metrics.write(rec)
            if not math.isfinite(res.loss):
                say(f"step {step}: loss is {res.loss}; stopping")
                status = 1
                break
            if bar is not None:
                post = {"loss": f"{res.loss:.3f}", "tok/s": _fmt_rate(tps)}
                if val_loss is not None:
                    post["val_loss"] = f"{val_loss:.3f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            if evaluated or (t.log_every and step % t.log_every == 0):
                say(f"step {step}/{t.steps}: loss {res.loss:.4f}"
                    + (f", val_loss {val_loss:.4f}" if evaluated else "")
                    + f", {_fmt_rate(tps)} tokens/s{' (EMULATED)' if emulation else ''}, "
                      f"grad_norm {res.grad_norm:.3f}, lr {rec['lr']:.2e}")
            if t.checkpoint_dir is not None and t.checkpoint_every and step % t.checkpoint_every == 0 \
                    and step != t.steps:
                _save(ckpt, t.checkpoint_dir, step, rank, rt, log, cfg, plan)
    finally:
        if bar is not None:
            bar.close()

    wall = time.perf_counter() - t_start
    ckpt_path = None
    if status == 0 and t.checkpoint_dir is not None:
        ckpt_path = _save(ckpt, t.checkpoint_dir, t.steps, rank, rt, log, cfg, plan)
    if t.trace_file is not None and last_records and log:
        from hethub_jax.parallel.trace import to_chrome_trace
        os.makedirs(os.path.dirname(os.path.abspath(t.trace_file)), exist_ok=True)
        to_chrome_trace(last_records, t.trace_file)
    mean_tps = tok_sum / time_sum if time_sum > 0 else None
    metrics.write({"kind": "end", "status": "ok" if status == 0 else "non-finite loss", "steps": t.steps,
                   "final_loss": loss, "first_val_loss": first_val, "final_val_loss": val_loss,
                   "wall_s": wall, "mean_tokens_per_s_after_first_step": mean_tps,
                   "emulated": bool(emulation), "checkpoint": str(ckpt_path) if ckpt_path else None,
                   "trace_file": t.trace_file})
    metrics.close()
    if log:
        summary = f"done in {wall:.1f} s: loss {loss:.4f}"
        if val_loss is not None:
            summary += f", val_loss {val_loss:.4f}" + (f" (from {first_val:.4f})" if first_val else "")
        if mean_tps:
            summary += f", {_fmt_rate(mean_tps)} tokens/s after the first step{' (EMULATED)' if emulation else ''}"
        print(summary, flush=True)
        if ckpt_path:
            print(f"checkpoint: {ckpt_path}", flush=True)
    return status


def _save(ckpt, checkpoint_dir: str, step: int, rank: int, rt, log: bool, cfg, plan):
    path = ckpt.save(checkpoint_dir, step, rank, rt.checkpoint_state())
    if log:
        ckpt.write_meta(checkpoint_dir, step, {"step": step, "world_size": plan.world_size,
                                                "config": cfg.to_dict(), "plan": plan.to_dict()})
    return path.parent


if __name__ == "__main__":
    sys.exit(main())
