"""Every parallel configuration equals the unsplit single-device run (DESIGN.md section 6).

Reference: `hethub_jax.reference.ReferenceTrainer` (whole model, one device, whole batch, optax
clipping). Compared: the loss of every step, the gradients of the first batch, and the parameters
after 3 optimizer steps (float32, relative 1e-5 per tensor).
"""

import time
import types

import numpy as np
import pytest

from hethub_jax.models.config import LlamaConfig
from hethub_jax.optim import OptimConfig
from hethub_jax.parallel.plan import Plan
import hethub_jax.parallel.runtime as runtime_mod
from hethub_jax.parallel.runtime import PipelineRuntime
from hethub_jax.reference import ReferenceTrainer

LAYERS = 11
# Adam's eps is far above float32 rounding of the gradients. The gradients match the reference to
# about 1e-7 of each tensor's largest entry; with the default eps=1e-8, Adam's update of an entry
# whose gradient is near zero (a component of order 1e-6 in a row of order 0.1) is lr * g / (|g| +
# eps), so rounding noise in g decides much of it: a 5 % (4e-8) difference in one 7.5e-7 entry of
# embed_tokens gave a parameter difference of 3e-5 relative after 3 steps (on an AMD EPYC VM; other
# CPUs round elsewhere). With eps=1e-3 that update moves by at most lr * noise / eps, about 40x
# inside RTOL, while every entry with |g| >> 1e-3 still gets Adam's normalised update.
OPTIM = OptimConfig(learning_rate=1e-3, warmup_steps=1, decay_steps=10, grad_clip_norm=1.0, eps=1e-3)
RTOL = 1e-5


def model_config(tied: bool) -> LlamaConfig:
    # GQA: 8 query heads, 2 KV heads (TP=2 splits KV heads, TP=4 would replicate them).
    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                       num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tied)


