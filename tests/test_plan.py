"""Pure-Python tests of the plan format, its validation and the batch-share split (no JAX)."""
import copy
import itertools
import json
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from hethub_jax.parallel.plan import Plan, ReplicaSpec, StageSpec, proportional_shares
from hethub_jax.parallel.schedule import validate_schedule

PLANS = Path(__file__).resolve().parents[1] / "configs" / "plans"
# stub of the tiny preset's shape: 6 layers, 4 attention heads, 2 KV heads
TINY = SimpleNamespace(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)

BASE = {
    "islands": [
        {"name": "fast", "platform": "cpu", "num_processes": 1, "devices_per_process": 2, "slowdown": 1.0},
        {"name": "slow", "platform": "cpu", "num_processes": 1, "devices_per_process": 1, "slowdown": 3.0},
    ],
    "replicas": [{"stages": [
        {"island": "fast", "dp": 1, "tp": 2, "first_layer": 0, "last_layer": 4},
        {"island": "slow", "dp": 1, "tp": 1, "first_layer": 5, "last_layer": 5}],
        "batch_share": None, "throughput": None}],
    "global_batch_size": 8,
    "microbatch_size": 2,
    "schedule": "1f1b",
    "recompute": "none",
}


def base():
    return copy.deepcopy(BASE)


def stages(d):
    return d["replicas"][0]["stages"]


def two_replicas(d, **kw):
    """Two one-stage replicas, one per island (heterogeneous DP)."""
    d["replicas"] = [
        {"stages": [{"island": "fast", "dp": 1, "tp": 1, "first_layer": 0, "last_layer": 5}], **kw.get("r0", {})},
        {"stages": [{"island": "slow", "dp": 1, "tp": 1, "first_layer": 0, "last_layer": 5}], **kw.get("r1", {})}]
    return d


def check(d, match, cfg=TINY):
    with pytest.raises(ValueError, match=match):
        Plan.from_dict(d).validate(cfg)


def test_base_plan_and_helpers():
    p = Plan.from_dict(base()).validate(TINY)
    s0, s1 = p.replicas[0].stages
    assert (s0.num_layers, s1.num_layers) == (5, 1)
    assert (s0.is_first, s0.is_last, s1.is_first, s1.is_last) == (True, False, False, True)
    assert s0.num_devices == 2 and s1.num_devices == 1
    assert p.stage_devices(0, 0) == [0, 1] and p.stage_devices(0, 1) == [0]
    assert p.num_microbatches(0) == 4 and p.batch_shares() == [8]
    assert p.world_size == 2 and p.island_ranks("fast") == range(0, 1) and p.island_ranks("slow") == range(1, 2)
    assert p.rank_island(1).name == "slow" and p.rank_stages(1) == [(0, 1)] and p.process_index(1) == 0
    validate_schedule(p.actions(0))
    assert len(p.actions(0)) == 2


def test_json_round_trip(tmp_path):
    d = base()
    stages(d)[1]["devices"] = [0]
    p = Plan.from_dict(d)
    assert Plan.from_json(p.to_json()) == p
    path = tmp_path / "p.json"
    p.to_json(path)
    assert Plan.from_json(path) == p and Plan.from_json(str(path)) == p
    assert json.loads(path.read_text()) == p.to_dict()
    # shorthand "stages" is one replica and saves in the canonical "replicas" form
    short = {k: v for k, v in base().items() if k != "replicas"}
    short["stages"] = stages(base())
    assert Plan.from_dict(short) == Plan.from_dict(base())
    assert "replicas" in Plan.from_dict(short).to_dict()


def test_rank_layout_multi_process():
    d = base()
    d["islands"][0].update(num_processes=2, devices_per_process=2)
    d["islands"][1].update(num_processes=3)
    p = Plan.from_dict(d).validate(TINY)
    assert p.world_size == 5
    assert list(p.island_ranks("fast")) == [0, 1] and list(p.island_ranks("slow")) == [2, 3, 4]
    assert [p.rank_island(r).name for r in range(5)] == ["fast", "fast", "slow", "slow", "slow"]
    assert p.process_index(3) == 1 and p.rank_stages(3) == [(0, 1)]
    with pytest.raises(ValueError, match="out of range"):
        p.rank_island(5)


