#!/usr/bin/env bash
# A long fuzzing run, random rather than the suite's fixed examples: hostile bodies to every route
# (tests/operations/test_fuzz.py), sampling settings across their ranges on the engine
# (tests/sampling/test_sampling_properties.py) and interleavings of adds, aborts and steps
# (tests/engine/test_interleavings.py), each that many examples.
# Usage: bash scripts/fuzz_server.sh [examples, default 5000] [pytest options]
set -euo pipefail
cd "$(dirname "$0")/.."
WSGI_INFER_FUZZ_EXAMPLES="${1:-5000}" WSGI_INFER_FUZZ_RANDOM=1 .venv/bin/python -m pytest -q \
    tests/operations/test_fuzz.py tests/sampling/test_sampling_properties.py tests/engine/test_interleavings.py "${@:2}"
