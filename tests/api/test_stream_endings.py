"""An interrupted stream ends in its own API's shape: a reader that falls behind the backlog bound, on each route
that streams (in this process, over the tiny engine: a reader that reads nothing is the test itself)."""

from __future__ import annotations

import time
from collections.abc import Callable

import gevent
import pytest

from wsgi_infer.server.streaming.stream_endings import RETRY_MS

from ..conftest import tiny_settings
from ..support.in_process import InProcessServer
from ..support.sse_client import events

BACKLOG = 2048  # bytes: a few events of any route
# Far more tokens than the cut lets through (10-52 of them, the engine racing the hub's abort beside a busy process):
# a stream the bound did not cut would run to them all
MAX_TOKENS = 5000
ASK = [{"role": "user", "content": "Tell me a long story"}]


@pytest.fixture(scope="module")
def backlogged(tiny_model_dirs):
    with InProcessServer(tiny_settings(tiny_model_dirs, stream_backlog_bytes=BACKLOG)) as server:
        yield server


def openai_ending(ending: list) -> None:
    error = ending[-1]
    assert error.name == "error" and error.json["error"]["code"] == "stream_backlog_exceeded"
    assert error.retry == RETRY_MS  # when the client may resume the stream
    assert ending[-2].json["choices"][0]["finish_reason"] == "abort"


def anthropic_ending(ending: list) -> None:
    error = ending[-1]
    assert error.name == "error" and error.json["type"] == "error"
    assert error.json["error"]["type"] == "overloaded_error" and "behind" in error.json["error"]["message"]
    assert error.retry == RETRY_MS  # as the event a reader of Redis's copy writes


def responses_ending(ending: list) -> None:
    failed = ending[-1]
    assert failed.name == "response.failed" and failed.json["type"] == "response.failed"
    assert failed.json["response"]["status"] == "failed"
    assert failed.json["response"]["error"]["code"] == "stream_backlog_exceeded"


def native_ending(ending: list) -> None:
    error = ending[-1]
    assert error.name == "error" and error.json["error"]["code"] == "stream_backlog_exceeded"


ROUTES: dict[str, tuple[dict, Callable[[list], None]]] = {
    "/v1/chat/completions": ({"messages": ASK}, openai_ending),
    "/v1/messages": ({"messages": ASK}, anthropic_ending),
    "/v1/responses": ({"input": "Tell me a long story"}, responses_ending),
    "/generate": ({"prompt": "Tell me a long story", "max_new_tokens": MAX_TOKENS}, native_ending),
}


@pytest.mark.parametrize("route", ROUTES)
def test_a_reader_behind_the_backlog_bound_gets_its_apis_own_ending(backlogged, route):
    body, check = ROUTES[route]
    body = {
        **body,
        "model": backlogged.manager.model_name,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    if route == "/v1/responses":  # its own names (it refuses chat's), no ignore_eos: the tiny model rambles on anyway
        body["max_output_tokens"] = body.pop("max_tokens")
        del body["ignore_eos"]
    elif route == "/generate":
        del body["max_tokens"]
    headers = {"Accept": "text/event-stream"}
    generated = backlogged.metrics()["wsgi_infer:generation_tokens_total"]
    with backlogged.client() as http, http.stream("POST", route, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        log = backlogged.manager.stream_logs.get(r.headers["X-Stream-Id"])
        while not log.finished:  # nothing is read meanwhile: the generation runs until the bound cuts it
            log.wait(len(log.events), timeout=30)
        received = [e for e in events(r) if e.data]
    assert len(received) < MAX_TOKENS, "the stream was not cut at the bound"
    assert not any(e.data == "[DONE]" for e in received)
    check(received)
    wait_until_idle(backlogged)  # the generation was aborted: its KV blocks are free
    assert backlogged.metrics()["wsgi_infer:generation_tokens_total"] - generated < MAX_TOKENS  # before them all


def test_a_stream_cut_in_its_opening_events_lets_go_of_its_request(backlogged):
    """A Responses stream whose metadata alone puts its first events (each holds the response) past the bound:
    cut before its generator reached the engine's deltas, whose end released the request; it was never released,
    its model busy for ever (no unload, every drain to its deadline) and the open-streams gauge up."""
    metadata = {f"note{i}": "x" * 512 for i in range(BACKLOG // 512)}  # within OpenAI's bounds, the bound's size
    body = {"input": "Hi", "stream": True, "max_output_tokens": 4, "metadata": metadata}
    with backlogged.client() as http, http.stream("POST", "/v1/responses", json=body) as reply:
        ending = [e for e in events(reply) if e.data][-1]
        assert ending.name == "error" and ending.json["error"]["code"] == "stream_backlog_exceeded", ending.data
    # released by the log's pump as it ended, before the hub sent that end: no wait
    assert backlogged.metrics()["wsgi_infer:open_streams"] == 0, "the stream was never released"
    assert not backlogged.manager.models[backlogged.manager.model_name].busy
    wait_until_idle(backlogged)  # and its generation aborted


def wait_until_idle(server: InProcessServer) -> None:
    """Until nothing runs and every KV block is free; the hub (this thread) runs meanwhile, taking the engine's
    news."""
    deadline = time.monotonic() + 30
    while not is_idle(values := server.metrics()):
        assert time.monotonic() < deadline, f"never idle: {values}"
        gevent.sleep(0.01)


def is_idle(values: dict) -> bool:
    return values["wsgi_infer:num_requests_running"] == 0 and (
        values["wsgi_infer:kv_blocks_free"] == values["wsgi_infer:kv_blocks_total"]
    )
