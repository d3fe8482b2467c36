"""Plan-less training measures the bridge's all-reduce on the job's own ranks and plans with the same top k as the
plan CLI (session 17, branch s17-bridge; hethub_jax/train_predict.py ``bridge_allreduce_step``, planner/search.py
``DEFAULT_TOP_K``).

References: the saved file's line given to every group's costs checked against ``c0 + c1 x bytes`` by hand; the
plan-less prediction against ``predictor.predict`` of the same plan with costs carrying that line; the plan CLI's
``--out`` plan against plan-less training's on every example cluster; under ``mpiexec -n 2`` (tiny sizes) the
measured fit against the profiler's Hockney fit of the saved samples, the same on both ranks, reused by a second
planning in the same job, and a failure on one rank ending both with that rank's error. Measured figures are only
checked for presence and sign, never against hard-coded values.
"""
from __future__ import annotations

import inspect
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from hethub_jax import train_predict as tp  # noqa: E402
from hethub_jax.parallel.plan import Plan  # noqa: E402
from hethub_jax.planner.costs import (BRIDGE_ALLREDUCE_FILE, BRIDGE_ALLREDUCE_FORMAT, DeviceCosts,  # noqa: E402
                                      read_bridge_allreduce)
from hethub_jax.planner.search import DEFAULT_TOP_K, SearchOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY2 = ROOT / "configs/clusters/tiny_2island_cpu.yaml"
MODEL = {"preset": "tiny", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1}


def _fixed_profile():
    from test_train_insight import fixed_profile
    return fixed_profile()


def _write_bridge_file(folder: Path, c0: float, c1: float) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    d = {"format": BRIDGE_ALLREDUCE_FORMAT, "fit": {"c0": c0, "c1": c1}, "samples": [], "date": "2026-12-03T16:00:00+00:00",
         "ranks": 2, "hosts": ["h0", "h1"]}
    (folder / BRIDGE_ALLREDUCE_FILE).write_text(json.dumps(d))
    return d


# ---- one default top k for the plan CLI and plan-less training --------------------------------------------

def test_plan_cli_and_planless_training_share_one_default_top_k():
    from hethub_jax.plan import _parser
    from hethub_jax.planner.api import plan
    assert DEFAULT_TOP_K >= 2  # more than the chosen plan: the split per stage ranks the top k again
    assert tp._search_options(None).top_k == DEFAULT_TOP_K
    assert tp._search_options(4, None).top_k == DEFAULT_TOP_K
    assert _parser().get_default("top") == DEFAULT_TOP_K
    assert SearchOptions().top_k == DEFAULT_TOP_K
    assert inspect.signature(plan).parameters["top_k"].default == DEFAULT_TOP_K
    # the suggested plan command needs no --top: the CLI's default is plan-less training's k
    assert "--top" not in tp.plan_command("tiny", str(TINY2), 16, 128)


def _cases():
    """(model, cluster, global batch, seq len, microbatch sizes) per example cluster: a model the cluster trains."""
    return [("tiny", TINY2, 16, 128, None),
            ("llama3-8b", ROOT / "configs/clusters/mixed_h100_mi300x.yaml", 64, 2048, None),
            ("llama3-70b", ROOT / "configs/clusters/hethub_768.yaml", 1536, 4096, (1,)),
            pytest.param(("llama3-70b", ROOT / "configs/clusters/four_types_16k.yaml", 4096, 4096, (1,)),
                         marks=pytest.mark.slow, id="four_types_16k")]  # about 1.5 min of search on 2 cores


