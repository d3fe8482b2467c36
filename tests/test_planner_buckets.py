"""The planner ranks heterogeneous-DP candidates by the gradient all-reduce path the runtime keeps (issues
17 / 13, session 16): ``SearchOptions.grad_bucket_mb`` (default ``"auto"``, as ``train.grad_bucket_mb``).

References are independent of the search's ranking: ``predict`` of each plan on each path (``grad_bucket_mb``
None: after the backward; a number: bucketed), the runtime's one rule ``keeps_bucketed_allreduce`` applied to
those two figures, and ``exhaustive_search`` (every plan of the space predicted, no bound). Costs are hand-made
profiles (a compute line in FLOPs, nothing else measured) whose ``fits.chunked_last`` ratio and the cluster's
bridge bandwidth are chosen so that the two paths order the plans differently.
"""
from __future__ import annotations

import dataclasses

import pytest

from hethub_jax.parallel.plan import keeps_bucketed_allreduce
from hethub_jax.planner import SearchOptions, cluster_from_dict, exhaustive_search, load_model, search
from hethub_jax.planner.costs import PROFILE_FORMAT, DeviceCosts
from hethub_jax.planner.predictor import predict
from hethub_jax.planner.search import _setup, bridge_for

OPT = SearchOptions(top_k=2, max_stages_per_group=1, schedules=("1f1b",), recompute=("none",))


def model():
    # 4 layers of hidden 256: ~3.4 MB of float32 gradients, more than the runtime's 1 MiB first bucket, so the
    # bucketed path has several buckets to overlap with the last backward
    return load_model({"preset": "tiny", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                       "tie_word_embeddings": False})


def profile(chunked_ratio: float) -> dict:
    """A hand-made CPU profile: every phase 1 ns per FLOP plus 1 ms per call, the chunked last microbatch
    ``chunked_ratio`` x the fused one at every token count; updates, sums and in-island all-reduces free."""
    z = {"c0": 0.0, "c1": 0.0}
    parts = {"layer": {"c0": 0.0, "c1": 1e-9}, "embed": z, "head": z, "base": {"c0": 1e-3, "c1": 0.0}}
    return {"format": PROFILE_FORMAT, "device_type": "cpu", "platform": "cpu", "memory_bytes": 10**12,
            "fits": {"compute": {"1": {ph: parts for ph in ("F", "F_nosave", "B", "B_recompute")}},
                     "update": z, "allreduce": z,
                     "chunked_last": {"points": [[1, chunked_ratio], [10**6, chunked_ratio]]}}}


def problem(bandwidth: float, chunked_ratio: float, slowdown: float = 2.0):
    cluster = cluster_from_dict({
        "groups": [{"name": "a", "device": "cpu", "nodes": 1, "devices_per_node": 1},
                   {"name": "b", "device": "cpu", "nodes": 1, "devices_per_node": 1, "slowdown": slowdown}],
        "links": [{"between": ["a", "b"], "bandwidth": bandwidth, "latency_s": 1e-4}]})
    costs = {g: DeviceCosts.from_profile(profile(chunked_ratio)) for g in ("a", "b")}
    return model(), cluster, costs


def both_paths(cfg, cluster, costs, plan):
    """(unbucketed, bucketed) PREDICTED step seconds of ``plan``, each asked for on its own."""
    br = bridge_for(cluster, [("a", "b")])
    u = predict(cfg, plan, costs, seq_len=16, bridge=br, grad_bucket_mb=None)
    b = predict(cfg, plan, costs, seq_len=16, bridge=br, grad_bucket_mb=25.0)
    assert u.grad_allreduce == "unbucketed" and b.grad_allreduce == "bucketed"
    return u.step_time_s, b.step_time_s


