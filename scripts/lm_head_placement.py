"""Which device type should hold the LM head? (PREDICTED, hethub_jax.planner)

    PYTHONPATH=. python scripts/lm_head_placement.py [--cluster configs/clusters/mixed_h100_mi300x.yaml]
        [--model llama3-8b] [--global-batch 64] [--seq-len 2048]

For each node group, the best pipeline plan whose last stage (final norm, LM head over the vocabulary,
loss) runs on that group; the group with the least predicted step time should hold the head.
"""
import argparse

from hethub_jax import planner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cluster", default="configs/clusters/mixed_h100_mi300x.yaml")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048)
    a = p.parse_args()
    res = planner.lm_head_placement(a.model, a.cluster, a.global_batch, a.seq_len)
    print(f"PREDICTED, {a.model}, global batch {a.global_batch} x {a.seq_len} tokens")
    ok = {g: c for g, c in res.items() if c is not None}
    for g, c in res.items():
        if c is None:
            print(f"  LM head on {g:10}: no plan fits")
            continue
        st = c.plan.replicas[0].stages
        print(f"  LM head on {g:10}: step {c.step_time_s:.4g} s, {c.tokens_per_s:,.0f} tokens/s, layers "
              f"{[s.num_layers for s in st]} on {[s.island for s in st]}")
    if ok:
        best = min(ok, key=lambda g: (ok[g].step_time_s, g))
        print(f"  -> the LM head belongs on {best!r} (PREDICTED)")


if __name__ == "__main__":
    main()