def test_every_example_cluster_is_covered():
    cases = [c.values[0] if hasattr(c, "values") else c for c in _cases()]
    assert {c[1].name for c in cases} == {p.name for p in (ROOT / "configs/clusters").glob("*.yaml")}


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[1].stem if isinstance(c, tuple) else None)
def test_planless_training_and_the_cli_call_runnable_result_with_one_k_and_choose_one_plan(case, tmp_path,
                                                                                            monkeypatch):
    """Both paths pass the search's top ``DEFAULT_TOP_K`` to ``runnable_result`` (recorded by a wrapper around
    the real function) and write the same plan (catalog costs: no profiles)."""
    import hethub_jax.planner.runnable as rn
    from hethub_jax.plan import main as plan_main
    from hethub_jax.planner import load_cluster, load_model
    model, cluster, gbs, seq, mbs = case
    calls, real = [], rn.runnable_result

    def recording(res, *a, **kw):
        calls.append((len(res.candidates), kw["options"].top_k))
        return real(res, *a, **kw)
    monkeypatch.setattr(rn, "runnable_result", recording)
    cfg = load_model(model)
    c = load_cluster(str(cluster))
    best = tp._search(cfg, c, gbs, seq, mbs[0] if mbs else None, {g.name: None for g in c.resolved().groups}).best
    argv = ["--model", model, "--cluster", str(cluster), "--global-batch", str(gbs), "--seq-len", str(seq),
            "--no-upper-bound", "--out", str(tmp_path / "cli.json")]
    assert plan_main(argv + (["--microbatch-sizes", *map(str, mbs)] if mbs else [])) == 0
    assert len(calls) == 2 and calls[0][1] == calls[1][1] == DEFAULT_TOP_K, calls
    assert calls[0][0] == calls[1][0] <= DEFAULT_TOP_K  # the same candidates, at most k
    assert Plan.from_json(str(tmp_path / "cli.json")) == best.plan


def test_where_the_split_changes_the_ranking_planless_training_and_the_cli_choose_the_same_better_plan(tmp_path):
    """llama3-70b at 4096 tokens, global batch 16 in microbatches of 1, on 4 x 8 H100 + 2 x 8 MI300X (catalog
    costs): the search's best, split per stage and predicted again, is slower than another of its top
    ``DEFAULT_TOP_K`` split the same way (found by trying the example two-group clusters, 2026-12-03). Keeping
    only the top 1 (plan-less training before session 17) chose the slower plan; now plan-less training, its
    full set-up included, and the plan CLI at its default ``--top`` write the same, faster plan."""
    from hethub_jax.plan import main as plan_main
    from hethub_jax.planner import load_cluster, load_model, search
    from hethub_jax.planner.runnable import runnable_result
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"name": "two-groups", "groups": [
        {"name": "b", "device": "H100-SXM", "nodes": 4}, {"name": "a", "device": "MI300X", "nodes": 2}]}))
    cfg, c = load_model("llama3-70b"), load_cluster(str(cluster))
    costs = tp.cluster_costs(c, {"a": None, "b": None})
    ranked = {}
    for k in (1, DEFAULT_TOP_K):
        opt = SearchOptions(top_k=k, microbatch_sizes=(1,))
        searched = search(cfg, c, 16, 4096, costs=costs, options=opt)
        ranked[k] = (searched, runnable_result(searched, cfg, c, 4096, costs=costs, options=opt))
    top1, topk = ranked[1][1].best, ranked[DEFAULT_TOP_K][1].best
    assert topk.step_time_s < top1.step_time_s * (1 - 1e-3)  # not a tie: the split changed the ranking
    first = ranked[DEFAULT_TOP_K][0].candidates[0]  # the search's best as searched
    assert topk.searched is not None and topk.searched.plan != first.plan
    assert top1.searched is not None and top1.searched.plan == first.plan
    path, pred, _ = tp.plan_from_cluster(cfg, "llama3-70b", str(cluster), global_batch=16, seq_len=4096,
                                         microbatch_size=1, profiles_dir=str(tmp_path / "prof"),
                                         out_dir=str(tmp_path / "run"), log=lambda m: None)
    assert Plan.from_json(path) == topk.plan
    assert pred.prediction.step_time_s == pytest.approx(topk.step_time_s, rel=1e-12)
    assert plan_main(["--model", "llama3-70b", "--cluster", str(cluster), "--global-batch", "16", "--seq-len",
                      "4096", "--microbatch-sizes", "1", "--no-upper-bound", "--out", str(tmp_path / "cli.json")]) == 0
    assert Plan.from_json(str(tmp_path / "cli.json")) == topk.plan


# ---- the saved bridge all-reduce line --------------------------------------------------------------------

