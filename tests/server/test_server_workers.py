"""Engine failure, several workers, and `wsgi-infer serve`, against real gunicorn processes."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
import torch

from ..support.server import GunicornServer
from ..support.sse_client import events

pytestmark = pytest.mark.slow  # real processes


def test_engine_failure_ends_streams_turns_health_503_and_worker_is_replaced(tiny_model_dirs):
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none", "test_fault_at_step": 40}
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
        died, _ = server.wait_for_line(r"engine thread died; this worker exits")
        # counted aborted (request_success_total{abort}) as a client's cut is, though no engine answers the abort
        server.wait_for_log(rf"\[{first_worker}\] \[INFO\] request \S+: response ended early, aborted 1 unfinished")
        # A fresh worker takes over and serves (until its own step 40).
        (replacement,) = server.wait_booted(after=died)
        assert replacement != first_worker
        with server.client() as http:
            assert http.get("/health").status_code == 200
            ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_health_is_503_once_the_engine_thread_is_dead(tiny_model_dirs):
    # A long graceful period keeps the dying worker around long enough to ask it.
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none", "test_fault_at_step": 3}
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
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none"}
    with GunicornServer(settings, "--workers", "2") as server:
        workers = server.wait_booted(count=2)
        single = int(server.wait_for_log(r"KV cache: (\d+) blocks").group(1))
        # Both accepting: a worker still importing in post_worker_init accepts nothing, and under load the other
        # one served all 40 requests in that time (a flaky failure).
        first, _ = server.wait_for_line(r"engine ready")
        server.wait_for_line(r"engine ready", after=first + 1)
        # Workers share the machine: a GPU each in turn, or the cores split so they do not oversubscribe.
        if torch.cuda.is_available():
            expected = [f"worker {i} uses cuda:{i % torch.cuda.device_count()}" for i in range(2)]
        else:
            expected = [
                f"worker {i} uses the CPU with {max(1, len(os.sched_getaffinity(0)) // 2)} threads (" for i in range(2)
            ]
        assert all(any(e in line for line in server.lines) for e in expected), expected
        server.wait_for_log(r"2 workers and no WSGI_INFER_REDIS_URL: a stream resumes")  # said once, by the master
        completion_tokens = prompt_tokens = 0
        for i, worker in enumerate(workers * 4):  # four requests on each worker, a new connection each
            with server.accepting_only_on(worker), server.client() as http:
                r = http.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 4})
                assert server.worker_of(r) == worker
            completion_tokens += r.json()["usage"]["completion_tokens"]
            prompt_tokens += r.json()["usage"]["prompt_tokens"]
        metrics = server.metrics()
        assert metrics["wsgi_infer:kv_blocks_total"] == 2 * single  # summed over both live workers
        assert metrics["wsgi_infer:kv_blocks_free"] == 2 * single
        assert metrics["wsgi_infer:generation_tokens_total"] == completion_tokens
        assert metrics["wsgi_infer:prompt_tokens_total"] == prompt_tokens
        assert metrics["wsgi_infer:open_streams"] == 0


def test_wsgi_infer_serve_runs_the_gunicorn_configuration(tiny_model_dirs):
    """`wsgi-infer serve` with --workers, further flags from GUNICORN_CMD_ARGS, and the default
    drain (graceful_timeout - keepalive - 2) derived from them."""
    cli = str(Path(sys.executable).with_name("wsgi-infer"))
    command = [cli, "serve", "--model", str(tiny_model_dirs["llama"]), "--bind", "127.0.0.1:0", "--workers", "2"]
    with GunicornServer({}, command=command, GUNICORN_CMD_ARGS="--graceful-timeout 11 --keep-alive 3") as server:
        workers = server.wait_booted(count=2)
        assert any("Using worker: wsgi_infer.server.gunicorn.worker.InferenceWorker" in line for line in server.lines)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        for pid in workers:  # each froze what it imported out of garbage collection
            frozen = server.wait_for_log(rf"\[{pid}\] \[INFO\] imported in [\d.]+ s; (\d+) objects frozen")
            assert int(frozen.group(1)) > 100_000  # torch's and transformers' objects, and ours
        assert server.stop() == 0
        for pid in workers:
            server.wait_for_log(rf"\[{pid}\] \[INFO\] draining: 0 open requests, up to 6\.0 s")
            server.wait_for_log(rf"\[{pid}\] \[INFO\] engine thread stopped")


def test_gevents_plugins_are_looked_up_as_importlib_answers_but_read_once(monkeypatch):
    from importlib import metadata

    from wsgi_infer.server.gunicorn.worker import _entry_points_read_once

    groups = ["gevent.plugins.monkey.will_patch_all", "console_scripts", "no.such.group"]
    expected = {g: sorted(ep.name for ep in metadata.entry_points(group=g)) for g in groups}
    reads = []
    original = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: reads.append(kw) or original(**kw))
    counted = metadata.entry_points
    with _entry_points_read_once():
        answers = {g: sorted(ep.name for ep in metadata.entry_points(group=g)) for g in groups * 3}
    assert answers == expected and expected["console_scripts"]
    assert reads == [{}]  # one read of every distribution
    assert metadata.entry_points is counted  # put back


def control_workers(path: Path) -> list[int]:
    """The worker pids a gunicorn control socket reports (what `gunicornc -s PATH show workers` prints)."""
    from gunicorn.ctl.client import ControlClient

    with ControlClient(str(path), timeout=10) as client:
        return sorted(w["pid"] for w in client.send_command("show workers")["workers"])


def test_two_servers_of_one_user_never_share_a_control_socket(tiny_model_dirs, tmp_path):
    """gunicorn's default control socket is one path per user: by default a server opens none, and each server
    given a path of its own keeps it, answering for its own workers, while the other stops."""
    home = tmp_path / "home"
    home.mkdir()
    user = {"HOME": str(home), "XDG_RUNTIME_DIR": ""}  # gunicorn's default path is then ~/.gunicorn/gunicorn.ctl
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none"}
    first, second = tmp_path / "first.ctl", tmp_path / "second.ctl"
    with GunicornServer(settings, "--log-level", "debug", **user) as plain:
        plain.wait_for_log(r"Control socket disabled")
        plain.stop(signal.SIGINT)  # a quick stop: nothing here needs its drain
    with (
        GunicornServer(settings, "--control-socket", str(first), **user) as one,
        GunicornServer(settings, "--control-socket", str(second), **user) as other,
    ):
        one.wait_for_log(rf"Control socket listening at {first}")
        other.wait_for_log(rf"Control socket listening at {second}")
        assert not (home / ".gunicorn" / "gunicorn.ctl").exists()
        assert control_workers(first) == sorted(one.worker_pids())
        assert control_workers(second) == sorted(other.worker_pids())
        other.stop(signal.SIGINT)
        assert not second.exists()
        assert control_workers(first) == sorted(one.worker_pids())
        one.stop(signal.SIGINT)
