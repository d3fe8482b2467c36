"""`python -m hethub_jax.train --plan` on heterogeneous data-parallel plans, end to end in one process.

Without mpiexec every island of the plan runs in this process (docs/training.md). The plans derive from
the examples in configs/plans/, shrunk to a 2-layer, 32-wide model; 2 steps of 16-token samples.
Checked: the batch shares in use are printed at start and recorded in the metrics file (`batch_shares`,
`batch_shares_source`); throughputs 3:1 give the speed-proportional shares; a plan with neither shares
nor throughputs takes them from the warm-up measurement; an emulated slowdown is printed (EMULATED)
and recorded (`emulation.active`, `emulated` on every step record).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hethub_jax.parallel.plan import Plan, balanced_shares, keeps_bucketed_allreduce, proportional_shares
from hethub_jax.train import main

PLANS = Path(__file__).resolve().parents[1] / "configs" / "plans"
LAYERS = 2
CONFIG = f"""
model: {{preset: tiny, hidden_size: 32, intermediate_size: 64, num_hidden_layers: {LAYERS},
        num_attention_heads: 2, num_key_value_heads: 1}}
data: {{seq_len: 16}}
optim: {{warmup_steps: 0}}
train: {{steps: 2, eval_every: 100, eval_at_start: false, eval_batches: 1, log_every: 0}}
"""


def shrunk_plan(tmp_path: Path, example: str, **island_slowdowns: float) -> tuple[Path, dict]:
    """The example plan with every stage cut to the test model's LAYERS layers (and the given island
    slowdowns), written to tmp_path. Its description (printed at start) is replaced: the examples'
    descriptions mention EMULATED."""
    d = json.loads((PLANS / f"{example}.json").read_text())
    d["description"] = f"{example}, shrunk to {LAYERS} layers"
    for rep in d["replicas"]:
        assert len(rep["stages"]) == 1
        rep["stages"][0]["last_layer"] = LAYERS - 1
    for isl in d["islands"]:
        isl["slowdown"] = island_slowdowns.get(isl["name"], isl.get("slowdown", 1.0))
    path = tmp_path / f"{example}.json"
    path.write_text(json.dumps(d))
    return path, d


def run(tmp_path: Path, plan_path: Path, capsys) -> tuple[str, list[dict]]:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    metrics = tmp_path / "m.jsonl"
    rc = main(["--config", str(cfg), "--plan", str(plan_path), "--metrics-file", str(metrics),
               "--no-checkpoint", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    return out, [json.loads(line) for line in metrics.read_text().splitlines()]


def banner_shares(out: str) -> list[int]:
    """The per-replica batch shares of the start-up banner's plan summary."""
    found = re.findall(r"^  replica (\d+): \d+ stage\(s\), batch share (\d+) samples = (\d+) microbatch",
                       out, flags=re.M)
    assert [int(r) for r, _, _ in found] == list(range(len(found))), out
    return [int(s) for _, s, _ in found]


