#!/usr/bin/env bash
# GPU check for the runner (prepared by bench/gpu_prepare.sh; < 5 minutes on one H200):
#   1. greedy equality with HF `generate` on CUDA (float32, token for token), by the same tests as on
#      CPU: one at a time, all at once, 16-token chunks, forced recompute, forced swap, and the real
#      Scheduler + runner under preemption;
#   2. the step-time profile in bfloat16 (`magnitude profile`), written as a cost-model JSON;
#   3. where a bf16 mixed step's time goes (bench/step_profile.py).
# Weights: seeded random, SmolLM2-135M architecture (config/tokenizer carried; real weights exceed
# the carry limit). Results go to $OUT (or out/gpu-check when run by hand).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=server:operator
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .cache/gpucheck/whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/make_model.txt"
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(".cache/gpucheck")
cfg.initializer_range = 0.08  # peakier logits than the default 0.02, so argmax margins are real
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
model.save_pretrained("/tmp/mag-model")
for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]:
    shutil.copy(f".cache/gpucheck/{f}", "/tmp/mag-model/")
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
PY
set -o pipefail
MAGNITUDE_TEST_MODEL=/tmp/mag-model MAGNITUDE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/runner/test_greedy_equality.py tests/runner/test_with_scheduler.py 2>&1 | tee "$OUT/equality.txt"
EQ=${PIPESTATUS[0]}
timeout 120 python3 -m magnitude.cli.main profile --model /tmp/mag-model --device cuda --dtype bfloat16 \
  --decode-batch-sizes 0,1,8,32,64,128 --prefill-tokens 0,128,512,1024,2048 --context 512 --repeats 5 \
  --itl-target 30ms --itl-batch 32 --out "$OUT/cost-h200-bf16.json" 2>&1 | grep -v "it/s" | tee "$OUT/profile.txt"
timeout 60 python3 bench/step_profile.py --device cuda --dtype bfloat16 --decodes 32 --prefill 512 --context 512 \
  2>&1 | grep -v "it/s" | tee "$OUT/step_profile.txt"
echo "equality tests exit code: $EQ"
exit $EQ
