"""The ``wsgi-infer`` command, run as a user would."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wsgi_infer import SamplingParams
from wsgi_infer.engine.cache_files import read_json
from wsgi_infer.engine.kernels.build import library_path
from wsgi_infer.engine.model_builder import PACKED_ROWS_FILE
from wsgi_infer.engine.model_loader import RESOLVED_CONFIGS_DIR
from wsgi_infer.engine.models import MODEL_REGISTRY

pytestmark = pytest.mark.slow  # real processes


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wsgi_infer.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_the_greedy_completion(tiny_model_dirs, tiny_llama):
    model = str(tiny_model_dirs["llama"])
    result = run_cli(
        "generate", "Hello there", "--model", model, "--dtype", "float32", "--quantization", "none", "--max-tokens", "8"
    )
    assert result.returncode == 0, result.stderr
    expected = tiny_llama.generate("Hello there", SamplingParams(temperature=0, max_tokens=8))[0].text
    assert result.stdout == expected + "\n"


def test_missing_model_is_one_clear_error_line(tmp_path):
    missing = tmp_path / "nowhere"
    result = run_cli("generate", "hi", "--model", str(missing))
    assert result.returncode == 2
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        f"wsgi-infer: error: model {missing}: no such file or directory "
        "(expected a Hugging Face directory or a .gguf file)"
    ]


def test_unsupported_architecture_names_path_and_expectation(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    result = run_cli("generate", "hi", "--model", str(tmp_path))
    assert result.returncode == 2
    expected = ", ".join(sorted(MODEL_REGISTRY))
    assert f"model {tmp_path}: unsupported architecture 'bert' (expected one of: {expected})" in result.stderr
    assert "Traceback" not in result.stderr


def test_prepare_does_a_first_starts_work_ahead(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("WSGI_INFER_QUANTIZATION", "int8")  # the server's settings apply
    result = run_cli("prepare", "--model", str(tiny_model_dirs["llama"]))
    assert result.returncode == 0, result.stderr
    assert library_path().is_file() and library_path().is_relative_to(tmp_path)
    assert len(list((tmp_path / RESOLVED_CONFIGS_DIR).iterdir())) == 1
    assert read_json(tmp_path / PACKED_ROWS_FILE)  # the crossing points of this CPU
