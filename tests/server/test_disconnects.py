"""Clients that leave, on a real gunicorn server (tiny model): mid-stream, queued, prefilling, or before a response
that writes nothing until its end. Each is found by a failed write, or by a look at its socket every second
(``client_connection``) where nothing is written, and its request aborted: everything is freed."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from ..conftest import tiny_settings
from ..support.model_servers import assert_idle, completion_body
from ..support.server import ENDLESS, GunicornServer, labelled_samples
from ..support.sse_client import events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def aborted(server: GunicornServer) -> float:
    """Choices counted as aborted (a client left), as vLLM counts them."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return labelled_samples(text, "wsgi_infer:request_success_total").get((("finished_reason", "abort"),), 0.0)


def test_disconnect_mid_stream_frees_everything(server):
    mark, before = len(server.lines), aborted(server)
    with (
        server.client() as http,
        http.stream("POST", "/v1/completions", json=completion_body("Hello", ENDLESS, ignore_eos=True)) as r,
    ):
        request_id = r.headers["x-request-id"]
        got = 0
        for event in events(r):
            if event.data:
                got += 1
            if got == 3:
                break  # leave mid-stream
    server.wait_for_log(rf"request {request_id}: response ended early, aborted 1", after=mark, timeout=30)
    assert_idle(server)
    assert aborted(server) == before + 1


def test_a_request_the_engine_refuses_logs_no_abort(server):
    """The engine refuses a token id past the vocabulary (a 400): nothing ran, so nothing ended early (each such
    request logged "response ended early, aborted 0 unfinished choices")."""
    mark = len(server.lines)
    with server.client() as http:
        refused = http.post(
            "/v1/completions", json={"prompt": [5, 10**6], "max_tokens": 2}, headers={"X-Request-Id": "refused"}
        )
        assert refused.status_code == 400, refused.text
        with http.stream(
            "POST",
            "/v1/completions",
            json=completion_body("Hi", ENDLESS, ignore_eos=True),
            headers={"X-Request-Id": "after-refused"},
        ) as r:
            next(e for e in events(r) if e.data)  # the engine's answers come in order: the refusal's first
    server.wait_for_log(r"request after-refused: response ended early, aborted 1", after=mark, timeout=30)
    assert not any("request refused:" in line for line in server.lines[mark:])
    assert_idle(server)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_non_streamed_request_whose_client_leaves_is_aborted(server, route):
    # A client that gives up on a response (a timeout, then a retry) must not leave it generating to max_tokens.
    mark, request_id = len(server.lines), f"gone-{route.count('/')}"
    body = {"max_tokens": ENDLESS, "ignore_eos": True, "temperature": 0}
    body |= {"prompt": "Hello"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(
            f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: {request_id}\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        server.wait_for_metric("wsgi_infer:num_requests_running", 1)
    server.wait_for_log(rf"request {request_id}: response ended early, aborted 1", after=mark, timeout=30)
    server.wait_for_log(rf'"POST {route} HTTP/1.1" 499', after=mark, timeout=30)
    assert_idle(server)


@pytest.fixture(scope="module")
def one_seq_server(gunicorn_server, tiny_model_dirs):
    """One sequence at a time and small prefill chunks: queued and prefilling states last."""
    settings = tiny_settings(tiny_model_dirs, max_num_seqs=1, max_num_batched_tokens=1, max_waiting_requests=1)
    return gunicorn_server(settings)


def test_disconnect_while_queued_and_while_prefilling(one_seq_server):
    server = one_seq_server
    mark = len(server.lines)
    with (
        server.client() as http,
        http.stream("POST", "/v1/completions", json=completion_body("Busy", ENDLESS, ignore_eos=True)) as busy,
    ):
        running_id = busy.headers["x-request-id"]
        busy_events = events(busy)  # kept: dropping the iterator would close the connection
        assert next(busy_events).data  # it is running
        with (
            server.client() as http2,
            http2.stream("POST", "/v1/completions", json=completion_body("Queued", 5)) as queued,
        ):
            queued_id = queued.headers["x-request-id"]
            queued_events = events(queued)
            heartbeat = next(queued_events)
            assert heartbeat.comments == ["ping"] and not heartbeat.data  # waiting behind the busy one
            # 1 running + 1 waiting is the limit: a third request is refused at once.
            refused = http2.post("/v1/completions", json=completion_body("x", 2))
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
        server.wait_for_log(rf"request {queued_id}: response ended early, aborted 1", after=mark, timeout=30)
    server.wait_for_log(rf"request {running_id}: response ended early, aborted 1", after=mark, timeout=30)
    assert_idle(server)

    long_prompt = list(range(1000, 4900))  # 3,900 prefill steps of one token: seconds, not milliseconds
    with server.client() as http, http.stream("POST", "/v1/completions", json=completion_body(long_prompt, 5)) as r:
        prefill_id = r.headers["x-request-id"]
        prefill_events = events(r)
        heartbeat = next(prefill_events)
        assert heartbeat.comments == ["ping"] and not heartbeat.data
    server.wait_for_log(rf"request {prefill_id}: response ended early, aborted 1", after=mark, timeout=30)
    assert_idle(server)


@pytest.fixture(scope="module")
def slow_heartbeat_server(gunicorn_server, tiny_model_dirs):
    """One sequence at a time and heartbeats 30 s apart: a queued request writes nothing for as long as it waits."""
    return gunicorn_server(tiny_settings(tiny_model_dirs, max_num_seqs=1, heartbeat_seconds=30.0))


def held(server: GunicornServer, request_id: str, body: dict) -> socket.socket:
    """A completion request sent on a connection of its own, whose response nobody reads unless the test does."""
    payload = json.dumps(body).encode()
    client = socket.create_connection(("127.0.0.1", server.port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: {request_id}"
    client.sendall(f"{head}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return client


def test_a_queued_request_sends_its_headers_at_once_and_is_aborted_a_look_after_its_client_left(
    slow_heartbeat_server,
):
    """Behind a running request, a queued stream's headers (its X-Stream-Id, to resume it by) waited for its first
    heartbeat, and a non-streamed request whose client gave up was aborted at its heartbeat too: 30 s here."""
    server = slow_heartbeat_server
    mark = len(server.lines)
    busy = held(server, "busy", {"prompt": "Busy", "max_tokens": ENDLESS, "ignore_eos": True})
    server.wait_for_metric("wsgi_infer:num_requests_running", 1)
    with held(server, "queued-stream", completion_body("Queued", 2)) as streamed:
        streamed.settimeout(10)  # a third of the heartbeat interval
        head = b""
        while b"\r\n\r\n" not in head:
            head += streamed.recv(4096)
        assert head.startswith(b"HTTP/1.1 200") and b"\r\nx-stream-id: " in head.lower()
    with held(server, "gave-up", {"prompt": "Queued", "max_tokens": 2}):
        server.wait_for_metric("wsgi_infer:num_requests_waiting", 2)
    server.wait_for_log(r"request gave-up: response ended early, aborted 1", after=mark, timeout=10)
    busy.close()
    server.wait_for_log(r"request busy: response ended early, aborted 1", after=mark, timeout=10)
    server.wait_for_metric("wsgi_infer:num_requests_running", 0)  # the queued stream's two tokens, unread
    server.wait_for_metric("wsgi_infer:num_requests_waiting", 0)
    assert_idle(server)
