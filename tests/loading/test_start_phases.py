"""``scripts/bench_start.py --phases``: a later start's parts timed one after another in one process, each part
wrapped where the engine calls it by name. A part renamed or moved left its line timing nothing (the tokenizer's,
when the text side moved out of the engine's module: the script failed, and nobody ran it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a process importing torch and transformers, as a worker does

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_start.py"
PARTS = ("tokenizer", "packing the projections", "the other weights", "the embedding's check", "KV cache")


def test_every_part_of_the_shipped_models_load_is_called_and_timed(tmp_path):
    env = os.environ | {"WSGI_INFER_CACHE_DIR": str(tmp_path)}
    env.pop("WSGI_INFER_MODEL", None)  # the shipped model: a GGUF, packed, its head tied to the embedding
    run = subprocess.run([sys.executable, SCRIPT, "--phases"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = {match[0]: match for match in re.findall(r"^  (\S.*?) +(\d+\.\d+) s(.*)$", run.stdout, re.MULTILINE)}
    assert set(PARTS) <= set(lines), run.stdout
    assert not [line for line in lines.values() if line[2]], run.stdout  # "never called"
    assert float(lines["tokenizer"][1]) > 0 and float(lines["packing the projections"][1]) > 0, run.stdout
