"""Speed of ``planner.predictor.predict`` (the exact array simulator) against the straightforward
reference implementation it replaced (``tests/sim_reference.py``), on the real calls of a planner search
(issue 14).

    PYTHONPATH=. python benchmarks/predict_speed.py --json predict_speed.json [--calls N] [--repeat R]

Rows:
  * ``768``: every ``predict`` call of the 768-accelerator search of ``benchmarks/planner_scale.py``
    (configs/clusters/hethub_768.yaml, ``llama-140b``, global batch 1536 x 4096, up to 8 stages per group),
    captured while the search runs (search wall time reported), then timed again call by call: the fast
    ``predict`` (best of ``--repeat``) and ``reference_predict`` (once), and compared (step time, stages,
    critical path and timeline must be equal);
  * ``8192``: an 8192-device, 80-layer (llama3-70b shape) plan of 8 stages over two islands (H100 and
    MI300X catalog costs, dp 128 x tp 8), 64 and 512 microbatches, one process per island.
Figures: ``predict_ms_768`` / ``reference_ms_768`` (median over the calls, CPU seconds of this process),
``speedup_768``, ``predict_ms_8192_m512`` / ``reference_ms_8192_m512``, ``identical`` (every output equal),
``load_avg`` (1-minute load before and after). Every step time is PREDICTED. Goal: <= 20 ms per 768 call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from common import ROOT, command_line, loadavg, write_json

sys.path.insert(0, os.path.join(ROOT, "tests"))
import sim_reference  # noqa: E402  (the old simulator, the baseline)

from hethub_jax.parallel.plan import Plan  # noqa: E402
from hethub_jax.planner import SearchOptions, load_model, search  # noqa: E402
from hethub_jax.planner import predictor as P  # noqa: E402
from hethub_jax.planner.costs import DeviceCosts  # noqa: E402


def cpu_s(f, repeat: int) -> float:
    """Least CPU seconds (``time.process_time``) of ``repeat`` calls of ``f``."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        f()
        best = min(best, time.process_time() - t0)
    return best


def same(a, b) -> bool:
    return (a.step_time_s == b.step_time_s and a.critical_path == b.critical_path and a.stages == b.stages
            and tuple(a.timeline) == tuple(b.timeline))


def search_calls() -> tuple:
    """(search wall seconds, the (cfg, plan, costs, kwargs) of every predict call) of the 768 search."""
    calls, orig = [], P.predict

    def capture(cfg, plan, costs, **kw):
        calls.append((cfg, plan, dict(costs), kw))
        return orig(cfg, plan, costs, **kw)

    P.predict = capture
    try:
        t0 = time.perf_counter()
        search(load_model("llama-140b"), os.path.join(ROOT, "configs/clusters/hethub_768.yaml"), 1536, 4096,
               options=SearchOptions(max_stages_per_group=8))
        return time.perf_counter() - t0, calls
    finally:
        P.predict = orig


def plan_8192(m: int):
    cfg = load_model("llama3-70b")
    islands = [{"name": "h100", "platform": "cuda", "num_processes": 512, "devices_per_process": 8},
               {"name": "mi300x", "platform": "rocm", "num_processes": 512, "devices_per_process": 8}]
    stages = [{"island": "h100" if s < 4 else "mi300x", "dp": 128, "tp": 8, "first_layer": 10 * s,
               "last_layer": 10 * s + 9} for s in range(8)]
    plan = Plan.from_dict({"islands": islands, "stages": stages, "global_batch_size": 128 * m,
                           "microbatch_size": 128})
    return cfg, plan, {"h100": DeviceCosts.from_catalog("H100-SXM"), "mi300x": DeviceCosts.from_catalog("MI300X")}, \
        {"seq_len": 4096}


def time_calls(calls, repeat: int) -> list:
    rows = []
    for cfg, plan, costs, kw in calls:
        got, want = P.predict(cfg, plan, costs, **kw), sim_reference.reference_predict(cfg, plan, costs, **kw)
        new = cpu_s(lambda: P.predict(cfg, plan, costs, **kw), repeat)
        old = cpu_s(lambda: sim_reference.reference_predict(cfg, plan, costs, **kw), 1)
        rows.append({"stages": [plan.num_stages(r) for r in range(plan.num_replicas)],
                     "microbatches": plan.num_global_microbatches, "schedule": plan.schedule,
                     "predict_ms": new * 1e3, "reference_ms": old * 1e3, "identical": same(got, want),
                     "step_s_predicted": got.step_time_s})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--calls", type=int, default=0, help="time only the last N calls of the search (0: all)")
    ap.add_argument("--repeat", type=int, default=5, help="fast predict: best of this many runs per call")
    a = ap.parse_args(argv)
    load0 = loadavg()
    search_s, calls = search_calls()
    print(f"768 search: {search_s:.2f} s wall, {len(calls)} predict calls (load {load0})")
    rows = time_calls(calls[-a.calls:] if a.calls else calls, a.repeat)
    for m in (64, 512):
        r = time_calls([plan_8192(m)], a.repeat)[0]
        r["case"] = f"8192-m{m}"
        rows.append(r)
    for r in rows:
        print(f"{r.get('case', '768'):>9}: stages {r['stages']} x {r['microbatches']} microbatches ({r['schedule']}): "
              f"predict {r['predict_ms']:8.2f} ms, reference {r['reference_ms']:8.1f} ms, "
              f"x{r['reference_ms'] / r['predict_ms']:.1f}, identical {r['identical']}")
    s768 = [r for r in rows if "case" not in r]
    by = {r["case"]: r for r in rows if "case" in r}
    med = lambda k: statistics.median(r[k] for r in s768)  # noqa: E731
    figures = {"predict_ms_768": med("predict_ms"), "reference_ms_768": med("reference_ms"),
               "speedup_768": med("reference_ms") / med("predict_ms"),
               "predict_ms_8192_m512": by["8192-m512"]["predict_ms"],
               "reference_ms_8192_m512": by["8192-m512"]["reference_ms"],
               "identical": all(r["identical"] for r in rows), "search_s_768_wall": search_s,
               "load_avg": [load0[:1], loadavg()[:1]]}
    print(figures)
    if a.json:
        write_json(a.json, {"benchmark": "predict_speed", "command": command_line(), "figures": figures,
                            "rows": rows})
    return 0 if figures["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