def test_sequential_device_assignment():
    d = base()
    d["islands"][0]["devices_per_process"] = 4
    stages(d)[:1] = [{"island": "fast", "dp": 1, "tp": 2, "first_layer": 0, "last_layer": 2},
                     {"island": "fast", "dp": 2, "tp": 1, "first_layer": 3, "last_layer": 4}]
    p = Plan.from_dict(d).validate(TINY)
    assert [p.stage_devices(0, s) for s in range(3)] == [[0, 1], [2, 3], [0]]


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(bogus=1), "unknown key 'bogus' in plan"),
    (lambda d: d["islands"][0].update(gpus=2), r"unknown key 'gpus' in islands\[0\]"),
    (lambda d: stages(d)[1].update(layers=2), r"unknown key 'layers' in replicas\[0\].stages\[1\]"),
    (lambda d: d["replicas"][0].update(share=2), r"unknown key 'share' in replicas\[0\]"),
    (lambda d: stages(d)[0].pop("island"), r"missing key 'island' in replicas\[0\].stages\[0\]"),
    (lambda d: stages(d)[0].update(dp="1"), r"replicas\[0\].stages\[0\].dp must be an integer"),
    (lambda d: d.update(stages=[]), "exactly one of 'replicas'"),
])
def test_load_errors(mutate, match):
    d = base()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        Plan.from_dict(d)


@pytest.mark.parametrize("mutate,match", [
    # layer coverage
    (lambda d: stages(d)[1].update(first_layer=6, last_layer=6), r"cover layers 0\.\.5 exactly once.*starts at layer 6, expected 5 \(gap\)"),
    (lambda d: stages(d)[1].update(first_layer=4), r"cover layers 0\.\.5 exactly once.*starts at layer 4, expected 5 \(overlap\)"),
    (lambda d: stages(d)[0].update(first_layer=1), r"cover layers.*starts at layer 1, expected 0"),
    (lambda d: stages(d)[1].update(last_layer=4), r"no empty stage.*first_layer 5 > last_layer 4"),
    (lambda d: stages(d).pop(), r"cover layers 0\.\.5.*ends at layer 4, the model has 6 layers"),
    (lambda d: stages(d).reverse(), r"cover layers.*in order"),
    (lambda d: d["replicas"][0].update(stages=[]), r"replicas\[0\] has no stages"),
    (lambda d: d.update(replicas=[]), "at least one replica"),
    # islands and stages
    (lambda d: stages(d)[1].update(island="gpu"), r"stage island must exist.*'gpu'"),
    (lambda d: d["islands"].append({"name": "idle", "platform": "cpu"}), "every island must run a stage.*'idle'"),
    (lambda d: d["islands"].append(dict(d["islands"][0])), "island names must be unique.*'fast'"),
    (lambda d: d["islands"][1].update(num_processes=0), "num_processes and devices_per_process must be >= 1"),
    (lambda d: stages(d)[0].update(dp=0), r"dp and tp must be >= 1.*dp=0"),
    (lambda d: stages(d)[1].update(tp=-1), r"dp and tp must be >= 1.*tp=-1"),
    (lambda d: d["islands"][1].update(slowdown=0.5), "slowdown must be >= 1.*0.5"),
    (lambda d: d["islands"][1].update(platform="cuda"), "applies only to platform 'cpu'.*'cuda'.*3.0"),
    # devices
    (lambda d: stages(d)[1].update(tp=2), r"devices requested must exist.*dp\*tp = 1\*2 = 2 devices but island 'slow' has 1"),
    (lambda d: stages(d)[1].update(devices=[1]), r"devices requested must exist.*indices \[1\] outside 0\.\.0"),
    (lambda d: stages(d)[0].update(devices=[0]), r"devices lists 1 devices but dp\*tp = 2"),
    (lambda d: stages(d)[0].update(devices=[1, 1]), "lists a device twice"),
    # TP vs heads
    (lambda d: (d["islands"][0].update(devices_per_process=3), stages(d)[0].update(tp=3)),
        r"TP degree must divide the number of attention heads.*tp=3.*4 heads"),
    # schedule, recompute
    (lambda d: d.update(schedule="zb"), r"schedule must be one of \['gpipe', '1f1b'\].*'zb'"),
    (lambda d: d.update(recompute="some"), r"recompute must be one of \['none', 'full'\].*'some'"),
    # batch
    (lambda d: d.update(global_batch_size=7), r"global_batch_size must be divisible by microbatch_size: 7 % 2"),
    (lambda d: d.update(microbatch_size=0), "global_batch_size and microbatch_size must be >= 1"),
    (lambda d: (d["islands"][0].update(devices_per_process=4), stages(d)[0].update(dp=4, tp=1)),
        r"microbatch_size must be divisible by each stage's dp: microbatch_size 2.*dp=4"),
])
def test_validation_rules(mutate, match):
    d = base()
    mutate(d)
    check(d, match)


