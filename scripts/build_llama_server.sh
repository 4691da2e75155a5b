#!/usr/bin/env bash
# Builds llama.cpp's own llama-server and llama-quantize, the peer the benchmarks compare with, from the llama.cpp
# tree that the llama-cpp-python sdist on PyPI vendors (no other network). Kept out of CI: about 10 minutes on 2
# cores. Usage: bash scripts/build_llama_server.sh [DIR] [IK_TREE]   (DIR default: ../peers); prints the binaries'
# directory. IK_TREE, a checkout of github.com/ikawrakow/ik_llama.cpp (a git clone, or a mirror's work tree), builds
# its llama-server too, the other peer (about 25 minutes more: its iqk/ kernels); run it with -rtr.
# AVX2_ONLY=1 builds both for AVX2 and FMA alone (no AVX-512), into build-avx2: on an AVX-512 machine, the peers
# that our AVX2 kernels (forced with WSGI_INFER_KERNELS_DIR) meet on a Zen 3, side by side on one CPU.
set -euo pipefail
VERSION=0.3.36
DIR=$(realpath -m "${1:-$(dirname "$0")/../../peers}")
IK_TREE=${2:+$(realpath "$2")}
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d llsrc/llama_cpp_python-$VERSION ]; then
    pip download --no-deps --no-binary :all: -d llsrc llama-cpp-python==$VERSION
    tar xzf llsrc/llama_cpp_python-$VERSION.tar.gz -C llsrc
fi
cd llsrc/llama_cpp_python-$VERSION/vendor/llama.cpp
# On a Xeon with AMX its native build (AMX's kernels included) crashes as the model loads (Intel Xeon, 2026-11-30,
# and llama-cpp-python's the same way on 2026-11-22; ggml-org/llama.cpp#20824, a segfault in
# ggml_backend_amx_mul_mat on Q4_K_M files): there, the AVX-512 VNNI build without them, which runs.
NO_AMX=()
BUILD=build
AVX2=()
if [ "${AVX2_ONLY:-0}" = 1 ]; then
    BUILD=build-avx2
    AVX2=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
        -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF)
elif grep -qw amx_int8 /proc/cpuinfo; then
    NO_AMX=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
        -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
cmake -B $BUILD -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DBUILD_SHARED_LIBS=OFF "${NO_AMX[@]}" "${AVX2[@]}" >/dev/null
cmake --build $BUILD --target llama-server llama-quantize llama-bench -j"$(nproc)" >/dev/null
echo "$PWD/$BUILD/bin"
if [ -n "$IK_TREE" ]; then
    cd "$IK_TREE"
    # its flash attention for quantized KV caches left out: the default f16 cache does not use it, and with it the
    # build had not reached a fifth after 13 minutes on a 2-core Xeon (35 minutes in all without it)
    cmake -B $BUILD -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_IQK_FA_ALL_QUANTS=OFF \
        "${AVX2[@]}" >/dev/null
    cmake --build $BUILD --target llama-server -j"$(nproc)" >/dev/null
    echo "$PWD/$BUILD/bin"
fi