@pytest.mark.parametrize("slowdown", [3.0, 1.0], ids=["emulated", "not-emulated"])
def test_throughputs_3_to_1_give_proportional_shares(tmp_path, capsys, slowdown):
    # configs/plans/tiny_hetero_dp.json: throughputs 3:1, island slow EMULATED 3x (or not emulated)
    path, d = shrunk_plan(tmp_path, "tiny_hetero_dp", slow=slowdown)
    gbs, mbs = d["global_batch_size"], d["microbatch_size"]
    want = [u * mbs for u in proportional_shares(gbs // mbs, [r["throughput"] for r in d["replicas"]])]
    assert want != [gbs // 2, gbs // 2]  # the check tells speed-proportional from equal shares
    out, recs = run(tmp_path, path, capsys)

    assert banner_shares(out) == want                                   # (a) printed at start
    assert "measuring replica throughputs" not in out                   # the plan's throughputs
    run_rec = recs[0]
    assert run_rec["kind"] == "run"
    assert run_rec["batch_shares"] == want and run_rec["batch_shares_source"] == "plan"  # (b), (c)
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2] and recs[-1]["status"] == "ok"
    emu = run_rec["emulation"]
    assert emu["slowdown"] == {"fast": 1.0, "slow": slowdown}
    if slowdown > 1:  # (e) emulation: printed, recorded in the run record, every step record marked
        assert re.search(r"island slow: .*EMULATED 3x", out), out
        assert "EMULATED: step times and tokens/s include the emulated slowdown waits" in out
        assert emu["active"] is True
        assert len(emu["lines"]) == 1 and "island slow: EMULATED 3x" in emu["lines"][0]
        assert all(r.get("emulated") is True for r in steps) and recs[-1]["emulated"] is True
    else:
        assert "EMULATED" not in out and emu["active"] is False and emu["lines"] == []
        assert not any("emulated" in r for r in steps) and recs[-1]["emulated"] is False


def test_plan_without_shares_or_throughputs_measures_them_in_a_warm_up(tmp_path, capsys):
    # configs/plans/tiny_hetero_dp_measured.json, island slow EMULATED 8x slower instead of 3x: a wide
    # margin over timing noise on a shared machine, so that the measured shares are not the equal ones.
    path, d = shrunk_plan(tmp_path, "tiny_hetero_dp_measured", slow=8.0)
    assert all(r["batch_share"] is None and r["throughput"] is None for r in d["replicas"])
    gbs, mbs = d["global_batch_size"], d["microbatch_size"]
    out, recs = run(tmp_path, path, capsys)

    assert "heterogeneous DP: measuring replica step costs in a warm-up" in out
    run_rec = recs[0]
    shares, source = run_rec["batch_shares"], run_rec["batch_shares_source"]
    num = r"[\d.e+-]+"
    assert re.fullmatch(f"warm-up: replica 0 {num} samples/s \\+ {num} s/step fixed, "
                        f"replica 1 {num} samples/s \\+ {num} s/step fixed", source), source
    assert len(shares) == 2 and sum(shares) == gbs and all(s >= mbs and s % mbs == 0 for s in shares), shares
    # the measured costs (seconds per sample, fixed seconds per step: the update) give these shares,
    # and they are the ones printed and used
    thr = [float(x) for x in re.findall(rf"replica \d+ ({num}) samples/s", source)]
    fixed = [float(x) for x in re.findall(rf"({num}) s/step fixed", source)]
    assert shares == [u * mbs for u in balanced_shares(gbs // mbs, [mbs / t for t in thr], fixed)]
    # the plan's update is sharded over the replicas (optimizer_sharding "auto" -> ZeRO-1): each updates
    # a share of the parameters that follows its batch share, so the update is counted per sample and
    # no fixed cost is left (with "replicated", the update on the EMULATED 8x slower island is a larger
    # fixed cost: `measure_step_costs`)
    assert Plan.from_json(path).sharded_update() and fixed == [0.0, 0.0], fixed
    assert shares[0] > shares[1], (shares, thr)  # the emulated-slow replica gets the smaller share
    assert f"-> batch shares {shares}" in out and banner_shares(out) == shares
    assert "(EMULATED slowdowns included)" in out and run_rec["emulation"]["active"] is True
    # train.grad_bucket_mb auto (default): both all-reduce paths timed after the shares, the faster kept
    # (plan.keeps_bucketed_allreduce), printed with both MEASURED seconds and recorded
    c = run_rec["grad_allreduce"]
    assert c["path"] == ("bucketed" if keeps_bucketed_allreduce(c["bucketed_s"], c["unbucketed_s"]) else "unbucketed")
    m = re.search(rf"MEASURED step forward/backward \+ all-reduce: bucketed \(25 MiB\) ({num}) s, after the backward "
                  rf"({num}) s \(fastest of 3, EMULATED slowdowns included\) -> keeps the (\w+)", out)
    assert m and m.group(3) == c["path"], out
    assert ("NOT bucketed" in out) == (c["path"] == "unbucketed") and "MEASURED" in out.split("gradient all-reduce across")[1]
    assert recs[-1]["status"] == "ok"
