"""Planner search time at scale and optimality against exhaustive search (issue 14).

    PYTHONPATH=. python benchmarks/planner_scale.py --json planner_scale.json [--skip-16k] [--small N]

Rows:
  * ``768``: the HETHUB-like cluster (configs/clusters/hethub_768.yaml: 128 MI250X GCDs + 640 Ascend 910B) with
    the ~139 B ``llama-140b`` preset, global batch 1536 x 4096 tokens, up to 8 stages per group (90 layers
    need more than 4 stages of at most 10 layers per group);
  * ``16384``: configs/clusters/four_types_16k.yaml (4 x 4,096 of H100, MI300X, A100, MI250X GCDs) with the 80-layer
    ``llama3-70b``, global batch 4096 x 4096 tokens, up to 4 stages per group;
  * ``small-i``: random small models and 2-3 group CPU clusters (seeded), planner against
    ``exhaustive_search`` (the baseline in the same run: the same space, every split evaluated with predict).
Figures: ``search_s_768``, ``search_s_16384`` (wall seconds, one process), ``optimality_min`` (min over the
small cases of best exhaustive step time / best planner step time; 1.0 = optimal), candidates evaluated
(predict calls), ``cpu_s_*`` (CPU seconds of the process: less sensitive to a shared machine's load; the
load average is recorded per row). Every step time is PREDICTED. Goals: <= 1 s, <= 10 s, 1.0.
``--limit S`` stops a big case after S wall seconds and records it as not finished.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import time

from hethub_jax.planner import SearchOptions, cluster_from_dict, exhaustive_search, load_model, search


class _Limit(Exception):
    pass


def _on_alarm(*_):
    raise _Limit()


def big_case(name: str, model: str, cluster: str, gbs: int, seq: int, stages: int, limit_s: int = 0) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    if limit_s:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(limit_s)
    try:
        r = search(load_model(model), cluster, gbs, seq, options=SearchOptions(max_stages_per_group=stages))
    except _Limit:
        print(f"{name:>8}: NOT FINISHED within --limit {limit_s} s (cpu {time.process_time() - c0:.1f} s)")
        return {"case": name, "model": model, "cluster": cluster, "search_s": None, "cpu_s": None,
                "not_finished_within_s": limit_s, "load_average": os.getloadavg()}
    finally:
        signal.alarm(0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    b = r.best
    row = {"case": name, "model": model, "cluster": cluster, "global_batch": gbs, "seq_len": seq,
           "search_s": wall, "cpu_s": cpu, "load_average": os.getloadavg(),
           "configurations": r.skeletons, "expanded": r.expanded, "evaluated": r.evaluated,
           "best_kind": b.kind, "best_step_s_predicted": b.step_time_s, "best_tokens_per_s_predicted": b.tokens_per_s,
           "best_layers": [list(x) for x in b.layers], "best_mfu_predicted": b.mfu,
           "best_stages": [(s.island, s.dp, s.tp) for s in b.plan.replicas[0].stages]}
    print(f"{name:>8}: search {wall:7.2f} s (cpu {cpu:.2f} s, load {os.getloadavg()[0]:.1f}), {r.skeletons} configurations, {r.evaluated} predictions; best "
          f"{b.kind} step {b.step_time_s:.4g} s PREDICTED, layers {row['best_layers']}")
    return row


def small_case(i: int) -> dict:
    rnd = random.Random(1000 + i)
    heads = rnd.choice([2, 4])
    cfg = load_model({"preset": "tiny", "hidden_size": 16 * heads, "intermediate_size": 32 * heads,
                      "num_hidden_layers": rnd.randint(3, 6), "num_attention_heads": heads,
                      "num_key_value_heads": rnd.choice([1, 2]), "vocab_size": rnd.choice([256, 4096])})
    groups = [{"name": f"g{j}", "device": "cpu", "nodes": 1, "devices_per_node": rnd.choice([1, 2]),
               "slowdown": rnd.choice([1.0, 2.0, 3.0])} for j in range(rnd.choice([2, 3]))]
    cluster = cluster_from_dict({"groups": groups})
    gbs, seq = rnd.choice([4, 8]), rnd.choice([16, 32])
    opt = SearchOptions(top_k=1, max_stages_per_group=2)
    t0 = time.perf_counter()
    p = search(cfg, cluster, gbs, seq, options=opt)
    t1 = time.perf_counter()
    e = exhaustive_search(cfg, cluster, gbs, seq, options=opt)
    t2 = time.perf_counter()
    ratio = e.best.step_time_s / p.best.step_time_s
    print(f"small-{i}: {cfg.num_hidden_layers} layers, {len(groups)} groups: planner {t1 - t0:.2f} s "
          f"({p.evaluated} predictions), exhaustive {t2 - t1:.2f} s ({e.evaluated}); optimality {ratio:.12f}")
    return {"case": f"small-{i}", "layers": cfg.num_hidden_layers, "groups": groups, "global_batch": gbs,
            "seq_len": seq, "planner_s": t1 - t0, "exhaustive_s": t2 - t1, "planner_evaluated": p.evaluated,
            "exhaustive_evaluated": e.evaluated, "optimality": ratio}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--small", type=int, default=5, help="small exactness cases")
    ap.add_argument("--skip-16k", action="store_true", help="skip the 16,384-device case")
    ap.add_argument("--skip-768", action="store_true", help="skip the 768-device case")
    ap.add_argument("--limit", type=int, default=0, help="stop a big case after this many wall seconds "
                    "(reported as not finished); 0: no limit")
    a = ap.parse_args(argv)
    rows = [] if a.skip_768 else [big_case("768", "llama-140b", "configs/clusters/hethub_768.yaml", 1536, 4096, 8,
                                           a.limit)]
    if not a.skip_16k:
        rows.append(big_case("16384", "llama3-70b", "configs/clusters/four_types_16k.yaml", 4096, 4096, 4, a.limit))
    small = [small_case(i) for i in range(a.small)]
    by = {r["case"]: r for r in rows}
    figures = {"search_s_768": by.get("768", {}).get("search_s"),
               "search_s_16384": by.get("16384", {}).get("search_s"),
               "cpu_s_768": by.get("768", {}).get("cpu_s"),
               "cpu_s_16384": by.get("16384", {}).get("cpu_s"),
               "evaluated_768": by.get("768", {}).get("evaluated"),
               "evaluated_16384": by.get("16384", {}).get("evaluated"),
               "optimality_min": min(r["optimality"] for r in small) if small else None}
    print(json.dumps(figures))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"benchmark": "planner_scale", "command": " ".join(sys.argv), "machine": platform.platform(),
                       "config": {"small": a.small}, "figures": figures, "rows": rows + small}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
