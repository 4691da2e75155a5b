"""Concurrent streams, disconnects and idle behaviour of a real gunicorn server (tiny model)."""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest

from wsgi_infer import SamplingParams
from wsgi_infer.engine.loading.model_paths import default_model_path

from ..conftest import tiny_settings
from ..support.model_servers import assert_idle, completion_body, prompt_beside_stream
from ..support.server import ENDLESS, wait_until
from ..support.sse_client import events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def test_32_concurrent_streams_are_batched_and_correct(server, tiny_llama):
    prompts = [f"Request number {i}: tell me about item {i * 7}" for i in range(32)]
    expected = [
        o.text for o in tiny_llama.generate(prompts, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    ]
    texts = [""] * 32
    first_token = threading.Barrier(33)
    running_seen = []

    def client(i: int) -> None:
        with (
            server.client() as http,
            http.stream("POST", "/v1/completions", json=completion_body(prompts[i], 200, ignore_eos=True)) as r,
        ):
            assert r.status_code == 200
            waited = False
            for event in events(r):
                if not event.data or event.data == "[DONE]":
                    continue
                texts[i] += event.json["choices"][0]["text"]
                if not waited:
                    waited = True
                    first_token.wait(60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    # All 32 reach the worker at once, queued while it is stopped: started one by one on a busy host, the first
    # could all finish before the last was sent, and nothing would show them batched.
    with server.stopped(server.worker_pids()):
        for t in threads:
            t.start()
        wait_until(lambda: server.queued_connections() == 32, "32 connections queued")
    first_token.wait(60)  # every client has its first token: all 32 are in the engine now
    running_seen.append(server.metrics()["wsgi_infer:num_requests_running"])
    for t in threads:
        t.join(120)
    assert running_seen[0] > 16, running_seen  # more than a cap of 16 (or 2) would let run at once
    assert texts == expected
    assert len(set(texts)) == 32
    assert_idle(server)


def test_client_request_id_is_echoed_and_stream_headers_set(server):
    with server.client() as http:
        r = http.post("/v1/completions", json=completion_body("Hi", 2), headers={"X-Request-Id": "my-id-42"})
        assert r.headers["x-request-id"] == "my-id-42"
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        assert r.headers["content-type"].startswith("text/event-stream")
        r = http.get("/health", headers={"X-Request-Id": "bad id <script>"})
        assert r.headers["x-request-id"] != "bad id <script>" and len(r.headers["x-request-id"]) == 32


def test_idle_worker_uses_no_cpu(server):
    (worker,) = [psutil.Process(pid) for pid in server.worker_pids()]
    before = worker.cpu_times()
    time.sleep(3)  # the measurement window itself, not a synchronisation
    after = worker.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    assert used < 0.05 * 3, f"idle worker used {used:.3f}s of CPU in 3s"


def test_clients_reusing_a_request_id_do_not_collide(server, tiny_llama):
    """Two streams under one X-Request-Id at once: the second runs from start to end while the first streams on,
    and each gets its own greedy text."""
    prompts = ["First of the twins", "Second of the twins"]
    expected = [
        o.text for o in tiny_llama.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    ]
    same = {"X-Request-Id": "same"}
    with server.client() as first_http, server.client() as second_http:
        first_body = completion_body(prompts[0], ENDLESS, ignore_eos=True)
        with first_http.stream("POST", "/v1/completions", json=first_body, headers=same) as first:
            first_texts = (e.json["choices"][0]["text"] for e in events(first) if e.data and e.data != "[DONE]")
            first_text = next(first_texts)  # running
            second_body = completion_body(prompts[1], 40, ignore_eos=True)
            with second_http.stream("POST", "/v1/completions", json=second_body, headers=same) as second:
                second_text = "".join(
                    e.json["choices"][0]["text"] for e in events(second) if e.data and e.data != "[DONE]"
                )
            server.wait_for_metric("wsgi_infer:num_requests_running", 1)  # the first one streams on
            while len(first_text) < len(expected[0]):
                first_text += next(first_texts)
    assert second_text == expected[1]
    assert first_text.startswith(expected[0])  # its first 40 tokens' text
    server.wait_for_metric("wsgi_infer:num_requests_running", 0)
    assert_idle(server)


def test_native_generate_streams_through_a_stream_log(server):
    """Plain text from the same machinery as SSE: a client that leaves aborts the generation, and what it was
    sent stays resumable (as SSE events) under its X-Stream-Id."""
    mark, text = len(server.lines), ""
    body = {"prompt": "Hello", "max_new_tokens": ENDLESS, "ignore_eos": True, "temperature": 0, "stream": True}
    with server.client() as http:
        with http.stream("POST", "/generate", json=body, headers={"X-Request-Id": "plain-reader"}) as r:
            assert r.headers["content-type"].startswith("text/plain")
            stream_id = r.headers["x-stream-id"]
            for piece in r.iter_text():
                text += piece
                if len(text) > 200:
                    break  # leave mid-stream
        server.wait_for_log(r"request plain-reader: response ended early, aborted 1", after=mark, timeout=30)
        assert_idle(server)
        with http.stream("GET", f"/v1/streams/{stream_id}") as r:
            resumed = [e for e in events(r) if e.data]
    assert "".join(e.json["text"] for e in resumed if e.name is None).startswith(text)
    assert resumed[-1].name == "error" and resumed[-1].json["error"]["code"] == "stream_abandoned"


PACED_CHUNK = 15  # with the decode beside it, a step of 16 tokens: a bucket's bound of the steps' histogram


@pytest.fixture(scope="module")
def paced_server(gunicorn_server, tiny_model_dirs):
    """The shipped SmolLM2, whose prompts beside streams read PACED_CHUNK tokens a step: the pacer's 1 ms step keeps
    it at its floor (8), below that (a step of 16 tokens takes 6-10 ms, Xeon: the tiny model's, 1.5-2.3 ms, left
    too little room for the pacer never to grow); no drafts, which a stream's decode would add to the step."""
    settings = tiny_settings(tiny_model_dirs, shared_step_ms=1, min_prefill_chunk=PACED_CHUNK, speculative="none")
    return gunicorn_server({**settings, "model": str(default_model_path()), "dtype": "auto", "quantization": "auto"})


def test_a_long_prompt_comes_in_paced_chunks_beside_a_stream_of_the_same_model(paced_server):
    """Without keys, a prompt beside a running stream is read in chunks of the minimum, where it took a whole step's
    512 tokens (a 2,048-token prompt held a 1B model's streams for 1.4 s a chunk on a Xeon)."""
    model = httpx.get(f"{paced_server.url}/v1/models").json()["data"][0]["id"]
    body = {"prompt": "word " * 300, "max_tokens": 1}
    answer, steps, over_16 = prompt_beside_stream(paced_server, model, body, model, PACED_CHUNK + 1)
    assert answer.status_code == 200, answer.text
    prompt_tokens = answer.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 256 and steps > prompt_tokens / PACED_CHUNK and over_16 == 0  # whole: one step of 301


def test_a_plain_text_generation_cut_short_ends_without_the_bodys_end(server):
    """Cancelled (as an engine failure or a backlog ends it), a plain body closes before its last chunk, which the
    client reports as a body cut short: it ended as a whole one did, with nothing to tell them apart."""
    body = {"prompt": "Hello", "max_new_tokens": ENDLESS, "ignore_eos": True, "temperature": 0, "stream": True}
    mark = len(server.lines)
    with server.client() as http:
        with http.stream("POST", "/generate", json=body, headers={"X-Request-Id": "plain-cut"}) as r:
            pieces = r.iter_text()
            assert next(pieces)
            assert http.delete(f"/v1/streams/{r.headers['x-stream-id']}").json()["cancelled"]
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                list(pieces)
        server.wait_for_log(r"plain-text stream cut short \(stream_cancelled\)", after=mark)
        server.wait_for_log(r"request plain-cut: response ended early, aborted 1", after=mark)  # the engine's word
        too_long = http.post("/generate", json={"prompt": "Hello", "max_new_tokens": 10**6})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_new_tokens", too_long.text
        assert "max_tokens" not in too_long.json()["error"]["message"]
    assert_idle(server)
    assert not [line for line in server.lines[mark:] if "Traceback" in line or "Error handling" in line]
