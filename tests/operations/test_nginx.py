"""wsgi-infer behind a real nginx with the shipped configuration."""

from __future__ import annotations

import re
import signal
import tempfile
import threading
import time

import httpx
import psutil
import pytest

from ..support.nginx_proxy import SHIPPED, SHIPPED_HOSTS, NginxProxy, silent_address
from ..support.server import ENDLESS, ROOT, GunicornServer, free_port
from ..support.sse_client import events, text_of

pytestmark = pytest.mark.slow  # real processes


@pytest.fixture(scope="module")
def server(gunicorn_server, tiny_model_dirs):
    return gunicorn_server(
        {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none", "heartbeat_seconds": 0.3}
    )


def test_nginx_closes_an_idle_upstream_connection_before_gunicorn_does():
    """A request sent on a kept-alive connection as gunicorn closes it is reset, and nginx retries no POST: a client
    whose requests came about 5 s apart got nginx's HTML 502 in 1-2 of 40-62 tries with nginx's 60 s default."""
    config = (ROOT / "wsgi_infer" / "server" / "gunicorn" / "config.py").read_text()
    gunicorn_keepalive = int(re.search(r"^keepalive = (\d+)", config, re.M)[1])
    for shipped in (SHIPPED, SHIPPED_HOSTS):
        upstreams = re.findall(r"^upstream \S+ \{(.*?)^\}", shipped.read_text(), re.M | re.S)
        assert upstreams and all("keepalive 32;" in block for block in upstreams)
        timeouts = [re.search(r"keepalive_timeout (\d+)s;", block) for block in upstreams]
        assert all(t and int(t[1]) < gunicorn_keepalive for t in timeouts), shipped


def test_nginx_own_errors_are_the_apis_json_not_html_pages():
    """nginx's own answers were HTML pages, which an OpenAI client showed as the error's message: a body over
    client_max_body_size (413), no server listening (502), no answer within proxy_read_timeout (504)."""
    import openai

    too_large = {"prompt": "x" * (1 << 20), "max_tokens": 1}
    with NginxProxy(f"127.0.0.1:{free_port()}") as nginx:  # nothing listens there
        refused = httpx.post(f"{nginx.url}/v1/completions", json=too_large, timeout=60)
        client = openai.OpenAI(base_url=f"{nginx.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as unreachable:
            client.completions.create(model="any", prompt="Hi", max_tokens=1)
    with silent_address(connects=True) as hung, NginxProxy(hung, read_timeout="1s") as nginx:
        late = httpx.post(f"{nginx.url}/v1/completions", json={"prompt": "Hi"}, timeout=60)
    assert (refused.status_code, refused.json()["error"]["code"]) == (413, "request_too_large")
    assert (unreachable.value.status_code, unreachable.value.code) == (502, "upstream_unreachable")
    assert unreachable.value.response.headers["Retry-After"] == "1"
    assert (late.status_code, late.json()["error"]["code"]) == (504, "upstream_timed_out")


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


def test_tokens_stream_through_nginx_as_they_are_generated(tiny_model_dirs):
    """The engine stalls three steps into the stream (``test_stall_after_step``), so the upstream response neither
    grows nor ends: its first tokens reach the client through nginx only if nothing on the way buffers them."""
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none", "heartbeat_seconds": 0.5}
    settings["test_stall_after_step"] = 3  # heartbeats: a closed stream is seen at once, too few to fill a buffer
    endless = {"prompt": "Stream me", "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}
    with GunicornServer(settings) as server, NginxProxy(f"127.0.0.1:{server.port}") as nginx:
        server.wait_ready()
        with (
            httpx.Client(base_url=nginx.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=endless) as r,
        ):
            received = events(r)  # held: a dropped generator would close the connection
            server.wait_for_log(r"stalled until the next command")
            assert next(e for e in received if e.data).json["choices"][0]["text"] is not None
            assert server.metrics()["wsgi_infer:generation_tokens_total"] <= 3  # still stalled


def test_a_stream_through_nginx_is_the_one_served_directly(server):
    short = {"prompt": "Stream me", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
    with NginxProxy(f"127.0.0.1:{server.port}") as nginx:
        ttfb, _, direct = first_event_and_total(server.url, short)
        ttfb_proxied, _, proxied = first_event_and_total(nginx.url, short)
    assert proxied[-1].data == "[DONE]"
    assert text_of(proxied) == text_of(direct)  # the same greedy text
    print(f"TTFB direct {1e3 * ttfb:.1f} ms, through nginx {1e3 * ttfb_proxied:.1f} ms")


def test_nginx_keeps_its_connection_to_gunicorn_alive(server):
    def upstream_ports() -> set[int]:
        (worker,) = server.worker_pids()
        connections = psutil.Process(worker).net_connections(kind="tcp")
        return {c.raddr.port for c in connections if c.raddr and c.status == psutil.CONN_ESTABLISHED}

    with NginxProxy(f"127.0.0.1:{server.port}") as nginx, httpx.Client(base_url=nginx.url, timeout=30) as http:
        seen = []
        for _ in range(3):  # each request on a new client connection to nginx
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"Connection": "close"})
            assert r.status_code == 200
            seen.append(upstream_ports())
    assert seen[0] & seen[1] & seen[2], seen  # one upstream connection carried every request


QUIET_HEARTBEATS = 12  # 12 x 0.3 s > nginx's read timeout of 3 s


def test_a_quiet_stream_outlives_nginx_read_timeout(tiny_model_dirs):
    """A queued request sends only heartbeats; more of them than fit in nginx's read timeout go by
    before its first token, and it still completes through nginx."""
    settings = {
        "model": tiny_model_dirs["llama"],
        "dtype": "float32",
        "quantization": "none",
        "heartbeat_seconds": 0.3,
        "max_num_seqs": 1,
    }
    waited = threading.Event()
    quiet_events: list = []

    def quiet_client(url: str) -> None:
        quiet = {"prompt": "patient", "max_tokens": 5, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=quiet) as r:
            for event in events(r):
                quiet_events.append(event)
                if sum(1 for e in quiet_events if e.comments) >= QUIET_HEARTBEATS:
                    waited.set()

    # A 3 s read timeout, not 1 s: a heartbeat that a CI stall (0.9-2 s) delays must not look like a dead upstream.
    with GunicornServer(settings) as server, NginxProxy(f"127.0.0.1:{server.port}", read_timeout="3s") as nginx:
        server.wait_ready()
        busy = {"prompt": "busy", "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=server.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=busy) as r,
        ):
            busy_events = events(r)  # held: a dropped generator would close the connection
            assert next(e for e in busy_events if e.data)  # the only slot is taken: the next request waits
            thread = threading.Thread(target=quiet_client, args=(nginx.url,))
            thread.start()
            assert waited.wait(60), "the quiet stream was cut before it had waited past nginx's read timeout"
        # The busy stream is closed now; its slot goes to the quiet request.
        thread.join(60)
    first_data = next(i for i, e in enumerate(quiet_events) if e.data)
    assert sum(1 for e in quiet_events[:first_data] if e.comments) >= QUIET_HEARTBEATS
    assert quiet_events[-1].data == "[DONE]"


def test_sigterm_drain_reaches_the_client_through_nginx(tiny_model_dirs):
    settings = {
        "model": tiny_model_dirs["llama"],
        "dtype": "float32",
        "quantization": "none",
        "heartbeat_seconds": 0.3,
        "drain_seconds": 1,
    }
    with GunicornServer(settings, "--graceful-timeout", "6", "--keep-alive", "1") as server:
        server.wait_ready()
        with NginxProxy(f"127.0.0.1:{server.port}") as nginx:
            body = {"prompt": "endless", "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}
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
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none"}
    with (
        tempfile.TemporaryDirectory() as folder,  # short: a socket's path has at most 107 bytes
        GunicornServer(settings, "--bind", f"unix:{folder}/gunicorn.sock") as server,
        NginxProxy(f"unix:{folder}/gunicorn.sock") as nginx,
    ):
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
