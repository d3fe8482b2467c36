"""Diagnostic (issue 17): the whole-model stage calls of ``benchmarks/hetero_e2e.py`` on one pinned core,
alone against the same calls while a second process runs the same model's calls on the other core.

    PYTHONPATH=. python benchmarks/corun_cores.py --json OUT.json [--mbs 8,16] [--rounds 6] [--cores 0,1]

Why: since 2026-12-03 hetero_e2e profiles its two islands one rank after the other (two profiles at once
ran out of host memory), so each profile's calls run with the other core idle, while in training both
cores compute at once (the fast island all the time; the slow one during its own compute, between its
EMULATED waits). If the cores share a cache level or the memory bandwidth (two vCPUs of one VM may be one
host core's two hyperthreads), a call runs slower with a busy neighbour, and the profile is then
below the run.

One process (the measurer) pinned to the first core, one XLA compute thread, the steady host allocator
before JAX starts (as every benchmark rank); a neighbour process pinned to the second core, built the same
way, loops the same model's fused forward + backward at microbatch ``--neighbour-mb`` while told to.
Rounds alternate ``alone`` (neighbour idle, acknowledged) and ``busy`` (neighbour looping), each
timing every call of ``--mbs`` (``profile.measure_stage``'s four calls: F, F_nosave, B, and the fused
``B_recompute`` = forward_backward on this one-stage model) ``--repeats`` times. Per call both wall
seconds and the measurer's process CPU seconds (``time.process_time``: a time slice lost to another
job on the core is not counted; cache and memory stalls are). Output: per call and condition the
median over rounds of the per-round medians, and ``busy / alone`` ratios. On a machine others share,
only the ratios within this run mean something (state the load average).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

MODEL = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512,
         "tie_word_embeddings": True}


def _start(core: int):
    """Allocator, pinning and one XLA thread before JAX starts (as benchmarks.common.pin_and_limit_threads)."""
    from hethub_jax.host_allocator import steady_host_allocator
    steady_host_allocator()
    os.sched_setaffinity(0, {core})
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import jax
    jax.devices()
    from hethub_jax.models.config import LlamaConfig
    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage
    cfg = LlamaConfig(**MODEL)
    L = cfg.num_hidden_layers
    st = PipelineStage(cfg, 0, L - 1, jax.devices()[:1], 1, 1, seed=0, recompute=False,
                       optimizer=make_optimizer(OptimConfig()))
    return cfg, st


def _calls(cfg, st, mb: int, seq: int):
    """name -> zero-argument call that blocks until its result is ready (the runtime's calls, as
    ``profile.measure_stage`` makes them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hethub_jax.parallel.stage import StageInputs
    from hethub_jax.profile import _inputs
    tokens, pos_h, mask, _ = _inputs(st, cfg, mb, seq)

    def args():
        return StageInputs(st.place_tokens(tokens), st.place_tokens(pos_h), st.place_tokens(tokens),
                           st.place_tokens(mask))
    g = jnp.ones((), jnp.float32)
    no = np.bool_(False)
    saved = st.forward_saving(st.params, args())[1]
    return {
        "F": lambda: jax.block_until_ready(st.forward_saving(st.params, args())[0]),
        "F_nosave": lambda: jax.block_until_ready(st.forward(st.params, args())),
        "B": lambda: jax.block_until_ready(st.backward_saved(saved, g, st.new_grad_buffer(), no)[0]),
        "B_recompute": lambda: jax.block_until_ready(st.forward_backward(st.params, args(), st.new_grad_buffer(), no)),
    }


def _neighbour(core: int, mb: int, seq: int, go, idle, stop, ready) -> None:
    cfg, st = _start(core)
    call = _calls(cfg, st, mb, seq)["B_recompute"]
    call()
    ready.set()
    while not stop.is_set():
        if go.is_set():
            idle.clear()
            call()
        else:
            idle.set()
            time.sleep(0.005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--cores", default="0,1", help="measurer's core, neighbour's core")
    ap.add_argument("--mbs", default="8,16", help="microbatch sizes measured")
    ap.add_argument("--neighbour-mb", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6, help="rounds per condition (alternating)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per call and round (after one untimed)")
    args = ap.parse_args()
    c0, c1 = (int(x) for x in args.cores.split(","))
    ctx = mp.get_context("spawn")
    go, idle, stop, ready = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    nb = ctx.Process(target=_neighbour, args=(c1, args.neighbour_mb, args.seq, go, idle, stop, ready), daemon=True)
    nb.start()
    import numpy as np
    cfg, st = _start(c0)
    mbs = [int(x) for x in args.mbs.split(",")]
    calls = {mb: _calls(cfg, st, mb, args.seq) for mb in mbs}
    ready.wait(600)
    res = {}  # (mb, call, cond) -> per-round (median wall, median cpu)
    t_start = time.time()
    load0 = os.getloadavg()
    for r in range(2 * args.rounds):
        cond = ("alone", "busy")[r % 2]
        if cond == "busy":
            go.set()
            time.sleep(0.2)
        else:
            go.clear()
            idle.wait(30)
            idle.clear()
            idle.wait(30)
        for mb in mbs:
            for name, fn in calls[mb].items():
                fn()
                wall, cpu = [], []
                for _ in range(args.repeats):
                    w0, p0 = time.perf_counter(), time.process_time()
                    fn()
                    wall.append(time.perf_counter() - w0)
                    cpu.append(time.process_time() - p0)
                res.setdefault(f"mb{mb}/{name}/{cond}", []).append((float(np.median(wall)), float(np.median(cpu))))
    stop.set()
    go.clear()
    nb.join(60)
    out = {}
    for k, v in res.items():
        out[k] = {"wall_s": float(np.median([x[0] for x in v])), "cpu_s": float(np.median([x[1] for x in v])),
                  "rounds_wall_s": [x[0] for x in v]}
    ratios = {}
    for mb in mbs:
        for name in calls[mb]:
            a, b = out[f"mb{mb}/{name}/alone"], out[f"mb{mb}/{name}/busy"]
            ratios[f"mb{mb}/{name}"] = {"wall_busy_over_alone": b["wall_s"] / a["wall_s"],
                                        "cpu_busy_over_alone": b["cpu_s"] / a["cpu_s"]}
    result = {"benchmark": "corun_cores", "argv": sys.argv[1:], "cores": [c0, c1], "started_utc": t_start,
              "loadavg_before": load0, "loadavg_after": os.getloadavg(), "calls": out, "ratios": ratios}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    for k, v in ratios.items():
        print(f"{k}: wall busy/alone {v['wall_busy_over_alone']:.3f}, cpu {v['cpu_busy_over_alone']:.3f}  "
              f"(alone wall {out[k + '/alone']['wall_s']:.4f} s)")
    print("loadavg", load0, "->", os.getloadavg())


if __name__ == "__main__":
    main()
