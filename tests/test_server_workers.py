"""Engine failure, several workers, and `wsgi-infer serve`, against real gunicorn processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from .server import ROOT, GunicornServer, free_port
from .sse_client import events


def test_engine_failure_ends_streams_turns_health_503_and_worker_is_replaced(tiny_model_dirs):
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "test_fault_at_step": 40}
    with GunicornServer(settings) as server:
        server.wait_ready()
        (first_worker,) = server.worker_pids()
        body = {"prompt": "doomed", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with server.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
            received = list(events(r))
        data = [e for e in received if e.data]
        assert data[-1].name == "error" and data[-1].retry == 1000
        error = data[-1].json["error"]
        assert error["code"] == "engine_stopped" and "fault injected at step 40" in error["message"]
        assert "Traceback" not in error["message"]
        assert data[-2].json["choices"][0]["finish_reason"] == "abort"
        assert all(e.data != "[DONE]" for e in data)
        server.wait_for_log(r"engine thread died; this worker exits")
        # A fresh worker takes over and serves (until its own step 40).
        server.wait_for_log(rf"Booting worker with pid: (?!{first_worker})")
        mark = len(server.lines)
        server.wait_for_log(r"engine ready: serving", after=mark - 1)
        with server.client() as http:
            assert http.get("/health").status_code == 200
            ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_health_is_503_once_the_engine_thread_is_dead(tiny_model_dirs):
    # A long graceful period keeps the dying worker around long enough to ask it.
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "test_fault_at_step": 3}
    with GunicornServer(settings, "--graceful-timeout", "30") as server:
        server.wait_ready()
        with (
            server.client() as http,
            http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True}) as r,
        ):
            list(events(r))  # ends with the error event once the thread died
            # Same keep-alive connection, so the same (dying) worker answers.
            health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed"


def test_metrics_add_up_across_two_workers(tiny_model_dirs):
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32"}
    with GunicornServer(settings, "--workers", "2") as server:
        server.wait_for_log(r"engine ready: serving")
        mark = next(i for i, line in enumerate(server.lines) if "engine ready" in line)
        server.wait_for_log(r"engine ready: serving", after=mark + 1)
        single = int(server.wait_for_log(r"KV cache: (\d+) blocks").group(1))
        # Two workers on two cores: one torch thread each, so they do not oversubscribe.
        assert sum("uses the CPU with 1 torch threads" in line for line in server.lines) == 2
        completion_tokens = prompt_tokens = 0
        for i in range(8):
            with httpx.Client(base_url=server.url) as http:  # new connections: both workers get some
                usage = http.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 4}).json()["usage"]
            completion_tokens += usage["completion_tokens"]
            prompt_tokens += usage["prompt_tokens"]
        metrics = server.metrics()
        assert metrics["wsgi_infer:kv_blocks_total"] == 2 * single  # summed over both live workers
        assert metrics["wsgi_infer:kv_blocks_free"] == 2 * single
        assert metrics["wsgi_infer:generation_tokens_total"] == completion_tokens
        assert metrics["wsgi_infer:prompt_tokens_total"] == prompt_tokens
        assert metrics["wsgi_infer:open_streams"] == 0


def test_wsgi_infer_serve_runs_the_gunicorn_configuration(tiny_model_dirs):
    port = free_port()
    process = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("wsgi-infer")),
            "serve",
            "--model",
            str(tiny_model_dirs["llama"]),
            "--bind",
            f"127.0.0.1:{port}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        startup = []
        for line in process.stdout:
            startup.append(line)
            if "engine ready" in line:
                break
        assert any("Using worker: wsgi_infer.server.worker.InferenceWorker" in line for line in startup)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert process.returncode == 0
    assert "engine thread stopped" in output
