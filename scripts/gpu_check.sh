#!/usr/bin/env bash
# GPU check (issue 17): on a machine with one NVIDIA GPU and a JAX CUDA install (pip install "jax[cuda12]"),
#   1. a CUDA island and a CPU island on the same machine train one model together: a real cross-backend
#      pipeline over the MPI host bridge (mpiexec -n 2, rank 0 = island "gpu" on platform cuda with the
#      embedding and layers 0-2, rank 1 = island "host" on platform cpu with layers 3-5 and the head),
#      checked against the unsplit single-device run of the same model on the CPU: every step's loss
#      within GPU_CHECK_RTOL (default 1e-3, relative; float32 with JAX_DEFAULT_MATMUL_PRECISION=highest);
#   2. the CUDA island alone trains a model that fills the GPU and reports tokens/s and MFU: a Llama-shaped
#      model of ~1.3 B parameters (d_model 2048, 24 layers, 16 heads / 16 KV heads, SwiGLU 5632, vocabulary
#      32000, untied), bfloat16 compute with float32 parameters and AdamW state (~21 GB), sequences of 2048
#      tokens, global batch 8; MFU = tokens/s x 6-ish FLOPs per token (planner.analytic: forward + backward,
#      no recompute) / the GPU's dense bf16 peak (planner.catalog, by nvidia-smi's name).
# Budget: under 5 minutes including compilation (each part runs under `timeout`).
# Exit status: 0 passed, 1 failed, 2 no GPU or no CUDA JAX here (nothing run; the message says which).
#
#   bash scripts/gpu_check.sh [OUT_DIR]          # from the repository root, in the venv with hethub-jax
set -u
OUT=${1:-runs/gpu_check}
RTOL=${GPU_CHECK_RTOL:-1e-3}
PY=${PYTHON:-python}
cd "$(dirname "$0")/.." || exit 1

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q "^GPU 0"; then
  echo "gpu_check: NO NVIDIA GPU on this machine (nvidia-smi missing or lists no GPU): nothing run." >&2
  exit 2
fi
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if ! JAX_PLATFORMS=cuda "$PY" -c "import jax; assert jax.devices('cuda')" >/dev/null 2>&1; then
  echo "gpu_check: GPU found ($GPU_NAME) but NO CUDA JAX: 'import jax; jax.devices(\"cuda\")' fails in $PY." >&2
  echo "gpu_check: install it with: pip install -U \"jax[cuda12]\" (same jax version as jaxlib); nothing run." >&2
  exit 2
fi
mkdir -p "$OUT"
echo "gpu_check: GPU $GPU_NAME; JAX $("$PY" -c 'import jax; print(jax.__version__)'); output in $OUT"
export JAX_DEFAULT_MATMUL_PRECISION=highest

cat > "$OUT/gpu_cpu_plan.json" <<'EOF'
{"description": "gpu_check: cross-backend pipeline, CUDA island + CPU island on one machine",
 "islands": [{"name": "gpu", "platform": "cuda"}, {"name": "host", "platform": "cpu"}],
 "stages": [{"island": "gpu", "first_layer": 0, "last_layer": 2},
            {"island": "host", "first_layer": 3, "last_layer": 5}],
 "global_batch_size": 8, "microbatch_size": 2, "schedule": "1f1b"}
EOF
COMMON=(--steps 5 --seq-len 64 --set train.eval_at_start=false --set train.eval_batches=1 --set train.log_every=1
        --set optim.warmup_steps=0 --no-checkpoint --no-progress --global-batch-size 8 --microbatch-size 2)

echo "== 1/2: cross-backend pipeline (cuda + cpu islands, mpiexec -n 2) against the single-device CPU run"
timeout 150 mpiexec -n 2 "$PY" -m hethub_jax.train --plan "$OUT/gpu_cpu_plan.json" "${COMMON[@]}" \
  --metrics-file "$OUT/pipeline.jsonl" > "$OUT/pipeline.log" 2>&1 || { echo "FAILED: pipeline run (see $OUT/pipeline.log)"; tail -20 "$OUT/pipeline.log"; exit 1; }