def test_running_out_of_devices_sequentially():
    d = base()  # fast has 2 devices: stage 0 takes both, an extra stage on fast has none left
    stages(d)[0].update(last_layer=3)
    stages(d).insert(1, {"island": "fast", "dp": 1, "tp": 1, "first_layer": 4, "last_layer": 4})
    check(d, r"devices requested must exist.*island 'fast' has 2 devices; stages before replicas\[0\].stages\[1\] took 2")
    stages(d)[1]["devices"] = [0]  # explicit lists may overlap (single-process tests)
    assert Plan.from_dict(d).validate(TINY).stage_devices(0, 1) == [0]


def test_kv_heads_rule():
    d = base()
    d["islands"][0]["devices_per_process"] = 4
    stages(d)[0]["tp"] = 4
    Plan.from_dict(d).validate(TINY)  # 4 heads, 2 KV heads: tp 4 is a multiple of 2 -> KV replicated
    cfg = SimpleNamespace(num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=3)
    check(d, r"TP degree must divide the number of KV heads or be a multiple of it.*tp=4.*3 KV heads", cfg)
    cfg = SimpleNamespace(num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8)
    Plan.from_dict(d).validate(cfg)  # tp 4 divides 8 KV heads
    # num_key_value_heads None means plain multi-head attention
    Plan.from_dict(d).validate(SimpleNamespace(num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=None))


def test_validate_without_model_config():
    d = base()
    d["islands"][0]["devices_per_process"] = 3
    stages(d)[0]["tp"] = 3  # 3 does not divide 4 heads, but without a config heads are not checked
    Plan.from_dict(d).validate()
    check(d, "attention heads")


# ---- heterogeneous data parallelism -----------------------------------------------------------------

def test_hetero_shares_from_throughput():
    d = two_replicas(base(), r0={"throughput": 3.0}, r1={"throughput": 1})
    d.update(global_batch_size=10, microbatch_size=1)
    p = Plan.from_dict(d).validate(TINY)
    assert p.batch_shares() == [8, 2] and [p.num_microbatches(r) for r in (0, 1)] == [8, 2]
    d.update(microbatch_size=2)  # 5 microbatches at 3:1 -> (4, 1) microbatches -> (8, 2) samples
    assert Plan.from_dict(d).validate(TINY).batch_shares() == [8, 2]


def test_hetero_equal_and_given_shares():
    d = two_replicas(base())
    d.update(global_batch_size=10, microbatch_size=1)
    assert Plan.from_dict(d).validate(TINY).batch_shares() == [5, 5]
    d = two_replicas(base(), r0={"batch_share": 6}, r1={"batch_share": 2})
    assert Plan.from_dict(d).validate(TINY).batch_shares() == [6, 2]


@pytest.mark.parametrize("kw,gbs,mbs,match", [
    ({}, 1, 1, r"global batch smaller than the number of replicas: global_batch_size 1 < 2 replicas"),
    ({}, 2, 2, r"global batch smaller than the number of replicas in microbatches.*1 microbatches < 2"),
    ({"r0": {"batch_share": 6}, "r1": {"batch_share": 1}}, 8, 2, r"at least one microbatch.*replicas\[1\].*1 < microbatch_size 2"),
    ({"r0": {"batch_share": 3}, "r1": {"batch_share": 5}}, 8, 2, r"divisible by microbatch_size.*replicas\[0\] has batch_share 3"),
    ({"r0": {"batch_share": 4}, "r1": {"batch_share": 2}}, 8, 2, r"shares must sum to global_batch_size: \[4, 2\] sums to 6"),
    ({"r0": {"batch_share": 4}}, 8, 2, "batch_share must be given for all replicas or none"),
    ({"r0": {"throughput": 2.0}}, 8, 2, "throughput must be given for all replicas or none"),
    ({"r0": {"throughput": 2.0}, "r1": {"throughput": 0}}, 8, 2, r"throughput of replica 1 must be finite and > 0"),
])
def test_hetero_batch_rules(kw, gbs, mbs, match):
    d = two_replicas(base(), **kw)
    d.update(global_batch_size=gbs, microbatch_size=mbs)
    check(d, match)


# ---- proportional shares ------------------------------------------------------------------------------

def test_proportional_shares_examples():
    assert proportional_shares(10, [3, 1]) == [8, 2]  # slowest 8/3 < 3 of (7, 3)
    assert proportional_shares(10, [1, 3]) == [2, 8]
    assert proportional_shares(10, [1.0, 1.0]) == [5, 5]
    assert proportional_shares(3, [1, 1]) == [2, 1]  # tie: lower index
    assert proportional_shares(3, [1, 2, 100]) == [1, 1, 1]  # each at least one
    assert proportional_shares(1, [5]) == [1]
    with pytest.raises(ValueError, match="smaller than the number of replicas"):
        proportional_shares(1, [1, 1])
    with pytest.raises(ValueError, match="finite and > 0"):
        proportional_shares(4, [1, float("nan")])


