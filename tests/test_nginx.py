"""wsgi-infer behind a real nginx with the shipped configuration."""

from __future__ import annotations

import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from .nginx_proxy import NginxProxy
from .server import GunicornServer
from .sse_client import events


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    with GunicornServer({"model": tiny_model_dirs["llama"], "dtype": "float32", "heartbeat_seconds": 0.3}) as srv:
        yield srv.wait_ready()


def first_event_and_total(url: str, body: dict, **client_options) -> tuple[float, float, list]:
    with httpx.Client(base_url=url, timeout=60, **client_options) as http:
        start = time.monotonic()
        with http.stream("POST", "/v1/completions", json=body) as r:
            data, first = [], None
            for event in events(r):
                if event.data:
                    first = first or time.monotonic()
                    data.append(event)
        return first - start, time.monotonic() - start, data


def test_tokens_stream_through_nginx_as_they_are_generated(server):
    body = {"prompt": "Stream me", "max_tokens": 600, "ignore_eos": True, "temperature": 0, "stream": True}
    with NginxProxy(f"127.0.0.1:{server.port}") as nginx:
        direct = [first_event_and_total(server.url, body) for _ in range(3)]
        proxied = [first_event_and_total(nginx.url, body) for _ in range(3)]
    ttfb_direct = statistics.median(d[0] for d in direct)
    ttfb_proxied = statistics.median(p[0] for p in proxied)
    total_proxied = statistics.median(p[1] for p in proxied)
    assert all(p[2][-1].data == "[DONE]" for p in proxied)
    assert ttfb_proxied < total_proxied / 4, "nginx held the stream back"
    assert ttfb_proxied - ttfb_direct < 0.025
    print(f"TTFB direct {1e3 * ttfb_direct:.1f} ms, through nginx {1e3 * ttfb_proxied:.1f} ms")


def test_a_quiet_stream_outlives_nginx_read_timeout(tiny_model_dirs):
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "heartbeat_seconds": 0.3, "max_num_seqs": 1}
    with GunicornServer(settings) as server, NginxProxy(f"127.0.0.1:{server.port}", read_timeout="1s") as nginx:
        server.wait_ready()
        busy = {"prompt": "busy", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=server.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=busy) as r,
        ):
            busy_events = events(r)
            assert next(busy_events).data  # the only slot is taken: the next request waits, quiet
            quiet = {"prompt": "patient", "max_tokens": 5, "stream": True}
            ttfb, total, data = first_event_and_total(nginx.url, quiet)
        assert ttfb > 1.5, "the request was not kept waiting past nginx's read timeout"
        assert data[-1].data == "[DONE]"


def test_sigterm_drain_reaches_the_client_through_nginx(tiny_model_dirs):
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "heartbeat_seconds": 0.3, "drain_seconds": 1}
    with GunicornServer(settings, "--graceful-timeout", "6", "--keep-alive", "1") as server:
        server.wait_ready()
        with NginxProxy(f"127.0.0.1:{server.port}") as nginx:
            body = {"prompt": "endless", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with (
                httpx.Client(base_url=nginx.url, timeout=30) as http,
                http.stream("POST", "/v1/completions", json=body) as r,
            ):
                received = events(r)
                data = [next(e for e in received if e.data)]
                server.process.send_signal(signal.SIGTERM)
                data += [e for e in received if e.data]
        assert server.process.wait(10) == 0
    assert all(e.data != "[DONE]" for e in data)
    assert data[-1].name == "error" and data[-1].json["error"]["code"] == "server_shutting_down"
    assert data[-2].json["choices"][0]["finish_reason"] == "abort"


def test_access_log_shows_the_real_client_and_the_unix_socket_upstream(tiny_model_dirs):
    sock = Path(tempfile.mkdtemp()) / "gunicorn.sock"
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32"}
    with GunicornServer(settings, "--bind", f"unix:{sock}") as server, NginxProxy(f"unix:{sock}") as nginx:
        server.wait_ready()
        via_nginx = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=nginx.url, transport=via_nginx, timeout=30) as http:
            r = http.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 2},
                headers={"X-Request-Id": "through-nginx", "X-Forwarded-For": "6.6.6.6"},
            )
        assert r.status_code == 200 and r.headers["x-request-id"] == "through-nginx"
        line = server.wait_for_log(r"^\S+ .*POST /v1/completions").string
        assert line.startswith("127.0.0.2 "), line  # not nginx's 127.0.0.1, not the forged 6.6.6.6
