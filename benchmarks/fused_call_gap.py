"""Diagnostic (issue 17, session 18): why a one-stage 1F1B plan's fused forward+backward calls at microbatch 32
took about 2.2x the profile's seconds (hetero_e2e's quiet run of session 17, contender ``alone1f1b_slow``: MEASURED
50.44 s per step against PREDICTED 23.39 s from the profile's whole-model ``B_recompute`` sample, 3.87 s).

    PYTHONPATH=. python benchmarks/fused_call_gap.py --json OUT.json [--core 1] [--mb 32] [--small-mb 16]
        [--rounds 2] [--probe-mib 1280] [--probe-sleep 6] [--rss-limit-gib 5.5]

Everything runs in ONE process pinned to one core (``benchmarks.common.pin_and_limit_threads``: the steady host
allocator of ``hethub_jax.host_allocator`` and one XLA compute thread, before JAX starts, as the benchmark's ranks),
so the figures are ratios inside one run. Each call's cost is in process CPU seconds (``time.process_time``; user
and system seconds from ``getrusage`` beside it), which other processes' load moves less than wall seconds, with the
call's minor page faults (``ru_minflt``) and the C heap after it (glibc ``mallinfo2``: ``arena`` = heap bytes,
``keepcost`` = the free top the next trim would give back). Variants:

  ``probe``     no JAX: a C ``malloc`` block of ``--probe-mib`` MiB touched and freed (above the steady settings'
                ``M_TRIM_THRESHOLD`` glibc gives the heap's free top back to the kernel at the ``free``), then
                touched again at once and after ``--probe-sleep`` seconds: the second touch's faults and CPU
                seconds (on a VM with free page reporting the kernel hands freed pages to the host after ~2 s,
                and a page faulted in again then costs a host fault too); the same with a block under the
                threshold; and again with trimming off;
  ``profile``   the whole-model stage's fused ``forward_backward`` called as ``profile.measure_stage`` times its
                ``B_recompute`` (a fresh gradient buffer before each call, untimed), back to back;
  ``run_s1``    ``PipelineRuntime.train_step`` of the one-stage 1F1B plan (global batch 64, ``--mb``, 2
                microbatches: the first a fused F+B, the last the fused F+B+update), island slowdown 3 but its
                EMULATED wait switched off (``runtime.emulated_wait`` does nothing): each action's record;
  ``run_s3``    the same runtime with the EMULATED wait on (it sleeps 2x each compute action's wall seconds);
  ``small_s1``  a second runtime of the same plan at ``--small-mb`` (which matched its prediction), wait off;
  ``nofuse``    ``run_s1`` with ``rt.fuse_update = False`` (the update as its own call after both F+B);
  ``lowtrim_*`` ``run_s1``, ``profile`` and ``run_s3`` after ``mallopt(M_TRIM_THRESHOLD, --lowtrim-mib MiB)``: the
                heap's free top trimmed after every large call (what the steady 1 GiB does once the free top
                passes it), with and without the EMULATED sleep between the calls;
  ``notrim_*``  ``run_s1``, ``profile`` and ``run_s3`` after ``mallopt(M_TRIM_THRESHOLD, -1)`` (no automatic trim).
The runtime's same jitted ``forward_backward`` serves ``profile`` (the profiler's own stage compiles the same program).
Output: every call's record and per variant and action the median CPU seconds and faults (``--json``); stdout
lines as it goes. A watchdog ends the process when its resident set passes ``--rss-limit-gib`` (shared machine).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

MODEL = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512,
         "tie_word_embeddings": True}  # benchmarks/hetero_e2e.py MODEL (15.0 M parameters)


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.malloc.restype, LIBC.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
LIBC.free.argtypes = [ctypes.c_void_p]
LIBC.memset.restype, LIBC.memset.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
HAS_MALLINFO2 = hasattr(LIBC, "mallinfo2")
if HAS_MALLINFO2:
    LIBC.mallinfo2.restype = MallInfo2


def heap() -> dict:
    """The C heap now (MiB): arena (all arenas' bytes from the kernel) and keepcost (the main heap's free top)."""
    if not HAS_MALLINFO2:
        return {}
    m = LIBC.mallinfo2()
    return {"arena_mib": round(m.arena / 2**20, 1), "top_free_mib": round(m.keepcost / 2**20, 1)}


def snap() -> tuple:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.process_time(), ru.ru_utime, ru.ru_stime, time.perf_counter(), ru.ru_minflt, ru.ru_majflt


def delta(a: tuple, b: tuple) -> dict:
    return {"cpu_s": b[0] - a[0], "user_s": b[1] - a[1], "sys_s": b[2] - a[2], "wall_s": b[3] - a[3],
            "minflt": b[4] - a[4], "majflt": b[5] - a[5]}


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1]) / 2**20
    return 0.0


def watchdog(limit: float) -> None:
    def loop():
        while True:
            r = rss_gib()
            if r > limit:
                print(f"WATCHDOG: resident {r:.2f} GiB > {limit} GiB: exiting", flush=True)
                os._exit(3)
            time.sleep(0.25)
    threading.Thread(target=loop, daemon=True).start()


def probe(mib: int, sleep_s: float) -> dict:
    """Touch-free-touch of one C block: faults and CPU seconds of the second touch, at once and after a sleep."""
    n = mib << 20
    out = {}
    for label, pause in (("again_at_once", 0.0), (f"again_after_{sleep_s:g}s", sleep_s)):
        p = LIBC.malloc(n)
        LIBC.memset(p, 1, n)
        LIBC.free(p)
        h = heap()
        time.sleep(pause)
        s0 = snap()
        p = LIBC.malloc(n)
        LIBC.memset(p, 2, n)
        s1 = snap()
        LIBC.free(p)
        out[label] = dict(delta(s0, s1), heap_after_free=h, pages=n // resource.getpagesize())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--core", type=int, default=1, help="pin to this core")
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--small-mb", type=int, default=16, help="0: no small-microbatch runtime")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--probe-mib", type=int, default=1280)
    ap.add_argument("--probe-small-mib", type=int, default=512)
    ap.add_argument("--probe-sleep", type=float, default=6.0)
    ap.add_argument("--skip", default="", help="comma-separated variants to skip (probe,nofuse,lowtrim,notrim,small)")
    ap.add_argument("--lowtrim-mib", type=int, default=256,
                    help="the lowtrim_* variants: M_TRIM_THRESHOLD this many MiB (0: none), so that every call's "
                         "large free top is trimmed, as when the heap's free top passes the steady 1 GiB")
    ap.add_argument("--trim-mib", type=int, default=1024,
                    help="M_TRIM_THRESHOLD (MiB) set after the steady settings: 1024 = the steady settings before "
                         "session 18; 0 = as hethub_jax.host_allocator sets it now (never trim)")
    ap.add_argument("--memory-analysis", action="store_true", help="also XLA's memory_analysis of the two programs")
    ap.add_argument("--rss-limit-gib", type=float, default=5.5)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    from benchmarks.common import pin_and_limit_threads
    core = pin_and_limit_threads(args.core)
    if args.trim_mib:  # the steady settings as they were before session 18 (M_TRIM_THRESHOLD 1 GiB)
        LIBC.mallopt(-1, args.trim_mib << 20)
    watchdog(args.rss_limit_gib)
    result = {"benchmark": "fused_call_gap", "args": vars(args), "core": core, "records": [], "probe": {}}

    def save():
        with open("/proc/loadavg") as f:
            result["loadavg_end"] = f.read().split()[:3]
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    if "probe" not in skip:  # before JAX: a small, clean heap
        for mib in (args.probe_mib, args.probe_small_mib):
            result["probe"][f"steady_{mib}MiB"] = probe(mib, args.probe_sleep)
            print("probe", mib, json.dumps(result["probe"][f"steady_{mib}MiB"]), flush=True)

    import jax
    import jax.numpy as jnp
    import numpy as np
    jax.devices()
    from hethub_jax.models.config import LlamaConfig
    from hethub_jax.optim import OptimConfig
    from hethub_jax.parallel import runtime as R
    from hethub_jax.parallel.plan import Plan
    from hethub_jax.parallel.stage import StageInputs
    from hethub_jax.profile import _inputs

    cfg = LlamaConfig(**MODEL)
    optim = OptimConfig(learning_rate=1e-3, warmup_steps=2, decay_steps=1000)  # hetero_e2e's

    def runtime(mb):
        plan = Plan.from_dict({"islands": [{"name": "slow", "platform": "cpu", "num_processes": 1,
                                            "devices_per_process": 1, "slowdown": 3.0}],
                               "stages": [{"island": "slow", "first_layer": 0, "last_layer": cfg.num_hidden_layers - 1}],
                               "global_batch_size": args.batch, "microbatch_size": mb, "schedule": "1f1b",
                               "recompute": "none", "seq_len": args.seq})
        return R.PipelineRuntime(plan, cfg, optim, seed=0)

    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab_size, (args.batch, args.seq), dtype=np.int32),
             "targets": rng.integers(0, cfg.vocab_size, (args.batch, args.seq), dtype=np.int32),
             "loss_mask": np.ones((args.batch, args.seq), np.float32)}

    wait = {"on": False, "slept": 0.0}

    def emulated_wait(s):
        wait["slept"] += s
        if wait["on"]:
            time.sleep(s)
    R.emulated_wait = emulated_wait
    current = {"variant": None}
    orig_execute = R._StepExecutor._execute

    def execute(self, k, a, nxt):
        slept0, s0 = wait["slept"], snap()
        orig_execute(self, k, a, nxt)
        s1 = snap()
        rec = dict(delta(s0, s1), variant=current["variant"], action=str(a), mb=self.rt.plan.microbatch_size,
                   emulated_wait_s=wait["slept"] - slept0, **heap())
        rec["own_wall_s"] = rec["wall_s"] - (rec["emulated_wait_s"] if wait["on"] else 0.0)
        if a.kind.name in ("F", "B") or str(a)[:1] in "FB":
            result["records"].append(rec)
    R._StepExecutor._execute = execute

    def step(rt, variant, sleep_on):
        current["variant"], wait["on"] = variant, sleep_on
        s0 = snap()
        res = rt.train_step(batch)
        d = delta(s0, snap())
        result["records"].append(dict(d, variant=variant, action="step", mb=rt.plan.microbatch_size,
                                      step_time_s=res.step_time_s, **heap()))
        acts = [r for r in result["records"][-5:] if r["variant"] == variant and r["action"] != "step"]
        print(f"{variant} mb {rt.plan.microbatch_size}: step cpu {d['cpu_s']:.2f} s (sys {d['sys_s']:.2f}) wall "
              f"{d['wall_s']:.2f} s flt {d['minflt']}; " + "; ".join(
                  f"{r['action']} cpu {r['cpu_s']:.2f} sys {r['sys_s']:.2f} own_wall {r['own_wall_s']:.2f} flt {r['minflt']} "
                  f"heap {r.get('arena_mib')}/{r.get('top_free_mib')}" for r in acts[-4:]) + f"; rss {rss_gib():.2f} GiB",
              flush=True)

    rt = runtime(args.mb)
    st = rt.stages[(0, 0)]
    tokens, pos_h, mask, _ = _inputs(st, cfg, args.mb, args.seq)

    def prof_args():
        return StageInputs(st.place_tokens(tokens), st.place_tokens(pos_h), st.place_tokens(tokens), st.place_tokens(mask))

    def profile(variant, calls=2):
        """measure_stage's B_recompute on the last (here: only) stage: fresh buffer untimed, then the call."""
        current["variant"] = variant
        for _ in range(calls):
            acc = st.new_grad_buffer()
            jax.block_until_ready(acc)
            s0 = snap()
            jax.block_until_ready(st.forward_backward(st.params, prof_args(), acc, np.bool_(False)))
            d = delta(s0, snap())
            result["records"].append(dict(d, variant=variant, action="fused_FB", mb=args.mb, **heap()))
            print(f"{variant} mb {args.mb}: fused F+B cpu {d['cpu_s']:.2f} s (sys {d['sys_s']:.2f}) wall "
                  f"{d['wall_s']:.2f} flt {d['minflt']} heap {heap()}; rss {rss_gib():.2f} GiB", flush=True)

    small = runtime(args.small_mb) if args.small_mb and "small" not in skip else None
    t0 = time.perf_counter()
    step(rt, "warm", False)  # compiles the fused F+B and F+B+update
    profile("warm_profile", 1)
    if small is not None:
        step(small, "warm_small", False)
    print(f"warm-up {time.perf_counter() - t0:.0f} s", flush=True)
    save()
    units = {"run_s1": lambda: step(rt, "run_s1", False), "profile": lambda: profile("profile"),
             "run_s3": lambda: step(rt, "run_s3", True)}
    if small is not None:
        units["small_s1"] = lambda: step(small, "small_s1", False)
    names = list(units)
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            units[n]()
        save()
    if "nofuse" not in skip:
        rt.fuse_update = False
        step(rt, "warm_nofuse", False)  # compiles the separate update
        step(rt, "nofuse", False)
        rt.fuse_update = True
        save()
    M_TRIM_THRESHOLD = -1  # glibc malloc.h
    if args.lowtrim_mib and "lowtrim" not in skip:  # the heap's free top over a lower threshold: trimmed at every free
        ok = LIBC.mallopt(M_TRIM_THRESHOLD, args.lowtrim_mib << 20)
        print(f"mallopt(M_TRIM_THRESHOLD, {args.lowtrim_mib} MiB) -> {ok}", flush=True)
        step(rt, "warm_lowtrim", False)
        step(rt, "lowtrim_run_s1", False)
        profile("lowtrim_profile")
        step(rt, "lowtrim_run_s3", True)
        save()
    if "notrim" not in skip:
        ok = LIBC.mallopt(M_TRIM_THRESHOLD, -1)
        result["notrim_mallopt_ok"] = ok
        print(f"mallopt(M_TRIM_THRESHOLD, -1) -> {ok}", flush=True)
        step(rt, "warm_notrim", False)
        step(rt, "notrim_run_s1", False)
        profile("notrim_profile")
        step(rt, "notrim_run_s3", True)
        if "probe" not in skip:
            result["probe"][f"notrim_{args.probe_mib}MiB"] = probe(args.probe_mib, args.probe_sleep)
            print("probe notrim", json.dumps(result["probe"][f"notrim_{args.probe_mib}MiB"]), flush=True)
        save()
    if args.memory_analysis:
        acc = st.new_grad_buffer()
        ma = {}
        try:
            for name, low in (("forward_backward", lambda: st.forward_backward.lower(st.params, prof_args(), acc, np.bool_(False))),
                              ("forward_backward_update", lambda: st.forward_backward_update.lower(
                                  st.params, st.opt_state, prof_args(), acc, np.bool_(False), jnp.float32(1e-4)))):
                m = low().compile().memory_analysis()
                ma[name] = {k: getattr(m, k, None) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                                             "output_size_in_bytes", "alias_size_in_bytes")}
                print("memory_analysis", name, ma[name], flush=True)
        except Exception as e:  # noqa: BLE001 - a diagnostic: record and go on
            ma["error"] = repr(e)
        result["memory_analysis"] = ma
    # summary: per variant and action, medians
    by = {}
    for rec in result["records"]:
        by.setdefault((rec["variant"], rec["action"]), []).append(rec)
    result["summary"] = {f"{v}/{a}": {k: float(np.median([r[k] for r in rs])) for k in
                                      ("cpu_s", "sys_s", "user_s", "minflt", "wall_s")} | {"n": len(rs)}
                         for (v, a), rs in by.items()}
    save()
    for k, s in result["summary"].items():
        print(k, {x: round(y, 3) for x, y in s.items()}, flush=True)


if __name__ == "__main__":
    main()
