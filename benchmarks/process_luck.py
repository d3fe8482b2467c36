"""Diagnostic (issue 13, session 16): is the run-to-run spread of ``predictor_accuracy`` a per-PROCESS speed
(each JAX process keeps one speed for its lifetime: memory placement, allocator state, thread pools) or the
machine's speed drifting in TIME?

::

    nice -n 10 env PYTHONPATH=. python benchmarks/process_luck.py --json X [--processes 6] [--calls 25]
        [--alternate 3] [--rounds 6] [--gap-s 0] [--call canary|whole] [--cache-dir D] [--extra-compiles]

Two experiments, both timing ONE fixed call per sample, in processes set up exactly as
``benchmarks/predictor_accuracy.py``'s main process (its module sets the XLA flags: 8 fake CPU devices, one
compute thread per computation; the steady host allocator) with the tiny model (``--call canary``: the benchmark's
canary, a first stage's (layer 0) B plus a last stage's (last layer) fused F+B, one sample, seq 64, summed;
``--call whole``: the whole model as one stage, its fused F+B at one sample):

1. **sequential**: ``--processes`` fresh processes started one after another, each ``--warmup`` untimed then
   ``--calls`` timed samples. Within-process spread = per process p75 / p25 of its samples (median over the
   processes); between-process spread = max / min of the processes' medians.
2. **alternate**: ``--alternate`` processes alive at the same time, taking turns (only one computes at a time; the
   others block on a pipe): ``--rounds`` rounds, in each every process times one slice of ``--calls`` samples,
   in the order A, B, C, A, B, C, ... (``--gap-s`` seconds idle between rounds). The slice medians form a matrix ``log m[round][process]``; its two-way
   decomposition (additive in logs) separates a PROCESS effect (the processes' mean offsets over all rounds:
   fixed per-process speed) from a TIME effect (the rounds' mean offsets: the machine's drift, shared by every
   process in that round) and the residual. Each is reported as a spread ratio ``exp(max - min)`` and a
   standard deviation in percent (``100 * std`` of the logs). Per-process luck dominates when the process effect
   is large against the time effect and stays of one sign round after round (``ratio_to_first_per_round``).

A/B of a process's history (alternate only; odd-numbered processes get the treatment, even ones not):
``--cache-dir D`` (the odd ones load their executables from JAX's persistent compilation cache at D, filled first by
one process; the even ones compile) and ``--extra-compiles`` (the odd ones first compile and run once every
single-layer stage's calls at microbatch 1, 2 and 4, a profile-like history). The process effects are then the
treatment's, ``ratio_to_first_per_round`` per round.

Every sample records wall seconds (``time.perf_counter``) and the process's CPU seconds (``time.process_time``,
all threads; the load of other jobs disturbs it less than wall time). On a machine shared with other jobs the
figures are LOADED: compare ratios within one run only.

Writes ``--json`` (``figures`` per experiment, both clocks) and prints a summary. Memory: each process holds the
tiny model only (well under 1 GiB resident); at most ``--alternate`` of them at once.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)


# ---- the child: one process, one fixed call ---------------------------------------------------------------------

def _make_call(kind: str, seq: int):
    """A no-argument blocking function: one sample of the fixed call ``kind`` (see the module docstring)."""
    import jax

    from hethub_jax import profile
    from hethub_jax.models.config import get_preset
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    cfg = get_preset("tiny")
    tx, L, dev = make_optimizer(OptimConfig()), cfg.num_hidden_layers, jax.devices()[0]
    if kind == "canary":
        first, last = (PipelineStage(cfg, a, a, [dev], 1, 1, seed=0, recompute=False, optimizer=tx) for a in (0, L - 1))
        b = profile._stage_call(first, cfg, seq, "B")
        fb = profile._stage_call(last, cfg, seq, "B_recompute")

        def call():
            b()
            fb()
        return call
    if kind == "whole":
        whole = PipelineStage(cfg, 0, L - 1, [dev], 1, 1, seed=0, recompute=False, optimizer=tx)
        return profile._stage_call(whole, cfg, seq, "B_recompute")
    raise ValueError(f"unknown call {kind!r}: canary or whole")


def _slice(call, n: int) -> dict:
    """``{"wall_s": [...], "cpu_s": [...]}`` of ``n`` samples of ``call``."""
    wall, cpu = [], []
    for _ in range(n):
        c0, t0 = time.process_time(), time.perf_counter()
        call()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"wall_s": wall, "cpu_s": cpu}


def _extra_compiles(seq: int) -> int:
    """Compiles and runs once, then drops, every single-layer stage's calls at microbatch 1, 2 and 4 (F, B and
    the last stage's fused F+B): a compile history like a profile's. Returns how many stage calls."""
    import jax

    from hethub_jax import profile
    from hethub_jax.models.config import get_preset
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    cfg = get_preset("tiny")
    tx, dev, n = make_optimizer(OptimConfig()), jax.devices()[0], 0
    for a in range(cfg.num_hidden_layers):
        st = PipelineStage(cfg, a, a, [dev], 1, 1, seed=0, recompute=False, optimizer=tx)
        for mbs in (1, 2, 4):
            profile.measure_stage(st, cfg, mbs, seq, 1)
            n += 1
    return n


def child_main(kind: str, seq: int, warmup: int, calls: int, serve: bool, extra: bool = False) -> None:
    """Child process. Not serving: warm up, time one slice, print it as one JSON line. Serving (alternate mode):
    after the warm-up print ``ready``, then for each line ``go`` on stdin time one slice and print it; ``exit``
    ends."""
    import benchmarks.predictor_accuracy  # noqa: F401  -- the benchmark's XLA flags and host allocator, before JAX
    if extra:
        _extra_compiles(seq)
    call = _make_call(kind, seq)
    _slice(call, warmup)
    if not serve:
        print(json.dumps(dict(_slice(call, calls), pid=os.getpid())), flush=True)
        return
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(json.dumps(dict(_slice(call, calls), pid=os.getpid())), flush=True)


# ---- statistics (pure Python) -----------------------------------------------------------------------------------

def _median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _quantile(xs, q: float) -> float:
    """Linear-interpolation quantile (numpy's default method) of ``xs`` at ``q`` in [0, 1]."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _std(xs) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def sequential_figures(samples: list) -> dict:
    """Figures of the sequential experiment from ``samples`` (one list of seconds per process, in start order):
    ``medians_s`` (per process), ``within_p75_p25`` (per process p75 / p25), ``within_spread`` (their median),
    ``between_spread`` (max / min of the medians), ``between_std_pct`` (100 x std of the log medians),
    ``lag1_corr`` (correlation of consecutive processes' log medians: near 1 for a slow drift in time, near 0 or
    below for independent per-process speeds; None with fewer than 3 processes)."""
    med = [_median(s) for s in samples]
    within = [_quantile(s, 0.75) / _quantile(s, 0.25) for s in samples]
    logs = [math.log(m) for m in med]
    lag = None
    if len(logs) >= 3:
        a, b = logs[:-1], logs[1:]
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
        lag = sum((x - ma) * (y - mb) for x, y in zip(a, b)) / den if den > 0 else None
    return {"medians_s": med, "within_p75_p25": within, "within_spread": _median(within),
            "between_spread": max(med) / min(med), "between_std_pct": 100 * _std(logs), "lag1_corr": lag}


def two_way(m: list) -> dict:
    """Two-way additive decomposition of the matrix ``m[round][process]`` of slice medians (seconds) in logs:
    ``log m = mu + time[round] + proc[process] + residual`` (row and column means; the standard main-effects
    fit of a two-way layout without replication). Returns ``process_effect`` and ``time_effect`` (each
    ``exp(log offsets)``: a process's / a round's speed relative to the mean, > 1 slower),
    ``process_spread`` / ``time_spread`` (max / min of those), ``process_std_pct`` / ``time_std_pct`` /
    ``residual_std_pct`` (100 x std of the log offsets / residuals) and ``ratio_to_first_per_round`` (each
    process's slice median over process 0's in the same round: of one sign round after round when the
    processes keep their own speeds)."""
    R, P = len(m), len(m[0])
    lg = [[math.log(x) for x in row] for row in m]
    mu = sum(map(sum, lg)) / (R * P)
    t = [sum(row) / P - mu for row in lg]
    p = [sum(lg[r][j] for r in range(R)) / R - mu for j in range(P)]
    res = [lg[r][j] - mu - t[r] - p[j] for r in range(R) for j in range(P)]
    return {"process_effect": [math.exp(x) for x in p], "time_effect": [math.exp(x) for x in t],
            "process_spread": math.exp(max(p) - min(p)), "time_spread": math.exp(max(t) - min(t)),
            "process_std_pct": 100 * _std(p), "time_std_pct": 100 * _std(t), "residual_std_pct": 100 * _std(res),
            "ratio_to_first_per_round": [[row[j] / row[0] for j in range(P)] for row in m]}


# ---- the parent -------------------------------------------------------------------------------------------------

def _child_cmd(args, serve: bool, extra: bool = False) -> list:
    return [sys.executable, os.path.abspath(__file__), "--child", "--call", args.call, "--seq", str(args.seq),
            "--warmup", str(args.warmup), "--calls", str(args.calls)] + (["--serve"] if serve else []) + (
        ["--extra-compiles"] if extra else [])


def run_sequential(args) -> list:
    out = []
    for i in range(args.processes):
        t0 = time.time()
        res = subprocess.run(_child_cmd(args, False), capture_output=True, text=True, cwd=ROOT)
        if res.returncode:
            raise RuntimeError(f"sequential child {i} failed:\n{res.stderr[-3000:]}")
        d = json.loads(res.stdout.strip().splitlines()[-1])
        out.append(d)
        print(f"sequential {i + 1}/{args.processes}: median {1e3 * _median(d['wall_s']):.2f} ms wall, "
              f"{1e3 * _median(d['cpu_s']):.2f} ms CPU ({time.time() - t0:.0f} s)", flush=True)
    return out


def _cache_env(cache_dir: str) -> dict:
    return dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def run_alternate(args) -> list:
    """``[round][process]`` slices, the processes alive together and taking turns. With ``--cache-dir D``: one
    process first fills JAX's persistent compilation cache at D, then the odd-numbered processes load their
    executables from it while the even ones compile their own (the process effect is then the cache's)."""
    envs = [None] * args.alternate
    if args.cache_dir:
        res = subprocess.run(_child_cmd(args, False), capture_output=True, text=True, cwd=ROOT,
                             env=_cache_env(args.cache_dir))
        if res.returncode:
            raise RuntimeError(f"cache-filling child failed:\n{res.stderr[-3000:]}")
        envs = [_cache_env(args.cache_dir) if j % 2 else None for j in range(args.alternate)]
    procs = [subprocess.Popen(_child_cmd(args, True, args.extra_compiles and j % 2 == 1), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env=envs[j]) for j in range(args.alternate)]
    try:
        for p in procs:  # warm-ups overlap (untimed); every slice below runs alone
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("alternate child failed to start")
        rounds = []
        for r in range(args.rounds):
            row = []
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
                row.append(json.loads(p.stdout.readline()))
            rounds.append(row)
            time.sleep(args.gap_s)
            print(f"alternate round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{1e3 * _median(s['wall_s']):.2f}" for s in row) + " ms wall; "
                  + ", ".join(f"{1e3 * _median(s['cpu_s']):.2f}" for s in row) + " ms CPU", flush=True)
    finally:
        for p in procs:
            try:
                p.stdin.write("exit\n")
                p.stdin.close()
            except OSError:
                pass
            p.wait(timeout=60)
    return rounds


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="output path")
    ap.add_argument("--call", choices=("canary", "whole"), default="canary", help="the fixed call timed")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sample (the benchmark's)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed samples after the compiling one")
    ap.add_argument("--calls", type=int, default=25, help="timed samples per process (sequential) or per slice")
    ap.add_argument("--processes", type=int, default=6, help="fresh processes one after another (0: skip)")
    ap.add_argument("--alternate", type=int, default=3, help="processes alive together, taking turns (0: skip)")
    ap.add_argument("--rounds", type=int, default=6, help="alternate rounds (one slice per process each)")
    ap.add_argument("--gap-s", type=float, default=0.0,
                    help="seconds slept between alternate rounds (spreads them over the minutes a benchmark spans)")
    ap.add_argument("--cache-dir", default=None,
                    help="alternate: odd-numbered processes load their executables from JAX's persistent compilation "
                         "cache in this directory (filled first by one process), even ones compile (A/B of the cache)")
    ap.add_argument("--extra-compiles", action="store_true",
                    help="alternate: odd-numbered processes first compile and run once every single-layer stage's "
                         "calls at microbatch 1, 2 and 4 (a profile-like compile history), even ones only the timed call")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child_main(args.call, args.seq, args.warmup, args.calls, args.serve, args.extra_compiles)
        return {}
    if args.calls < 4 or args.processes < 0 or args.alternate < 0 or args.rounds < 2 and args.alternate:
        raise SystemExit("--calls >= 4, --processes >= 0, --alternate >= 0 with --rounds >= 2")
    from benchmarks.common import command_line, loadavg, machine, write_json
    t_start, load0 = time.time(), loadavg()
    figures, raw = {}, {}
    if args.processes:
        seq = run_sequential(args)
        raw["sequential"] = seq
        figures["sequential"] = {clk: sequential_figures([d[clk] for d in seq]) for clk in ("wall_s", "cpu_s")}
        for clk in ("wall_s", "cpu_s"):
            f = figures["sequential"][clk]
            print(f"sequential ({clk[:-2]}): within a process p75/p25 {f['within_spread']:.3f} (median over "
                  f"{args.processes}); between processes max/min of medians {f['between_spread']:.3f} "
                  f"(std {f['between_std_pct']:.1f}%), lag-1 correlation "
                  + ("n/a" if f["lag1_corr"] is None else f"{f['lag1_corr']:.2f}"), flush=True)
    if args.alternate:
        alt = run_alternate(args)
        raw["alternate"] = alt
        figures["alternate"] = {}
        for clk in ("wall_s", "cpu_s"):
            m = [[_median(s[clk]) for s in row] for row in alt]
            f = two_way(m)
            f["within_slice_p75_p25"] = _median([_quantile(s[clk], 0.75) / _quantile(s[clk], 0.25)
                                                 for row in alt for s in row])
            figures["alternate"][clk] = f
            print(f"alternate ({clk[:-2]}): process effect spread {f['process_spread']:.3f} (std "
                  f"{f['process_std_pct']:.1f}%), time effect spread {f['time_spread']:.3f} (std "
                  f"{f['time_std_pct']:.1f}%), residual std {f['residual_std_pct']:.1f}%, within a slice p75/p25 "
                  f"{f['within_slice_p75_p25']:.3f}; process effects "
                  + ", ".join(f"{x:.3f}" for x in f["process_effect"]), flush=True)
    out = {"benchmark": "process_luck", "command": command_line(), "figures": figures, "raw": raw,
           "machine": machine(), "loadavg_before": load0, "loadavg_after": loadavg(),
           "wall_s": time.time() - t_start,
           "note": "LOADED when other jobs share the machine: compare within this run only"}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