def test_kept_bucketed_path_changes_the_best_plan():
    """On the all-reduce after the backward the best pipeline beats the best hetero-DP plan; on the bucketed
    path the hetero-DP plan is faster than the pipeline by more than the runtime's 2% rule, so the runtime
    would keep buckets and the planner (default ``grad_bucket_mb: auto``) must choose it. Ranking by the
    unbucketed step (the code before session 16) chose the pipeline."""
    cfg, cluster, costs = problem(2e8, 0.8)
    best = search(cfg, cluster, 8, 16, costs=costs, options=OPT).best
    pipe = search(cfg, cluster, 8, 16, costs=costs, options=dataclasses.replace(OPT, hetero_dp=False)).best
    assert best.kind == "hetero-dp", (best.kind, best.step_time_s, pipe.step_time_s)
    step_u, step_b = both_paths(cfg, cluster, costs, best.plan)
    # the figures that make the case: the kept path reorders the two plans
    assert keeps_bucketed_allreduce(step_b, step_u)
    assert step_b < pipe.step_time_s < step_u
    assert best.prediction.grad_allreduce == "bucketed" and best.step_time_s == pytest.approx(step_b, rel=1e-12)
    assert best.prediction.buckets["auto_keeps"] == "bucketed"
    # grad_bucket_mb None (train.grad_bucket_mb null): ranked after the backward, the pipeline wins
    off = search(cfg, cluster, 8, 16, costs=costs, options=dataclasses.replace(OPT, grad_bucket_mb=None)).best
    assert off.kind == "pipeline" and off.step_time_s == pytest.approx(pipe.step_time_s, rel=1e-12)


def test_gain_under_the_runtime_margin_keeps_the_unbucketed_ranking():
    """ratio 1.0 and this bridge: bucketed is predicted faster, by less than 2%: the runtime keeps the all-reduce
    after the backward and the planner ranks the plan by that step."""
    cfg, cluster, costs = problem(2e8, 1.0)
    res = search(cfg, cluster, 8, 16, costs=costs, options=dataclasses.replace(OPT, top_k=20))
    het = [c for c in res.candidates if c.kind == "hetero-dp"]
    assert het
    for c in het:
        step_u, step_b = both_paths(cfg, cluster, costs, c.plan)
        if step_b is None or not keeps_bucketed_allreduce(step_b, step_u):
            assert c.prediction.grad_allreduce == "unbucketed" and c.step_time_s == pytest.approx(step_u, rel=1e-12)
    assert any(c.prediction.step_time_bucketed_s is not None
               and c.prediction.step_time_bucketed_s < c.prediction.step_time_unbucketed_s
               and c.prediction.grad_allreduce == "unbucketed" for c in het)


@pytest.mark.parametrize("bandwidth,ratio,slowdown", [(2e8, 0.8, 2.0), (2e8, 0.5, 2.0), (5e7, 0.3, 3.0),
                                                      (1e8, 1.0, 2.0), (3e8, 1.2, 1.5)])
def test_search_equals_exhaustive_with_buckets(bandwidth, ratio, slowdown):
    """The pruned search and exhaustive enumeration (no bound) agree on the best step when candidates are
    ranked by the kept path, also where the chunked last microbatch is measured FASTER than fused (ratio < 1:
    the bucketed step can fall below the unbucketed compute bound)."""
    cfg, cluster, costs = problem(bandwidth, ratio, slowdown)
    for opt in (SearchOptions(top_k=2, max_stages_per_group=2),
                SearchOptions(top_k=1, max_stages_per_group=1, microbatch_sizes=(1, 2))):
        ref = exhaustive_search(cfg, cluster, 8, 16, costs=costs, options=opt)
        got = search(cfg, cluster, 8, 16, costs=costs, options=opt)
        assert got.best.step_time_s == pytest.approx(ref.best.step_time_s, rel=1e-12)
        assert got.candidates[-1].step_time_s >= ref.candidates[-1].step_time_s * (1 - 1e-12)