def batches(gbs: int, n: int = 4, seq: int = 16, seed: int = 0, padded: bool = False):
    """Random token batches. padded=False: pads at random places (mask 0 on a quarter of tokens);
    padded=True: right-padded rows of very different lengths (1..seq non-pad tokens), so a plain
    average of per-replica mean losses would weight tokens very unequally."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = rng.integers(0, 128, (gbs, seq + 1)).astype(np.int32)
        if padded:
            lengths = np.where(np.arange(gbs) % 3 == 0, seq, 1 + np.arange(gbs) % 3)
            mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)
            t[:, 1:][mask == 0] = 0  # pad id
        else:
            mask = (rng.random((gbs, seq)) > 0.25).astype(np.float32)
        out.append({"tokens": t[:, :-1], "targets": t[:, 1:], "loss_mask": mask})
    return out


_REF_CACHE = {}


def reference(tied: bool, gbs: int, padded: bool = False):
    key = (tied, gbs, padded)
    if key not in _REF_CACHE:
        ref = ReferenceTrainer(model_config(tied), OPTIM, seed=7)
        data = batches(gbs, padded=padded)
        loss0, grads = ref.gradients(data[0])
        losses = [ref.train_step(b)[0] for b in data[:3]]
        _REF_CACHE[key] = dict(loss0=loss0, grads=grads, losses=losses, params=ref.flat_params())
    return _REF_CACHE[key]


def split_plan(split, *, islands=1, schedule="1f1b", recompute="none", gbs=8, mbs=2, dp_tp=None):
    """Stages of `split` layers; stage i on island i % islands; each stage on explicit devices."""
    isl = [{"name": f"i{j}", "platform": "cpu", "devices_per_process": 4} for j in range(islands)]
    stages, first = [], 0
    for i, n in enumerate(split):
        dp, tp = (dp_tp or {}).get(i, (1, 1))
        stages.append({"island": f"i{i % islands}", "dp": dp, "tp": tp, "first_layer": first,
                       "last_layer": first + n - 1, "devices": list(range(dp * tp))})
        first += n
    return Plan.from_dict({"islands": isl, "stages": stages, "global_batch_size": gbs,
                           "microbatch_size": mbs, "schedule": schedule, "recompute": recompute})


def assert_rel(got, want, what):
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
    assert err <= RTOL * scale, f"{what}: max abs error {err:.3g} > {RTOL} x {scale:.3g}"


def check_against_reference(plan, *, tied=False, debug_nan=False):
    cfg = model_config(tied)
    ref = reference(tied, plan.global_batch_size)
    data = batches(plan.global_batch_size)
    rt = PipelineRuntime(plan, cfg, OPTIM, seed=7, debug_nan=debug_nan)
    loss0, grads = rt.gradients(data[0])
    assert_rel(loss0, ref["loss0"], "loss of batch 0")
    assert set(grads) == set(ref["grads"])
    for name, g in ref["grads"].items():
        assert_rel(grads[name], g, f"gradient {name}")
    for step, b in enumerate(data[:3]):
        assert_rel(rt.train_step(b).loss, ref["losses"][step], f"loss at step {step}")
    params = rt.params()
    for name, p in ref["params"].items():
        assert_rel(params[name], p, f"parameter {name} after 3 steps")
    return rt


@pytest.mark.parametrize("split", [(5, 4, 2), (7, 3, 1)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_three_stage_splits_equal_unsplit(split, schedule):
    # 4 microbatches of 2; stages 0 and 2 on one island, stage 1 on another (host path between).
    check_against_reference(split_plan(split, islands=2, schedule=schedule))


@pytest.mark.parametrize("mbs, recompute", [(8, "full"), (1, "full"), (1, "none")])
def test_microbatch_counts_and_recompute(mbs, recompute):
    # 1 microbatch (every stage idle but one at a time) and 8 microbatches (more than stages).
    check_against_reference(split_plan((5, 4, 2), schedule="1f1b", recompute=recompute, mbs=mbs))


def test_dp2_tp2_stage_and_gqa_tp2():
    # Middle stage on a 2x2 (dp x tp) mesh of 4 devices, last stage TP=2 over 2 KV heads.
    plan = split_plan((4, 4, 3), dp_tp={1: (2, 2), 2: (1, 2)}, mbs=4)
    rt = check_against_reference(plan)
    mesh = rt.stages[(0, 1)].mesh
    assert dict(mesh.shape) == {"dp": 2, "tp": 2}
    q = rt.stages[(0, 1)].params["layers"][0]["self_attn"]["q_proj"]
    assert q.sharding.spec[1] == "tp"  # column-parallel: heads split over tp


def test_tied_embeddings_on_different_islands_stay_bitwise_equal():
    rt = check_against_reference(split_plan((6, 5), islands=2), tied=True)
    first, last = rt.stage_params((0, 0)), rt.stage_params((0, 1))
    np.testing.assert_array_equal(first["embed_tokens"], last["embed_tokens"])


def test_nan_filled_buffers_never_leak():
    # Gradient accumulators start as NaN; the first microbatch must overwrite, never add to them.
    check_against_reference(split_plan((5, 4, 2), islands=3, schedule="gpipe"), debug_nan=True)


def test_emulated_slowdown_is_labelled_and_slows_the_stage(monkeypatch):
    plan = Plan.from_dict({
        "islands": [{"name": "fast", "platform": "cpu"}, {"name": "slow", "platform": "cpu", "slowdown": 3.0}],
        "stages": [{"island": "fast", "first_layer": 0, "last_layer": 5},
                   {"island": "slow", "first_layer": 6, "last_layer": 10}],
        "global_batch_size": 4, "microbatch_size": 2, "schedule": "1f1b", "recompute": "none"})
    rt = PipelineRuntime(plan, model_config(False), OPTIM, seed=1)
    assert any("EMULATED 3x" in line and "slow" in line for line in rt.emulation_lines())
    data = batches(4)
    rt.train_step(data[0])  # compile
    # Record the emulation waits instead of timing them (timings on a shared 2-core machine are noise),
    # each with the runtime's last `time.perf_counter()` reading before it: the end of the compute that
    # `_emulate` measured (its bucket-thread CPU term is 0 here: no gradient buckets on a pipeline plan).
    last = [None]

    def perf_counter():
        last[0] = time.perf_counter()
        return last[0]

    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    clock.perf_counter = perf_counter
    monkeypatch.setattr(runtime_mod, "time", clock)
    waits = []
    monkeypatch.setattr(runtime_mod, "emulated_wait", lambda s: waits.append((s, last[0])))
    recs = rt.train_step(data[1]).records
    slow = [r for r in recs if r.island == "slow" and r.action[0] in "FB"]
    fast = [r for r in recs if r.island == "fast" and r.action[0] in "FB"]
    # one wait per compute action of the slow island, plus one for its optimizer update; none on the fast
    assert len(slow) == 4 and len(fast) == 4 and len(waits) == len(slow) + 1
    # Each wait is (factor - 1) x the action's own compute time: from the record's start to the clock
    # reading taken after its result was ready, inside the record.
    for r, (w, t_ready) in zip(slow, waits):
        assert r.start_s < t_ready <= r.end_s
        assert w == pytest.approx(2 * (t_ready - r.start_s), rel=1e-9, abs=1e-12)
    assert waits[-1][0] > 0


@pytest.mark.parametrize("mbs, schedule, tied", [(8, "1f1b", False), (2, "1f1b", True), (8, "gpipe", False)])
def test_one_stage_plan_with_fused_update_equals_unsplit(mbs, schedule, tied, monkeypatch):
    # One stage holding the whole model: the update runs inside the last microbatch's forward+backward
    # program (1 microbatch: no accumulator at all). The separate update jit must never be called.
    plan = split_plan((11,), schedule=schedule, mbs=mbs)
    calls = []
    orig = PipelineRuntime._run
    monkeypatch.setattr(PipelineRuntime, "_run", lambda self, b, train, update_inv_tokens=None: (
        calls.append(update_inv_tokens), orig(self, b, train, update_inv_tokens))[1])
    rt = check_against_reference(plan, tied=tied, debug_nan=True)
    assert rt._update_fusable() and sum(c is not None for c in calls) == 3  # the 3 train steps fused


@pytest.mark.parametrize("schedule, switch_off", [("1f1b", True), ("gpipe", False)])
def test_one_stage_plan_without_fused_update_equals_unsplit(schedule, switch_off):
    # GPipe with 4 microbatches ends with the backward of microbatch 0, far from its forward: not fused.
    plan = split_plan((11,), mbs=2, schedule=schedule)
    cfg = model_config(False)
    rt = PipelineRuntime(plan, cfg, OPTIM, seed=7)
    rt.fuse_update = not switch_off
    assert not rt._update_fusable()
    ref = reference(False, plan.global_batch_size)
    for step, b in enumerate(batches(plan.global_batch_size)[:3]):
        assert_rel(rt.train_step(b).loss, ref["losses"][step], f"loss at step {step}")
    for name, p in ref["params"].items():
        assert_rel(rt.params()[name], p, f"parameter {name} after 3 steps")


def test_bad_batch_is_rejected():
    rt = PipelineRuntime(split_plan((6, 5)), model_config(False), OPTIM)
    b = batches(8)[0]
    with pytest.raises(ValueError, match="global_batch_size"):
        rt.train_step({k: v[:4] for k, v in b.items()})
    with pytest.raises(ValueError, match="no non-pad tokens"):
        rt.train_step(b | {"loss_mask": np.zeros_like(b["loss_mask"])})
