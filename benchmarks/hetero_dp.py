"""Heterogeneous data parallelism over two CPU islands, one EMULATED 3x slower (issues 5 and 17.5).

    PYTHONPATH=. python benchmarks/hetero_dp.py --json hetero_dp.json   # re-launches: mpiexec -n 2

Two MPI ranks, one per island ("fast" = rank 0, "slow" = rank 1), each pinned to its own core
(`os.sched_setaffinity` before JAX starts) and run with one XLA compute thread
(`--xla_cpu_multi_thread_eigen=false`, `OMP_NUM_THREADS=1`). The slow island carries
`"slowdown": 3.0`: an EMULATED speed difference (DESIGN.md section 9: after each compute action the
runtime sleeps 2 x its measured time), not two real accelerator types. Each island holds one full
replica of the model (heterogeneous DP); the token-summed gradients are all-reduced over the
MPI host bridge every step.

Shares: measured in a warm-up (`PipelineRuntime.measure_step_costs`: each replica's seconds per
sample with the gradient all-reduce as in training, and its fixed update time; `plan.balanced_shares`
balances the step times), or with `--given-shares` proportional to the given throughputs 3:1.

Measured in one run, the configurations interleaved step by step (rotating order, a barrier before
every step; warm-up steps excluded; medians over steps):
  (a) `proportional`: the shares above (global batch 16, microbatch 4: 12/4 unless measured
      otherwise); the gradient all-reduce as training's default `train.grad_bucket_mb: auto` runs it:
      after the shares are set, `PipelineRuntime.choose_grad_buckets` times a few passes of the step's
      forward/backward with the all-reduce in 25 MiB layer buckets overlapped with the backward
      (`hethub_jax.parallel.buckets`) and after the whole backward, and keeps the faster
      (`plan.keeps_bucketed_allreduce`; figure `grad_allreduce_choice`, MEASURED seconds of both);
      tokens/s = global non-pad tokens / step time (the slower rank's time);
      The optimizer update is sharded over the two replicas (ZeRO-1, the plan's default
      `optimizer_sharding: auto`: each island updates the parameters it owns; gradients are reduced
      to the owners and the updated parameters exchanged). Which island owns which tensors: in
      proportion to the batch shares (the runtime's default); `--measured-owners`: by measurement
      as in (am), in (a) and (a0) too;
  (a0) `proportional_unbucketed`: the same shares, the all-reduce after the whole backward (the
      path before issue 17.5: an in-run baseline);
  (ab) `proportional_bucketed`: the same shares, always bucketed (`--bucket-mb`, default 25 MiB; (a)
      before session 15: the other in-run baseline; its shares are measured on this path, as before);
  (am) `proportional_measured_owners`: as (a) (its all-reduce path as (a) chose), the ZeRO-1 owners placed by measurement at the final
      shares (`measure_step_costs` again: each replica's F/B seconds per step and its whole update's
      seconds, `PipelineRuntime.last_step_costs`; `plan.balanced_update_fractions` puts the update
      where a replica would otherwise wait for the other; `PipelineRuntime.set_update_weights`). It
      was (a) in session 13; six quiet runs (sessions 13-14, docs/benchmarks.md) never showed it ahead
      of owners by shares and in two it gave the slow island 72-87% of the update, so it is kept as
      the in-run comparison only;
  (ar) `proportional_replicated`: as (a) (its all-reduce path as (a) chose) with `optimizer_sharding: replicated` (every island
      all-reduces every gradient and updates every parameter: the path before session 10), its
      shares measured the same way for that update;
  (b) `equal`: equal shares 8/8 (bucketed);
  (g) `proportional_overlap_gather`: as (a) with the ZeRO-1 parameter gather on a background thread
      (`PipelineRuntime.overlap_param_gather`), compared with (a) in separate blocks of consecutive
      steps of one configuration (figure `overlap_gather_over_after_update` = (a)'s seconds per step
      / (g)'s; `--gather-rounds`, `--gather-steps`);
  (c) `alone`: each island trains the same model on its own (a one-replica plan on that island, no
      communicator), both at the same time on their own cores, each with the global batch of its share
      in (a) (12 and 4 rows: the same per-step work as in (a)); tokens/s of each island alone.
Figures: `fraction_of_upper_bound` = (a) / (c_fast + c_slow), `fraction_of_upper_bound_unbucketed`
= (a0) / (c_fast + c_slow), `fraction_of_upper_bound_bucketed` = (ab) / (c_fast + c_slow), `over_bucketed` = (a) / (ab), `fraction_of_upper_bound_replicated` = (ar) / (c_fast + c_slow),
`over_equal_shares` = (a) / (b), `over_unbucketed` = (a) / (a0), `over_replicated` = (a) / (ar),
`fraction_of_upper_bound_measured_owners` = (am) / (c_fast + c_slow), `over_measured_owners` = (a) / (am),
`update_owner_fractions` (the measured fractions of (am)), `owned_bytes_fraction_per_replica` (what the
tensors' owners give in (a)),
`num_buckets`, and `overlap_fraction`: the share of the bucket all-reduce time (device->host copies,
bridge, on the slow rank, which finishes last) spent before its backward ended, both of (ab).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from benchmarks.common import start_pinned_rank, training_parser  # noqa: E402

ISLANDS = [{"name": "fast", "platform": "cpu", "num_processes": 1, "devices_per_process": 1, "slowdown": 1.0},
           {"name": "slow", "platform": "cpu", "num_processes": 1, "devices_per_process": 1}]


def dp_plan(layers: int, gbs: int, mbs: int, slowdown: float, shares=None, throughputs=None,
            optimizer_sharding: str = "auto") -> dict:
    islands = [dict(ISLANDS[0]), dict(ISLANDS[1], slowdown=slowdown)]
    reps = []
    for i, isl in enumerate(islands):
        reps.append({"stages": [{"island": isl["name"], "dp": 1, "tp": 1, "first_layer": 0, "last_layer": layers - 1}],
                     "batch_share": None if shares is None else shares[i],
                     "throughput": None if throughputs is None else throughputs[i]})
    return {"description": "hetero_dp benchmark", "islands": islands, "replicas": reps,
            "global_batch_size": gbs, "microbatch_size": mbs, "schedule": "1f1b", "recompute": "none",
            "optimizer_sharding": optimizer_sharding}


def alone_plan(layers: int, island: dict, gbs: int, mbs: int) -> dict:
    return {"description": f"hetero_dp benchmark: island {island['name']} alone", "islands": [island],
            "stages": [{"island": island["name"], "dp": 1, "tp": 1, "first_layer": 0, "last_layer": layers - 1}],
            "global_batch_size": gbs, "microbatch_size": mbs, "schedule": "1f1b", "recompute": "none"}


#: the heterogeneous-DP configurations (both ranks; a step ends on both together)
DP_CONFIGS = ("proportional", "proportional_unbucketed", "proportional_bucketed", "proportional_replicated",
              "proportional_measured_owners", "equal")


def owned_fraction(rt) -> list:
    """Fraction of the parameter bytes each replica updates under ZeRO-1 (`PipelineRuntime.owner_of`)."""
    sizes = rt._param_bytes
    owned = [sum(b for n, b in sizes.items() if rt.owner_of.get(n) == r) for r in range(rt.plan.num_replicas)]
    return [round(o / max(sum(owned), 1), 4) for o in owned]


def bucket_figures(stats: list) -> dict:
    """Median per-step bucket figures of one rank from `PipelineRuntime.last_bucket_stats` records."""
    from benchmarks.common import median
    stats = [s for s in stats if s]
    if not stats:
        return {"num_buckets": 0, "bucket_reduce_s": 0.0, "overlap_fraction": 0.0, "bucket_exposed_s": 0.0}
    return {"num_buckets": stats[0]["num_buckets"], "bucket_reduce_s": median([s["reduce_s"] for s in stats]),
            "overlap_fraction": median([s["overlapped_s"] / max(s["reduce_s"], 1e-12) for s in stats]),
            "bucket_exposed_s": median([s["exposed_s"] for s in stats])}


def dp_setup(args) -> tuple:
    """Rank-side set-up shared by the heterogeneous-DP benchmarks (call after the core pinning, JAX
    started): ``(world, comm, config, optim, batches)``: ``MPI.COMM_WORLD`` (exits unless exactly 2
    ranks), the MPI host bridge over it (600 s timeout), the ``--preset`` model config, the optimizer
    config, and an iterator of training batches of ``--batch`` rows x ``--seq`` tokens."""
    from mpi4py import MPI

    from hethub_jax.comm.mpi import MPIHostBridge
    from hethub_jax.data import DataConfig, build_datasets
    from hethub_jax.models.config import PRESETS
    from hethub_jax.optim import OptimConfig
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        sys.exit("run with exactly 2 ranks (one per island)")
    train, _, _ = build_datasets(DataConfig(seq_len=args.seq))
    return (world, MPIHostBridge(world, timeout=600), PRESETS[args.preset],
            OptimConfig(learning_rate=1e-3, warmup_steps=2, decay_steps=1000), train.batches(args.batch))


def main() -> None:
    ap = training_parser(__doc__, batch=16, warmup=2, json_help="output path (written by rank 0)")
    ap.add_argument("--microbatch", type=int, default=4, help="microbatch size (rows)")
    ap.add_argument("--slowdown", type=float, default=3.0, help="EMULATED slowdown of the slow island")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="gradient bucket size of the bucketed configurations, MiB (first bucket 1 MiB)")
    ap.add_argument("--gather-rounds", type=int, default=3,
                    help="rounds of the consecutive-step comparison of the overlapped parameter gather (0: off)")
    ap.add_argument("--gather-steps", type=int, default=4, help="consecutive steps per block of that comparison")
    ap.add_argument("--gather-control", action="store_true",
                    help="A/A control of that comparison: its second runtime also gathers after the update")
    ap.add_argument("--measured-owners", action="store_true",
                    help="ZeRO-1 owners placed by measured busy and update seconds in (a) and (a0) too (session "
                         "13's (a)) instead of in proportion to the batch shares")
    ap.add_argument("--given-shares", action="store_true",
                    help="shares proportional to the given throughputs 3:1 instead of measured in a warm-up")
    args = ap.parse_args()
    rank, core = start_pinned_rank(__file__)

    import time

    import jax  # noqa: F401  (JAX starts here, after the core pinning above)

    sys.path.insert(0, ROOT)
    from benchmarks.common import command_line, loadavg, machine, median, time_reduce_shared, write_json
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.runtime import PipelineRuntime

    load_start = loadavg()
    world, comm, config, optim, it = dp_setup(args)
    L = config.num_hidden_layers
    n_steps = args.warmup + args.steps + 1
    global_batches = [next(it) for _ in range(n_steps + 1)]
    half = args.batch // 2
    equal = Plan.from_dict(dp_plan(L, args.batch, args.microbatch, args.slowdown, shares=[half, half]))
    thr = [args.slowdown, 1.0] if args.given_shares else None
    prop = Plan.from_dict(dp_plan(L, args.batch, args.microbatch, args.slowdown, throughputs=thr))
    repl = Plan.from_dict(dp_plan(L, args.batch, args.microbatch, args.slowdown, throughputs=thr,
                                  optimizer_sharding="replicated"))
    runtimes = {"proportional": PipelineRuntime(prop, config, optim, seed=0, comm=comm, rank=rank),
                "proportional_unbucketed": PipelineRuntime(prop, config, optim, seed=0, comm=comm, rank=rank),
                "proportional_bucketed": PipelineRuntime(prop, config, optim, seed=0, comm=comm, rank=rank),
                "proportional_replicated": PipelineRuntime(repl, config, optim, seed=0, comm=comm, rank=rank),
                "proportional_measured_owners": PipelineRuntime(prop, config, optim, seed=0, comm=comm, rank=rank),
                "equal": PipelineRuntime(equal, config, optim, seed=0, comm=comm, rank=rank)}
    for n in ("proportional_bucketed", "proportional_replicated", "proportional_measured_owners", "equal"):
        runtimes[n].set_grad_buckets(args.bucket_mb)  # bucketed, 25 MiB as DDP ((ar), (am): as (a) chooses below)
    runtimes["proportional"].set_grad_buckets("auto")  # training's default: bucketed or not by measurement
    costs = costs_repl = None
    if not args.given_shares:  # warm-up measurement on an extra batch (equal shares to start)
        from hethub_jax.parallel.plan import balanced_shares
        mbs = args.microbatch
        costs = runtimes["proportional_bucketed"].measure_step_costs(global_batches[-1], steps=2)
        units = balanced_shares(args.batch // mbs, [u * mbs for u in costs[0]], costs[1])
        for n in ("proportional", "proportional_unbucketed", "proportional_bucketed", "proportional_measured_owners"):
            runtimes[n].set_batch_shares([u * mbs for u in units])
        costs_repl = runtimes["proportional_replicated"].measure_step_costs(global_batches[-1], steps=2)
        units = balanced_shares(args.batch // mbs, [u * mbs for u in costs_repl[0]], costs_repl[1])
        runtimes["proportional_replicated"].set_batch_shares([u * mbs for u in units])
    # (a): the all-reduce path by warm-up measurement at the final shares (training's default, auto)
    choice = runtimes["proportional"].choose_grad_buckets(global_batches[-1])
    chosen_mb = args.bucket_mb if choice["path"] == "bucketed" else None
    for n in ("proportional_replicated", "proportional_measured_owners"):
        runtimes[n].set_grad_buckets(chosen_mb)
    update_balance = {}
    # ZeRO-1 ownership from F/B and update seconds measured at the final shares: (am), and (a), (a0) if asked
    from hethub_jax.parallel.plan import balanced_update_fractions
    measured = ["proportional_measured_owners"] + (["proportional", "proportional_unbucketed"]
                                                    if args.measured_owners else [])
    for n in measured:
        runtimes[n].measure_step_costs(global_batches[-1], steps=2)
        c = runtimes[n].last_step_costs
        runtimes[n].set_update_weights(balanced_update_fractions(c["busy_s"], c["update_s"]))
        update_balance[n] = dict(c, fractions=runtimes[n].update_weights)
    shares = list(runtimes["proportional"].shares)
    shares_repl = list(runtimes["proportional_replicated"].shares)
    my_island = dict(ISLANDS[rank], slowdown=1.0 if rank == 0 else args.slowdown)
    alone = Plan.from_dict(alone_plan(L, my_island, shares[rank], args.microbatch))
    runtimes["alone"] = PipelineRuntime(alone, config, optim, seed=0)
    if rank == 0:
        print(f"hetero_dp: 2 CPU islands, one process each, pinned to one core each; {args.preset} model, "
              f"seq {args.seq}, microbatch {args.microbatch}")
        for line in runtimes["proportional"].emulation_lines():
            print("  " + line)
        print("  NOTE: the speed difference is EMULATED (sleep after each compute action), "
              "not two real accelerator types")
        how = ("given throughputs 3:1" if costs is None else "measured: " + ", ".join(
            f"{isl} {1 / u:.1f} samples/s + {f * 1e3:.0f} ms/step update" for isl, u, f in zip(("fast", "slow"), *costs)))
        print(f"  gradient all-reduce of (a) (train.grad_bucket_mb auto), MEASURED step forward/backward + all-reduce: "
              f"bucketed ({choice['bucket_mb']:g} MiB) {choice['bucketed_s']:.4f} s, after the backward "
              f"{choice['unbucketed_s']:.4f} s (fastest of {choice['steps']}, EMULATED slowdown included) -> "
              f"(a) runs {choice['path'].upper()}")
        print(f"  shares: proportional {shares} ({how}; replicated update: {shares_repl}), equal {equal.batch_shares()}, alone: fast {shares[0]} rows, "
              f"slow {shares[1]} rows")
        sys.stdout.flush()

    # the gradient all-reduce over the bridge: time spent in _reduce_shared per step (DP configs)
    reduce_time = time_reduce_shared([runtimes[n] for n in DP_CONFIGS])

    # alone: each island takes the rows of its share in the proportional run (same data, same work)
    lo = sum(shares[:rank])
    alone_batches = [{k: v[lo:lo + shares[rank]] for k, v in b.items()} for b in global_batches]

    def run_step(name: str, i: int) -> dict:
        rt = runtimes[name]
        batch = alone_batches[i] if name == "alone" else global_batches[i]
        reduce_time["t"] = 0.0
        world.Barrier()
        t0 = time.perf_counter()
        res = rt.train_step(batch)
        dt = time.perf_counter() - t0
        b = rt.last_bucket_stats if name != "alone" and rt.grad_bucket_bytes is not None else None
        rt.last_bucket_stats = None
        return {"time_s": dt, "tokens": res.num_tokens, "loss": res.loss, "reduce_s": reduce_time["t"], "buckets": b,
                "exchange_s": getattr(rt, "last_exchange_s", 0.0) if getattr(rt, "zero1", False) else 0.0}

    names = list(runtimes)
    compile_s = {}
    for n in names:
        t0 = time.perf_counter()
        run_step(n, 0)
        compile_s[n] = time.perf_counter() - t0
    results = {n: [] for n in names}
    for i in range(1, n_steps):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            r = run_step(n, i)
            if i > args.warmup:
                results[n].append(r)

    # (g) the ZeRO-1 parameter gather in the background (`overlap_param_gather`) against after the
    # update (proportional): blocks of consecutive steps of ONE configuration (a step's gather can only
    # hide behind what runs before the same runtime's next step, not behind other configurations'
    # steps), a barrier before each block, the gather of the block's last step waited for inside it;
    # blocks alternate, the order reversed every round; per rank: block seconds / steps
    gather = {"proportional": [], "proportional_overlap_gather": []}
    gather_wait = []  # overlapped: seconds each step's first action waited for the previous gather
    if args.gather_rounds > 0:
        ov = PipelineRuntime(prop, config, optim, seed=0, comm=comm, rank=rank)
        ov.set_grad_buckets(chosen_mb)
        ov.set_batch_shares(shares)
        ov.set_update_weights(runtimes["proportional"].update_weights)
        ov.overlap_param_gather = not args.gather_control
        blocks = {"proportional": runtimes["proportional"], "proportional_overlap_gather": ov}
        ov.train_step(global_batches[0])  # compiles
        ov.wait_params()
        for rnd in range(args.gather_rounds):
            for n in (list(blocks) if rnd % 2 == 0 else list(blocks)[::-1]):
                rt = blocks[n]
                world.Barrier()
                t0 = time.perf_counter()
                for i in range(1, 1 + args.gather_steps):
                    rt.train_step(global_batches[i % n_steps])
                    if n != "proportional" and i > 1:
                        gather_wait.append(rt.last_exchange_wait_s)
                rt.wait_params()
                gather[n].append((time.perf_counter() - t0) / args.gather_steps)
    load_end = loadavg()

    mine = {n: {"times": [r["time_s"] for r in rs], "tokens": [r["tokens"] for r in rs],
                "reduce": [r["reduce_s"] for r in rs], "loss": [r["loss"] for r in rs],
                "exchange": [r["exchange_s"] for r in rs],
                "buckets": [r["buckets"] for r in rs]} for n, rs in results.items()}
    gathered = world.gather({"rank": rank, "core": core, "mine": mine, "compile_s": compile_s,
                             "gather": gather, "gather_wait": gather_wait,
                             "machine": machine()}, root=0)
    if rank != 0:
        return
    by_rank = sorted(gathered, key=lambda g: g["rank"])
    per_step = {}
    for n in DP_CONFIGS:
        # a DP step ends on both ranks together (all-reduce); its time is the slower rank's
        ts = [max(a, b) for a, b in zip(by_rank[0]["mine"][n]["times"], by_rank[1]["mine"][n]["times"])]
        toks = by_rank[0]["mine"][n]["tokens"]
        per_step[n] = [t / s for t, s in zip(toks, ts)]
    tps = {n: median(v) for n, v in per_step.items()}
    alone_tps = [median([t / s for t, s in zip(g["mine"]["alone"]["tokens"], g["mine"]["alone"]["times"])])
                 for g in by_rank]
    upper = sum(alone_tps)
    figures = {
        "emulated": True, "slowdown": args.slowdown,
        "fraction_of_upper_bound": round(tps["proportional"] / upper, 4),
        "fraction_of_upper_bound_unbucketed": round(tps["proportional_unbucketed"] / upper, 4),
        "over_equal_shares": round(tps["proportional"] / tps["equal"], 4),
        "over_unbucketed": round(tps["proportional"] / tps["proportional_unbucketed"], 4),
        "fraction_of_upper_bound_bucketed": round(tps["proportional_bucketed"] / upper, 4),
        "over_bucketed": round(tps["proportional"] / tps["proportional_bucketed"], 4),
        "grad_allreduce_choice": dict(choice, measured="MEASURED warm-up seconds per step (forward/backward + "
                                      "gradient all-reduce, slowest rank, fastest pass; EMULATED slowdown included)"),
        "fraction_of_upper_bound_replicated": round(tps["proportional_replicated"] / upper, 4),
        "over_replicated": round(tps["proportional"] / tps["proportional_replicated"], 4),
        "fraction_of_upper_bound_measured_owners": round(tps["proportional_measured_owners"] / upper, 4),
        "over_measured_owners": round(tps["proportional"] / tps["proportional_measured_owners"], 4),
        "update_owner_fractions": update_balance.get("proportional_measured_owners", {}).get("fractions"),
        "update_balance_measured": update_balance or None,
        "owned_bytes_fraction_per_replica": owned_fraction(runtimes["proportional"]),
        "optimizer_sharding": "zero1 (proportional, proportional_unbucketed, proportional_bucketed, equal); replicated "
                              "(proportional_replicated)",
        "shares_replicated": shares_repl,
        "zero1_param_exchange_s_slow_rank": median(by_rank[1]["mine"]["proportional"]["exchange"]),
        **bucket_figures(by_rank[1]["mine"]["proportional_bucketed"]["buckets"]),
        "shares": shares, "shares_source": "given throughputs 3:1" if costs is None else "measured",
        "measured_unit_s": None if costs is None else costs[0], "measured_fixed_s": None if costs is None else costs[1],
        "tokens_per_s_proportional": tps["proportional"],
        "tokens_per_s_equal": tps["equal"],
        "tokens_per_s_fast_alone": alone_tps[0],
        "tokens_per_s_slow_alone": alone_tps[1],
        "tokens_per_s_upper_bound": upper,
        "measured_speed_ratio_alone_per_row": (alone_tps[0] / alone_tps[1]),
        # time in the gradient reduction (device->host, bridge all-reduce, host->device) on the slow rank,
        # which arrives last and so waits least: about its cost; the fast rank's figure includes waiting
        "grad_allreduce_s_slow_rank_proportional": median(by_rank[1]["mine"]["proportional"]["reduce"]),
    }
    if args.gather_rounds > 0:  # (g): a block ends on both ranks together; its time is the slower rank's
        block = {n: median([max(a, b) for a, b in zip(by_rank[0]["gather"][n], by_rank[1]["gather"][n])])
                 for n in by_rank[0]["gather"]}
        figures.update({
            "gather_consecutive_step_s": block,
            "overlap_gather_over_after_update": round(block["proportional"] / block["proportional_overlap_gather"], 4),
            "overlap_gather_wait_s_per_rank": [median(g["gather_wait"]) if g["gather_wait"] else None for g in by_rank],
            "gather_blocks": f"{args.gather_rounds} rounds x {args.gather_steps} consecutive steps per configuration"
                             + (" (A/A control: both gather after the update)" if args.gather_control else "")})
    rows = []
    row_shares = {"proportional": shares, "proportional_unbucketed": shares, "proportional_bucketed": shares,
                  "proportional_replicated": shares_repl, "proportional_measured_owners": shares,
                  "equal": equal.batch_shares()}
    for n in row_shares:
        label = f"shares {row_shares[n]}" + (f", {choice['path']} by measurement" if n == "proportional" else "")
        rows.append({"config": n, "shares": row_shares[n],
                     "tokens_per_s": tps[n],
                     "median_step_s": median([max(a, b) for a, b in zip(by_rank[0]["mine"][n]["times"],
                                                                         by_rank[1]["mine"][n]["times"])]),
                     "median_step_s_per_rank": [median(g["mine"][n]["times"]) for g in by_rank],
                     "median_grad_reduce_s_per_rank": [median(g["mine"][n]["reduce"]) for g in by_rank],
                     "step_tokens_per_s": per_step[n], "label": label})
    for g, isl in zip(by_rank, ("fast", "slow")):
        rows.append({"config": f"alone_{isl}", "rows_per_step": shares[g["rank"]],
                     "tokens_per_s": alone_tps[g["rank"]], "median_step_s": median(g["mine"]["alone"]["times"]),
                     "step_times_s": g["mine"]["alone"]["times"]})
    result = {
        "benchmark": "hetero_dp",
        "command": command_line(),
        "machine": dict(by_rank[0]["machine"], loadavg_start=load_start, loadavg_end=load_end,
                        cores_per_rank=[g["core"] for g in by_rank],
                        affinity_per_rank=[g["machine"]["affinity"] for g in by_rank]),
        "config": {"preset": args.preset, "model": config.to_dict(), "global_batch": args.batch,
                   "microbatch": args.microbatch, "seq_len": args.seq, "steps": args.steps, "warmup": args.warmup,
                   "emulated": True, "slowdown": args.slowdown, "islands": ["fast (rank 0)", "slow (rank 1)"],
                   "data": "real corpus (train split)", "proportional_shares": shares,
                   "equal_shares": equal.batch_shares(), "alone_rows": shares,
                   "compile_and_first_step_s_per_rank": [g["compile_s"] for g in by_rank],
                   "note": "EMULATED speed difference: the slow island sleeps (slowdown-1) x the measured time "
                           "of each compute action; gradients are all-reduced over the MPI host bridge each step"},
        "figures": figures,
        "rows": rows,
    }
    write_json(args.json, result)
    print(f"load avg {load_start} -> {load_end}; cores {[g['core'] for g in by_rank]}; "
          f"{args.steps} timed steps per configuration (median)")
    print(f"{'configuration':<44} {'tokens/s':>9} {'step s':>8}")
    for r in rows:
        what = r.get("label") or f"{r['rows_per_step']} rows/step"
        print(f"{r['config'] + ' (' + what + ')':<44} {r['tokens_per_s']:>9.1f} {r['median_step_s']:>8.3f}")
    print(f"upper bound (fast alone + slow alone) {upper:.1f} tokens/s")
    print(f"fraction_of_upper_bound = {figures['fraction_of_upper_bound']:.3f} ((a) ran {choice['path']}), "
          f"unbucketed {figures['fraction_of_upper_bound_unbucketed']:.3f}, "
          f"bucketed {figures['fraction_of_upper_bound_bucketed']:.3f}, "
          f"replicated update {figures['fraction_of_upper_bound_replicated']:.3f}, "
          f"owners by measurement {figures['fraction_of_upper_bound_measured_owners']:.3f} "
          f"(ZeRO-1 bytes owned {figures['owned_bytes_fraction_per_replica']}), "
          f"over_equal_shares = {figures['over_equal_shares']:.3f}  "
          f"[EMULATED slowdown {args.slowdown:g}x on island slow]")
    print(f"gradient all-reduce over the bridge ((a), slow rank, median): "
          f"{figures['grad_allreduce_s_slow_rank_proportional'] * 1e3:.1f} ms/step "
          f"(fast rank incl. waiting: {rows[0]['median_grad_reduce_s_per_rank'][0] * 1e3:.1f} ms); unbucketed "
          f"{rows[1]['median_grad_reduce_s_per_rank'][1] * 1e3:.1f} ms")
    chunks = runtimes["proportional_bucketed"]._chunks.get((0, 0))
    print(f"(ab) buckets: {figures['num_buckets']} (layer ranges, backward order: {chunks[1].chunks if chunks else None}); slow rank, median per step: bucket all-reduce "
          f"{figures['bucket_reduce_s'] * 1e3:.1f} ms, {figures['overlap_fraction']:.0%} of it before the "
          f"backward ended (overlapped), exposed wait after the backward {figures['bucket_exposed_s'] * 1e3:.1f} ms")
    if args.gather_rounds > 0:
        b = figures["gather_consecutive_step_s"]
        print(f"ZeRO-1 parameter gather ({figures['gather_blocks']}): after the update {b['proportional']:.3f} s/step, "
              f"in the background {b['proportional_overlap_gather']:.3f} s/step: "
              f"overlap_gather_over_after_update {figures['overlap_gather_over_after_update']:.3f}; the next step waited "
              f"(median, fast/slow) {figures['overlap_gather_wait_s_per_rank']} s for it")


if __name__ == "__main__":
    main()
