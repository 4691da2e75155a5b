"""``scripts/bench_engine.py``: the engine and transformers' ``generate`` side by side, each in a process of its own.
Its transformers side read a GGUF's copy as a checkpoint directory, which holds no weights since a copy keeps them
in the file: it failed, and nobody ran it. Its engine also speculated whatever it was set beside (bench_serve.py's
server without speculation)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two processes importing torch and transformers

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_engine.py"


def test_the_shipped_model_is_timed_on_the_engine_and_on_transformers(tmp_path):
    env = os.environ | {"WSGI_INFER_CACHE_DIR": str(tmp_path)}
    env.pop("WSGI_INFER_MODEL", None)  # the shipped GGUF
    command = [sys.executable, SCRIPT, "--concurrency", "2", "--rounds", "1", "--min-requests", "2"]
    command += ["--output-len", "4", "--quantization", "auto", "--hf-single-requests", "1", "--speculative", "none"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    engine = re.search(r"^\| 2 \| 2 \| \d+ \| (\d+\.\d) \|", run.stdout, re.MULTILINE)
    alone = re.search(r"^\| 1 \(one at a time\) \| (\d+\.\d) \|", run.stdout, re.MULTILINE)
    batched = re.search(r"^\| 16 \(padded batch\) \| (\d+\.\d) \|", run.stdout, re.MULTILINE)
    assert engine and alone and batched, run.stdout
    assert ", speculation none)" in run.stdout, run.stdout  # as its engine ran (LLM's default is ngram)
    assert min(float(engine[1]), float(alone[1]), float(batched[1])) > 0, run.stdout
