#!/bin/sh
# A C compiler for an AVX2-only CPU's build on an AVX-512/AMX host: gcc with `-march=native` minus
# every AVX-512, AMX and AVX-VNNI extension. With it as CC (and torch held to AVX2), the engine builds
# and runs the kernels an AVX2 CPU (AMD EPYC Zen 2/3 class) gets, so their code path can be measured
# on whatever CPU a session has; memory, caches and clocks stay this host's:
#
#     CC=bench/avx2_only_cc.sh ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
#         .venv/bin/python bench/runner_bench.py --llama-server .cache/llama.cpp/build/bin/llama-server-avx2 ...
#
# (llama-server-avx2: `bash bench/build_llama_server.sh --avx2-only`.)
exec gcc "$@" -mno-avx512f -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -mno-avxvnni
