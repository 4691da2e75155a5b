"""``scripts/serve_processes.py``, the servers every benchmark starts: ours runs in the repository, so a model named
by a path relative to where the benchmark runs failed there ("server exited before it was ready", and no reason),
as ``--model shaped/1b/...`` did from the benchmarks' own folder."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from wsgi_infer.engine.loading.model_paths import default_model_path

pytestmark = pytest.mark.slow  # real gunicorn servers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import serve_processes  # noqa: E402


def bench_args(model: str) -> SimpleNamespace:
    return SimpleNamespace(model=model, dtype="auto", quantization="auto", server_log=False)


def test_a_model_path_relative_to_the_benchmark_serves_and_a_failed_start_says_why(tmp_path, monkeypatch):
    (tmp_path / "here.gguf").symlink_to(default_model_path())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    process, url = serve_processes.start_server(bench_args("here.gguf"))
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0 and url.startswith("http://127.0.0.1:")

    with pytest.raises(SystemExit) as failed:
        serve_processes.start_server(bench_args("not-here.gguf"))
    assert "server exited before it was ready" in str(failed.value)
    assert "not-here.gguf: no such file or directory" in str(failed.value)  # the worker's own reason, from its log
