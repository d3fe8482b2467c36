"""Peak host memory (RSS) and page faults per call of glibc allocator variants, on a small workload
(session 13, s13-misc; docs/benchmarks.md "Host allocator variants").

    PYTHONPATH=. python benchmarks/host_allocator_rss.py --json host_allocator_rss.json \
        [--variants steady,default,mmap64,mmap256,trim256] [--microbatch-sizes 4,16,32] [--seq-len 128]

Each variant runs in a fresh child process (pinned to one core with ``--cpu``; glibc's settings must be
made before JAX starts its threads): ``hethub_jax.host_allocator.steady_host_allocator`` as the runtime
sets it (``steady``: ``M_MMAP_MAX`` 0, ``M_TRIM_THRESHOLD`` 1 GiB in session 13, -1 = never since session 18, ``M_ARENA_MAX`` 1), glibc's
defaults (``default``), or ``steady`` plus, with ``mallopt`` after it, a fixed mmap threshold
(``mmapN``: ``M_MMAP_MAX`` 65536 again and ``M_MMAP_THRESHOLD`` N MiB: blocks of N MiB and more are
mmapped and unmapped on free, smaller ones come from the one heap) or a lower trim threshold
(``trimN``: ``M_TRIM_THRESHOLD`` N MiB). The workload is the profiler's (``hethub_jax.profile``): the
whole tiny model as one stage (embedding, 6 layers, LM head + loss on one CPU device), its four calls
(``F`` forward_saving, ``F_nosave`` forward, ``B`` backward_saved, ``B_recompute`` the fused
forward_backward) at each microbatch size in turn, twice over the sizes (round 2: after every size
has run once, the steady state of a process whose calls vary in size). Per variant: peak RSS
(``ru_maxrss``, KiB -> GiB), per round, size and phase the median seconds, CPU seconds of the process
(all its threads: less sensitive to a shared machine's load than wall time) and minor page faults per call
(``ru_minflt`` deltas, ``--repeats`` calls after one untimed call), CPU seconds of the child. Figures
are MEASURED on this machine; compare variants within one run (a shared machine's load changes
between runs).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = ("steady", "default", "mmap64", "mmap256", "trim256")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4


def _apply(variant: str) -> dict:
    """glibc settings of ``variant`` (before JAX starts); returns what was set."""
    import ctypes

    from hethub_jax import host_allocator
    if variant == "default":
        return {"variant": variant, "set": "glibc defaults (nothing set)"}
    info = host_allocator.steady_host_allocator(True)
    lib = ctypes.CDLL("libc.so.6")
    extra = {}
    if variant.startswith("mmap"):
        mib = int(variant[4:])
        extra = {"M_MMAP_MAX": lib.mallopt(M_MMAP_MAX, 65536),
                 "M_MMAP_THRESHOLD": lib.mallopt(M_MMAP_THRESHOLD, mib << 20), "mmap_threshold_mib": mib}
    elif variant.startswith("trim"):
        mib = int(variant[4:])
        extra = {"M_TRIM_THRESHOLD": lib.mallopt(M_TRIM_THRESHOLD, mib << 20), "trim_threshold_mib": mib}
    elif variant != "steady":
        raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")
    return {"variant": variant, "steady": info.get("reason"), "mallopt_ok": extra}


def child(variant: str, sizes: list[int], seq_len: int, repeats: int) -> dict:
    import resource
    settings = _apply(variant)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hethub_jax.optim import OptimConfig, make_optimizer
    from hethub_jax.parallel.stage import PipelineStage, StageInputs
    from hethub_jax.planner import load_model
    from hethub_jax.profile import _inputs

    cfg = load_model("tiny")
    st = PipelineStage(cfg, 0, cfg.num_hidden_layers - 1, jax.devices()[:1], 1, 1, seed=0, recompute=False,
                       optimizer=make_optimizer(OptimConfig()))
    ru = lambda: resource.getrusage(resource.RUSAGE_SELF)
    no = np.bool_(False)
    rows = []
    for rnd in (1, 2):
        for mbs in sizes:
            tokens, pos, mask, _ = _inputs(st, cfg, mbs, seq_len)
            args = lambda: StageInputs(st.place_tokens(tokens), st.place_tokens(pos), st.place_tokens(tokens),
                                       st.place_tokens(mask))
            box = {"acc": st.new_grad_buffer()}
            g = jnp.ones((), jnp.float32)

            def acc_call(fn):
                def call():
                    out = fn(box["acc"])
                    box["acc"] = out.acc if hasattr(out, "acc") else out[1].acc
                    jax.block_until_ready(box["acc"])
                return call
            saved_box = {}

            def f_saving():
                out, saved = st.forward_saving(st.params, args())
                jax.block_until_ready(out)
                saved_box["s"] = saved
            f_saving()
            calls = {"F": f_saving,
                     "F_nosave": lambda: jax.block_until_ready(st.forward(st.params, args())),
                     "B": acc_call(lambda acc: st.backward_saved(saved_box["s"], g, acc, no)),
                     "B_recompute": acc_call(lambda acc: st.forward_backward(st.params, args(), acc, no))}
            for phase, fn in calls.items():
                fn()  # untimed (compilation in round 1)
                secs, cpus, faults = [], [], []
                for _ in range(repeats):
                    r0, c0, t0 = ru().ru_minflt, time.process_time(), time.perf_counter()
                    fn()
                    secs.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
                    faults.append(ru().ru_minflt - r0)
                rows.append({"round": rnd, "microbatch_size": mbs, "phase": phase, "median_s": float(np.median(secs)),
                             "median_cpu_s": float(np.median(cpus)),
                             "min_s": min(secs), "median_faults": float(np.median(faults)), "max_faults": max(faults),
                             "maxrss_gib_so_far": ru().ru_maxrss / 2**20})
            saved_box.clear()
    r = ru()
    return {"settings": settings, "rows": rows, "peak_rss_gib": r.ru_maxrss / 2**20,
            "cpu_s": r.ru_utime + r.ru_stime, "minor_faults_total": r.ru_minflt}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--microbatch-sizes", default="4,16,32")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu", default="1", help="core to pin each child to (taskset -c); '' for none")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.microbatch_sizes.split(",")]
    if a.child:
        print(json.dumps(child(a.child, sizes, a.seq_len, a.repeats)))
        return 0
    out = {"benchmark": "host_allocator_rss", "command": " ".join(sys.argv), "microbatch_sizes": sizes,
           "seq_len": a.seq_len, "repeats": a.repeats, "model": "tiny (whole model as one stage)", "variants": {}}
    env = dict(os.environ)
    env.pop("HETHUB_HOST_ALLOCATOR", None)
    for v in a.variants.split(","):
        cmd = ([ "taskset", "-c", a.cpu] if a.cpu else []) + [sys.executable, __file__, "--child", v,
                                                               "--microbatch-sizes", a.microbatch_sizes,
                                                               "--seq-len", str(a.seq_len), "--repeats", str(a.repeats)]
        t0, load0 = time.perf_counter(), os.getloadavg()
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if res.returncode != 0:
            print(f"{v}: FAILED ({res.returncode})\n{res.stderr[-2000:]}")
            out["variants"][v] = {"failed": res.returncode, "stderr": res.stderr[-2000:]}
            continue
        d = json.loads(res.stdout.strip().splitlines()[-1])
        d.update(wall_s=time.perf_counter() - t0, load_average_before=load0, load_average_after=os.getloadavg())
        out["variants"][v] = d
        r2 = [r for r in d["rows"] if r["round"] == 2]
        step = {m: sum(r["median_s"] for r in r2 if r["microbatch_size"] == m) for m in sizes}
        cpu = {m: sum(r["median_cpu_s"] for r in r2 if r["microbatch_size"] == m) for m in sizes}
        flt = {m: sum(r["median_faults"] for r in r2 if r["microbatch_size"] == m) for m in sizes}
        print(f"{v:>8}: peak RSS {d['peak_rss_gib']:.2f} GiB, CPU {d['cpu_s']:.1f} s, round-2 seconds of the 4 calls "
              + ", ".join(f"mb{m} {step[m]:.3f}" for m in sizes) + " (CPU "
              + ", ".join(f"mb{m} {cpu[m]:.3f}" for m in sizes) + "); faults per 4 calls "
              + ", ".join(f"mb{m} {flt[m]:.0f}" for m in sizes) + f" (load {load0[0]:.1f})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
