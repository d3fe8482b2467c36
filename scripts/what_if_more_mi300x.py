"""How much faster does this cluster train if 64 more MI300X are added? (PREDICTED, hethub_jax.planner)

    PYTHONPATH=. python scripts/what_if_more_mi300x.py [--cluster configs/clusters/mixed_h100_mi300x.yaml]
        [--group mi300x] [--devices 64] [--model llama3-8b] [--global-batch 256] [--seq-len 2048]

Adds ceil(devices / devices_per_node) nodes to the group and compares the best plans before and after.
"""
import argparse
import math

from hethub_jax import planner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cluster", default="configs/clusters/mixed_h100_mi300x.yaml")
    p.add_argument("--group", default="mi300x")
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=2048)
    a = p.parse_args()
    cluster = planner.load_cluster(a.cluster).resolved()
    per_node = cluster.group(a.group).devices_per_node
    nodes = math.ceil(a.devices / per_node)
    w = planner.what_if_add_nodes(a.model, cluster, a.group, nodes, a.global_batch, a.seq_len)
    print(f"PREDICTED, {a.model}, global batch {a.global_batch} x {a.seq_len} tokens")
    for label, c, n in (("before", w.before, cluster.num_devices), ("after", w.after, w.cluster_after.num_devices)):
        print(f"  {label:6} {n:6} devices: {c.tokens_per_s:12,.0f} tokens/s, step {c.step_time_s:.4g} s, "
              f"{c.kind}, MFU {100 * c.mfu:.1f}%")
    print(f"  +{nodes * per_node} {a.group} devices ({nodes} nodes): {w.speedup:.3f}x tokens/s (PREDICTED)")


if __name__ == "__main__":
    main()
