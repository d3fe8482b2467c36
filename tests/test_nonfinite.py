"""Non-finite loss policy (issue 16 part 2): a step whose global gradient norm is not finite leaves the
parameters and optimizer state as they were (checked on `PipelineStage.update` against the state
before the call); `train.on_nonfinite_loss: stop` ends the run with status 1 and no checkpoint of
that step, `skip` goes on and the final checkpoint holds finite parameters."""
from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hethub_jax import checkpoint as ckpt
from hethub_jax.models.config import get_preset
from hethub_jax.optim import OptimConfig, make_optimizer
from hethub_jax.parallel.stage import PipelineStage

CONFIG = """
model: {preset: tiny, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
        num_attention_heads: 2, num_key_value_heads: 1}
data: {seq_len: 16}
train: {steps: 3, global_batch_size: 4, microbatch_size: 4, eval_every: 100, eval_at_start: false,
        eval_batches: 1, log_every: 0, checkpoint_every: 1}
"""


def test_update_with_nonfinite_norm_changes_nothing():
    cfg = get_preset("tiny").replace(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    st = PipelineStage(cfg, 0, 0, jax.devices()[:1], 1, 1, seed=0, recompute=False,
                       optimizer=make_optimizer(OptimConfig(warmup_steps=0)), clip_norm=1.0)
    before = jax.tree.map(np.asarray, (st.params, st.opt_state))
    grads = jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan, p.dtype), st.params)
    params, opt = st.update(st.params, st.opt_state, grads, jnp.float32(1.0), jnp.float32(jnp.nan))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((params, opt))):
        np.testing.assert_array_equal(a, np.asarray(b))
    ones = jax.tree.map(jnp.ones_like, params)  # a finite step does change them
    params2, _ = st.update(params, opt, ones, jnp.float32(1.0), jnp.float32(1.0))
    assert any(not np.array_equal(a, np.asarray(b))
               for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(params2)))


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nonfinite_loss_policy(tmp_path, monkeypatch, policy):
    from hethub_jax.parallel import runtime
    from hethub_jax.train import main

    real = runtime.PipelineRuntime.train_step

    def train_step(self, batch):  # step 2's batch gets a NaN gradient norm and loss
        self._calls = getattr(self, "_calls", 0) + 1
        res = real(self, batch)
        if self._calls == 2:
            res.loss, res.grad_norm = math.nan, math.nan
        return res

    monkeypatch.setattr(runtime.PipelineRuntime, "train_step", train_step)
    (tmp_path / "c.yaml").write_text(CONFIG)
    rc = main(["--config", str(tmp_path / "c.yaml"), "--metrics-file", str(tmp_path / "m.jsonl"),
               "--checkpoint-dir", str(tmp_path / "ck"), "--no-progress", "--set",
               f"train.on_nonfinite_loss={policy}"])
    done = ckpt.complete_steps(tmp_path / "ck", 2)
    recs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    if policy == "stop":
        assert rc == 1 and done == [1] and recs[-1]["status"] == "non-finite loss"
    else:
        assert rc == 0 and done[0] == 3 and 2 not in done
        assert [r["step"] for r in recs if r["kind"] == "step"] == [1, 2, 3]