JAX_PLATFORMS=cpu timeout 90 "$PY" -m hethub_jax.train "${COMMON[@]}" --microbatch-size 8 \
  --metrics-file "$OUT/reference.jsonl" > "$OUT/reference.log" 2>&1 || { echo "FAILED: reference run (see $OUT/reference.log)"; exit 1; }
"$PY" - "$OUT" "$RTOL" <<'EOF' || exit 1
import json, sys
out, rtol = sys.argv[1], float(sys.argv[2])
load = lambda n: [r["loss"] for r in map(json.loads, open(f"{out}/{n}.jsonl")) if r.get("kind") == "step"]
pipe, ref = load("pipeline"), load("reference")
worst = max(abs(a - b) / abs(b) for a, b in zip(pipe, ref))
for i, (a, b) in enumerate(zip(pipe, ref), 1):
    print(f"  step {i}: loss cuda+cpu pipeline {a:.6f}, single-device cpu {b:.6f}")
ok = len(pipe) == len(ref) == 5 and worst <= rtol
print(f"  largest relative loss difference {worst:.2e} (tolerance {rtol:g}): {'PASSED' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
EOF

echo "== 2/2: the CUDA island alone: ~1.3 B Llama-shaped model, bf16, seq 2048, batch 8: tokens/s and MFU"
MODEL='{hidden_size: 2048, intermediate_size: 5632, num_hidden_layers: 24, num_attention_heads: 16, num_key_value_heads: 16, vocab_size: 32000, tie_word_embeddings: false, max_position_embeddings: 2048, dtype: bfloat16, param_dtype: float32}'
JAX_PLATFORMS=cuda timeout 200 "$PY" -m hethub_jax.train --set "model=$MODEL" --steps 8 --seq-len 2048 \
  --global-batch-size 8 --microbatch-size 8 --set train.eval_at_start=false --set train.eval_every=1000 \
  --set train.eval_batches=1 --no-checkpoint --no-progress --metrics-file "$OUT/gpu_alone.jsonl" \
  > "$OUT/gpu_alone.log" 2>&1 || { echo "FAILED: GPU-alone run (see $OUT/gpu_alone.log)"; tail -20 "$OUT/gpu_alone.log"; exit 1; }
"$PY" - "$OUT" "$GPU_NAME" "$MODEL" <<'EOF'
import json, statistics, sys, yaml
from hethub_jax.models.config import LlamaConfig
from hethub_jax.planner import analytic
from hethub_jax.planner.catalog import CATALOG
out, name, model = sys.argv[1], sys.argv[2], yaml.safe_load(sys.argv[3])
steps = [r for r in map(json.loads, open(f"{out}/gpu_alone.jsonl")) if r.get("kind") == "step"][2:]
tps = statistics.median(r["tokens_per_s"] for r in steps)
cfg, seq = LlamaConfig(**model), 2048
fpt = 3 * (cfg.num_hidden_layers * analytic.layer_flops(cfg, seq, seq) + analytic.head_flops(cfg, seq)) / seq
key = next((k for k in CATALOG if k.split("-")[0].lower() in name.lower().replace(" ", "")), None)
print(f"  {cfg.num_params() / 1e9:.2f} B parameters, MEASURED median {tps:,.0f} tokens/s over steps 3-8 "
      f"({fpt / 1e9:.1f} GFLOP per token)")
if key:
    print(f"  MFU {100 * tps * fpt / CATALOG[key].peak_flops:.1f}% of {key}'s dense bf16 peak "
          f"({CATALOG[key].peak_flops / 1e12:.0f} TFLOP/s, {CATALOG[key].source})")
else:
    print(f"  MFU not computed: {name!r} is not in hethub_jax.planner.catalog")
EOF
echo "gpu_check: PASSED"