@pytest.mark.parametrize("ratio", [0.5, 0.1])
def test_hetero_bounds_stay_below_the_bucketed_step(ratio):
    """The hetero-DP bounds (``hetero_lb`` of every plan of a microbatch size, ``hetero_plan_lb`` of one plan)
    with a chunked last microbatch at ``ratio`` x the fused seconds stay at most every hetero plan's kept-path
    (bucketed) step. Two equal groups (shares 4/4) and a fast bridge (the all-reduce tail near 0): the step is
    nearly the pipeline. (With these costs the bounds count a microbatch at its forward alone, the cheaper of
    F and F+B, so even the unlowered bound stays below here; the lowering by ``bucket_slack`` is what makes it a
    bound for every ratio, ``search._Planner.bucket_slack``.)"""
    from hethub_jax.parallel.plan import proportional_shares
    cfg, cluster, costs = problem(1e12, ratio, slowdown=1.0)
    res = search(cfg, cluster, 8, 16, costs=costs, options=dataclasses.replace(OPT, top_k=20))
    het = [c for c in res.candidates if c.kind == "hetero-dp" and c.prediction.grad_allreduce == "bucketed"]
    assert het
    p = _setup(cfg, cluster, 8, 16, costs, OPT, None)
    assert p.bucket_slack("a") == pytest.approx(1 - ratio)
    off = _setup(cfg, cluster, 8, 16, costs, dataclasses.replace(OPT, grad_bucket_mb=None), None)
    assert off.bucket_slack("a") == 0
    for c in het:
        mbs, M = c.plan.microbatch_size, 8 // c.plan.microbatch_size
        assert p.hetero_lb(mbs, "none", M) <= c.step_time_s * (1 + 1e-9)
        names = ["a", "b"]
        reps = [p.replica_of(g, mbs, "1f1b", "none", M) for g in names]
        units = proportional_shares(M, [mbs / r[0] for r in reps])
        assert [u * mbs for u in units] == [r.batch_share for r in c.plan.replicas]
        assert p.hetero_plan_lb(names, reps, units, M) <= c.step_time_s * (1 + 1e-9)


def test_bad_grad_bucket_mb_is_refused():
    cfg, cluster, costs = problem(2e8, 0.8)
    for bad in (0, -1.0, "25", True, float("nan")):
        with pytest.raises(ValueError, match="grad_bucket_mb"):
            search(cfg, cluster, 8, 16, costs=costs, options=dataclasses.replace(OPT, grad_bucket_mb=bad))


def test_plan_cli_grad_bucket_mb_option():
    """``python -m hethub_jax.plan --grad-bucket-mb``: auto (default), none, or MiB > 0 into SearchOptions."""
    import argparse

    from hethub_jax.plan import _bucket_mb, _parser
    base = ["--model", "tiny", "--cluster", "c.yaml", "--global-batch", "4"]
    assert _parser().parse_args(base).grad_bucket_mb == "auto" == SearchOptions().grad_bucket_mb
    assert _bucket_mb("none") is None and _bucket_mb("12.5") == 12.5 and _bucket_mb("AUTO") == "auto"
    for bad in ("0", "-3", "x", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            _bucket_mb(bad)


def test_plan_less_training_ranks_by_the_runs_grad_bucket_mb():
    """Plan-less training searches with the run's ``train.grad_bucket_mb`` and its suggested plan command says
    so when it is not the default (the command's arguments parse back to the same value)."""
    import shlex

    from hethub_jax.plan import _parser
    from hethub_jax.train_predict import _search_options, plan_command
    assert _search_options(None).grad_bucket_mb == "auto" and _search_options(None, None).grad_bucket_mb is None
    for value, shown in (("auto", None), (None, "none"), (12.5, "12.5")):
        argv = shlex.split(plan_command("tiny", "c.yaml", 16, 64, grad_bucket_mb=value))[3:]
        assert ("--grad-bucket-mb" in argv) == (shown is not None)
        if shown:
            assert argv[argv.index("--grad-bucket-mb") + 1] == shown
        assert _parser().parse_args(argv).grad_bucket_mb == value