def test_saved_bridge_line_reaches_every_groups_costs_in_the_cli_and_planless_training(tmp_path, capsys):
    from hethub_jax.plan import main as plan_main
    from hethub_jax.planner import load_cluster
    from hethub_jax.planner.search import group_costs
    prof = tmp_path / "prof"
    _write_bridge_file(prof, 3e-4, 2e-9)
    (prof / "cpu.json").write_text(json.dumps(_fixed_profile()))
    c = load_cluster(str(TINY2))
    n = 8.2e6
    for costs in (group_costs(c, 0.4, str(prof)),
                  tp.cluster_costs(c, {"fast": _fixed_profile(), "slow": None}, {"c0": 3e-4, "c1": 2e-9})):
        assert set(costs) == {"fast", "slow"}
        assert all(x.bridge_allreduce_s(n) == pytest.approx(3e-4 + 2e-9 * n) for x in costs.values())
    assert all(x.bridge_allreduce_s(n) is None for x in group_costs(c, 0.4, None).values())
    assert plan_main(["--model", "tiny", "--cluster", str(TINY2), "--global-batch", "8", "--seq-len", "16",
                      "--profiles", str(prof), "--no-upper-bound", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "bridge all-reduce between islands: MEASURED alpha 0.0003 s, beta 2e-09 s/byte" in out


def test_a_bridge_file_that_does_not_read_is_an_error_naming_it(tmp_path):
    assert read_bridge_allreduce(None) is None and read_bridge_allreduce(str(tmp_path)) is None
    f = tmp_path / BRIDGE_ALLREDUCE_FILE
    for bad in ("{", json.dumps({"format": "x", "fit": {"c0": 1, "c1": 1}}),
                json.dumps({"format": BRIDGE_ALLREDUCE_FORMAT, "fit": {"c0": 1e-4, "c1": -1.0}}),
                json.dumps({"format": BRIDGE_ALLREDUCE_FORMAT, "fit": {"c0": "a", "c1": 0.0}})):
        f.write_text(bad)
        with pytest.raises(ValueError, match=r"bridge_allreduce\.json.*delete it"):
            read_bridge_allreduce(str(tmp_path))
    f.write_text(json.dumps({"format": BRIDGE_ALLREDUCE_FORMAT, "fit": {"c0": 1e-4, "c1": 0.0}}))
    assert read_bridge_allreduce(str(tmp_path))["fit"] == {"c0": 1e-4, "c1": 0.0}


def test_bridge_step_without_mpi_says_where_the_figure_comes_from(tmp_path):
    """One process: no measurement; a saved file is reused (and said so), profiles carrying the fit are used,
    else the catalog default; a job of more than 2 ranks is not measured either (said why)."""
    none = {"profiles": {"fast": _fixed_profile(), "slow": None}, "notes": [], "bridge_saved": None}
    r = tp.bridge_allreduce_step(none, str(tmp_path))
    assert r["fit"] is None and r["save"] is None and r["line"].startswith("catalog default")
    assert "one process" in r["line"]
    r = tp.bridge_allreduce_step(none, str(tmp_path), rank=0, world_size=3)
    assert r["line"].startswith("catalog default") and "this job has 3" in r["line"]
    with_fit = dict(_fixed_profile())
    with_fit["fits"] = dict(with_fit["fits"], bridge_allreduce={"c0": 5e-5, "c1": 1e-9})
    r = tp.bridge_allreduce_step({**none, "profiles": {"fast": with_fit, "slow": with_fit}}, str(tmp_path),
                                 world_size=2)  # no measurement: the profiles' fits are reused
    assert r["fit"] is None and r["line"].startswith("MEASURED alpha 5e-05 s, beta 1e-09 s/byte")
    saved = dict(_write_bridge_file(tmp_path, 3e-4, 2e-9), path=str(tmp_path / BRIDGE_ALLREDUCE_FILE))
    r = tp.bridge_allreduce_step({**none, "bridge_saved": saved}, str(tmp_path), world_size=2)
    assert r["fit"] == {"c0": 3e-4, "c1": 2e-9} and r["save"] is None
    assert r["line"].startswith("MEASURED alpha 0.0003 s, beta 2e-09 s/byte, reused from") and "h0, h1" in r["line"]


def test_planless_planning_reuses_the_saved_fit_and_its_prediction_uses_it(tmp_path):
    """A saved bridge file beside reused profiles (single process): the prediction's costs carry its line,
    the PREDICTED step equals ``predict`` of the written plan with every island's costs given that line (by
    hand), the banner says MEASURED, and the plan CLI with the same --profiles writes the same plan."""
    from hethub_jax.plan import main as plan_main
    from hethub_jax.planner import load_cluster, load_model
    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search import bridge_for
    prof = tmp_path / "prof"
    _write_bridge_file(prof, 2e-3, 5e-9)  # a slow bridge: its all-reduce weighs in the step
    (prof / "cpu.json").write_text(json.dumps(_fixed_profile()))
    cfg = load_model(MODEL)
    path, pred, lines = tp.plan_from_cluster(cfg, "tiny", str(TINY2), global_batch=4, seq_len=16,
                                             microbatch_size=None, profiles_dir=str(prof),
                                             out_dir=str(tmp_path / "run"), log=lambda m: None)
    plan = Plan.from_json(path)
    assert all(c.bridge_allreduce_s(1e6) == pytest.approx(2e-3 + 5e-9 * 1e6) for c in pred.costs.values())
    base = DeviceCosts.from_profile(_fixed_profile()).with_bridge_allreduce({"c0": 2e-3, "c1": 5e-9})
    names = [i.name for i in plan.islands]
    ref = predict(cfg, plan, {n: base for n in names}, seq_len=16, bridge=bridge_for(load_cluster(str(TINY2)),
                                                                                      [tuple(names)] if len(names) == 2 else []))
    assert pred.prediction.step_time_s == pytest.approx(ref.step_time_s, rel=1e-12)
    assert pred.bridge_allreduce.startswith("MEASURED alpha 0.002 s, beta 5e-09 s/byte, reused from")
    assert any("gradient all-reduce between islands (bridge): MEASURED" in x for x in pred.banner())
    assert pred.summary()["bridge_allreduce_source"] == pred.bridge_allreduce
    model_file = tmp_path / "run" / "model.json"  # the model as plan-less training wrote it for the plan CLI
    assert plan_main(["--model", str(model_file), "--cluster", str(TINY2), "--global-batch", "4", "--seq-len", "16",
                      "--profiles", str(prof), "--no-upper-bound", "--out", str(tmp_path / "cli.json")]) == 0
    assert Plan.from_json(str(tmp_path / "cli.json")) == plan


def test_a_measurement_that_cannot_be_saved_is_used_and_said_so(tmp_path, monkeypatch):
    """Rank 0 plans with a fresh measurement (``bridge_allreduce_step``'s result, given as under MPI) when the
    profiles folder cannot take the file: no planning error, the line says NOT saved."""
    from hethub_jax.planner import load_model

    def refuse(profiles_dir, save):
        raise PermissionError(13, "Permission denied", str(tmp_path / "prof" / BRIDGE_ALLREDUCE_FILE))
    monkeypatch.setattr(tp, "_save_bridge_allreduce", refuse)
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "cpu.json").write_text(json.dumps(_fixed_profile()))
    fit = {"c0": 1e-4, "c1": 1e-9}
    bridge = {"fit": fit, "save": {"fit": fit, "samples": []},
              "line": f"MEASURED alpha 0.0001 s, beta 1e-09 s/byte on this job's ranks (ranks 0 and 1 on h: ...; "
                      f"saved to {tmp_path / 'prof' / BRIDGE_ALLREDUCE_FILE})"}
    msg = tp._plan_rank0(load_model(MODEL), "tiny", str(TINY2), 4, 16, None, str(tmp_path / "prof"), lambda m: None,
                         bridge=bridge)
    assert msg["bridge_fit"] == fit
    assert msg["bridge_line"].startswith("MEASURED alpha 0.0001 s") and "NOT saved: [Errno 13]" in msg["bridge_line"]
    assert "saved to" not in msg["bridge_line"]


# ---- under mpiexec -n 2: the measurement on the job's own ranks ------------------------------------------

_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    sys.path.insert(0, {tests!r})
    from hethub_jax import train_predict as tp
    from hethub_jax.cluster import SetUpFailed
    from hethub_jax.planner import load_model
    mode, tmp = sys.argv[1], sys.argv[2]
    if mode == "fail_fit" and rank == 1:  # fails after the measurement: both ranks reach the agreement point
        import hethub_jax.profile as pr
        def boom(samples):
            raise RuntimeError("injected fit failure on rank 1")
        pr.fit_bridge_allreduce = boom
    if mode == "fail_start" and rank == 1:  # fails before it: rank 0 waits in the measurement's MPI calls
        import hethub_jax.profile as pr
        def boom(sizes, repeats, spin_s=0.05):
            raise RuntimeError("injected measurement failure on rank 1")
        pr.measure_bridge_allreduce = boom
    out = {{}}
    for i in range(2 if mode == "ok" else 1):  # the second planning reuses the saved fit
        try:
            path, pred, lines = tp.plan_from_cluster(
                load_model({model!r}), "tiny", {cluster!r}, global_batch=4, seq_len=16, microbatch_size=None,
                profiles_dir=os.path.join(tmp, "prof"), out_dir=os.path.join(tmp, "run"), rank=rank, world_size=2,
                log=print if rank == 0 else (lambda m: None), timeout_s=float(sys.argv[3]))
        except SetUpFailed as e:
            out["failed"] = {{str(k): v for k, v in e.failed.items()}}
            break
        c = next(iter(pred.costs.values())).bridge_allreduce_fit
        out[str(i)] = {{"line": pred.bridge_allreduce, "c0": c.c0, "c1": c.c1, "plan": open(path).read(),
                       "step": pred.prediction.step_time_s}}
    with open(os.path.join(tmp, f"rank{{rank}}.json"), "w") as f:
        json.dump(out, f)
""")


def _run_script(tmp_path, mode, timeout_s=60.0, limit=300):
    pytest.importorskip("mpi4py")
    from test_comm_contract import run_mpi
    (tmp_path / "prof").mkdir(exist_ok=True)
    (tmp_path / "prof" / "cpu.json").write_text(json.dumps(_fixed_profile()))
    script = tmp_path / "s.py"
    script.write_text(_SCRIPT.format(tests=str(Path(__file__).parent), model=MODEL, cluster=str(TINY2)))
    return run_mpi([str(script), mode, str(tmp_path), str(timeout_s)], n=2, timeout=limit,
                   env={"JAX_PLATFORMS": "cpu"})


@pytest.mark.mpi
def test_two_rank_job_measures_the_bridge_allreduce_on_its_ranks_saves_and_reuses_it(tmp_path):
    from hethub_jax.planner import load_cluster, load_model
    from hethub_jax.planner.predictor import predict
    from hethub_jax.planner.search import bridge_for
    from hethub_jax.profile import BRIDGE_ALLREDUCE_SIZES, fit_bridge_allreduce
    proc = _run_script(tmp_path, "ok")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1  # the same fit, line and plan on both ranks
    first, again = r0["0"], r0["1"]
    assert first["line"].startswith("MEASURED alpha") and "s/byte on this job's ranks" in first["line"]
    assert again["line"].startswith("MEASURED alpha") and "reused from" in again["line"]
    assert proc.stdout.count("measuring the bridge all-reduce between this job's 2 ranks") == 1  # rank 0, once
    saved = read_bridge_allreduce(str(tmp_path / "prof"))
    assert [s["bytes"] for s in saved["samples"]] == list(BRIDGE_ALLREDUCE_SIZES)
    assert all(s["seconds"] > 0 for s in saved["samples"]) and saved["ranks"] == 2 and len(saved["hosts"]) == 2
    ref = fit_bridge_allreduce(saved["samples"])  # the profiler's Hockney fit of the saved samples
    assert saved["fit"] == ref and ref["c0"] >= 0 and ref["c1"] >= 0
    assert (first["c0"], first["c1"]) == (again["c0"], again["c1"]) == (ref["c0"], ref["c1"])
    # the PREDICTED step of the written plan with every island's costs carrying the measured line (by hand)
    plan = Plan.from_dict(json.loads(first["plan"]))
    cost = DeviceCosts.from_profile(_fixed_profile()).with_bridge_allreduce(ref)
    names = [i.name for i in plan.islands]
    want = predict(load_model(MODEL), plan, {n: cost for n in names}, seq_len=16,
                   bridge=bridge_for(load_cluster(str(TINY2)), [tuple(names)] if len(names) == 2 else []))
    assert first["step"] == pytest.approx(want.step_time_s, rel=1e-12)


@pytest.mark.mpi
def test_a_failure_on_one_rank_ends_both_with_that_ranks_error(tmp_path):
    proc = _run_script(tmp_path, "fail_fit")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 and list(r0["failed"]) == ["1"] and "injected fit failure on rank 1" in r0["failed"]["1"]
    assert not (tmp_path / "prof" / BRIDGE_ALLREDUCE_FILE).exists()


@pytest.mark.mpi
def test_a_failure_while_the_other_rank_waits_in_mpi_ends_the_job_with_that_ranks_error(tmp_path):
    proc = _run_script(tmp_path, "fail_start", timeout_s=3.0, limit=120)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "[rank 1]" in err and "injected measurement failure on rank 1" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # rank 0 waits in the measurement until the abort ends it
    assert not (tmp_path / "prof" / BRIDGE_ALLREDUCE_FILE).exists()
