#!/usr/bin/env bash
# A long fuzzing run of every route (tests/operations/test_fuzz.py with random, not fixed, examples).
# Usage: bash scripts/fuzz_server.sh [examples, default 5000]
set -euo pipefail
cd "$(dirname "$0")/.."
WSGI_INFER_FUZZ_EXAMPLES="${1:-5000}" WSGI_INFER_FUZZ_RANDOM=1 .venv/bin/python -m pytest -q tests/operations/test_fuzz.py "${@:2}"