def _best_max_time(units, thr):
    """Exhaustive search over all compositions of units into len(thr) parts >= 1."""
    n, best = len(thr), None
    for cuts in itertools.combinations(range(1, units), n - 1):
        parts = [b - a for a, b in zip((0,) + cuts, cuts + (units,))]
        t = max(Fraction(p) / Fraction(x) for p, x in zip(parts, thr))
        best = t if best is None or t < best else best
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(1, 6), st.floats(0.1, 10.0)), min_size=1, max_size=4), st.integers(0, 9))
def test_proportional_shares_is_optimal(thr, extra):
    units = len(thr) + extra
    shares = proportional_shares(units, thr)
    assert len(shares) == len(thr) and sum(shares) == units and min(shares) >= 1
    got = max(Fraction(s) / Fraction(x) for s, x in zip(shares, thr))
    assert got == _best_max_time(units, thr)
    assert proportional_shares(units, thr) == shares  # deterministic


# ---- example plans --------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(PLANS.glob("*.json")), ids=lambda p: p.stem)
def test_example_plans_validate(path):
    p = Plan.from_json(path).validate(TINY)
    assert Plan.from_json(p.to_json()) == p
    assert sum(p.batch_shares()) == p.global_batch_size
    for r in range(p.num_replicas):
        validate_schedule(p.actions(r))


def test_example_plan_contents():
    p = Plan.from_json(PLANS / "tiny_2island.json")
    assert [s.num_layers for s in p.replicas[0].stages] == [2, 4]  # non-uniform split
    assert p.island("slow").slowdown == 3.0
    h = Plan.from_json(PLANS / "tiny_hetero_dp.json")
    assert h.num_replicas == 2 and h.global_batch_size == 10 and h.batch_shares() == [8, 2]
    m = Plan.from_json(PLANS / "tiny_hetero_dp_measured.json")  # shares measured at start-up
    assert m.num_replicas == 2 and m.island("slow").slowdown == 3.0
    assert all(r.batch_share is None and r.throughput is None for r in m.replicas)


def test_dataclasses_are_frozen_and_positions_set():
    p = Plan.from_dict(base())
    with pytest.raises(Exception):
        p.global_batch_size = 3
    rep = ReplicaSpec(stages=[StageSpec(island="a", dp=1, tp=1, first_layer=0, last_layer=1),
                             StageSpec(island="a", dp=1, tp=1, first_layer=2, last_layer=3)])
    assert [(s.index, s.is_first, s.is_last) for s in rep.stages] == [(0, True, False), (1, False, True)]


PURE_PYTHON_MODULES = ("hethub_jax", "hethub_jax.models", "hethub_jax.models.config", "hethub_jax.typed",
                       "hethub_jax.parallel", "hethub_jax.parallel.plan", "hethub_jax.parallel.rules",
                       "hethub_jax.parallel.schedule", "hethub_jax.parallel.trace", "hethub_jax.planner",
                       "hethub_jax.planner.simulator", "hethub_jax.parallel.exchange", "hethub_jax.rank_guard",
                       "hethub_jax.parallel.split", "hethub_jax.planner.runnable")
BLOCKED = ("jax", "jaxlib", "flax", "optax", "orbax", "mpi4py")


def test_pure_python_modules_do_not_import_jax():
    """The plan, schedule, trace, model config and planner import (and work) with JAX, flax, optax,
    orbax and mpi4py absent: a meta-path finder makes importing any of them fail."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent(f"""
        import importlib, sys
        BLOCKED = {BLOCKED!r}
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is blocked in this test")
        sys.meta_path.insert(0, Block())
        try:
            import jax
        except ImportError:
            pass
        else:
            raise SystemExit("the blocker does not work")
        for m in {PURE_PYTHON_MODULES!r}:
            importlib.import_module(m)
        from hethub_jax.models.config import get_preset
        from hethub_jax.parallel.plan import Plan
        plan = Plan.from_json({str(PLANS / "tiny_2island.json")!r}).validate(get_preset("tiny"))
        plan.actions(0)
        loaded = [m for m in sys.modules if m.split(".")[0] in BLOCKED]
        assert not loaded, loaded
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_fmt_bytes_binary_labelled_units():
    from hethub_jax.plan import fmt_bytes
    assert fmt_bytes(47 * 2**20) == "47.0 MiB" and fmt_bytes(1.5 * 2**30) == "1.50 GiB"
    assert fmt_bytes(2**30 - 1) == "1024.0 MiB" and fmt_bytes(80 * 10**9) == "74.51 GiB"
