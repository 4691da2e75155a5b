"""The front end tokenizes, with the engine's own tokenizer: a long prompt costs the engine thread nothing (in this
process, with greenlets)."""

from __future__ import annotations

import statistics
import time
from _queue import SimpleQueue

import gevent
import gevent.event
import pytest
from gevent.monkey import get_original

from wsgi_infer.engine.llm_engine import LLMEngine
from wsgi_infer.server.engine_client import served_model as served_model_module

from ..conftest import tiny_settings
from ..support.in_process import InProcessServer
from ..support.server import ENDLESS
from ..support.sse_client import events


@pytest.fixture
def timed_server(tiny_model_dirs, monkeypatch):
    """The tiny app, its engine noting when each step ended, which choices it gave tokens, and itself."""
    steps: list[tuple[float, set[str], LLMEngine]] = []
    step = LLMEngine.step

    def timed_step(self):
        deltas = step(self)
        steps.append((time.monotonic(), {d.request_id for d in deltas if d.token_ids}, self))
        return deltas

    monkeypatch.setattr(LLMEngine, "step", timed_step)
    with InProcessServer(tiny_settings(tiny_model_dirs)) as server:
        yield server, steps


def test_a_long_prompt_is_tokenized_without_stalling_running_streams(timed_server, tiny_llama):
    """A 60,000-token prompt takes about a tenth of a second to tokenize: the front end does it on its own thread, so
    the engine's steps go on meanwhile, and the running streams' tokens come as often as before. Its max_tokens
    does not fit the window, so it ends in a 400 once tokenized: what is measured is the tokenizing, not a
    prefill. The gaps are the engine's, between the steps that gave the streams tokens: what the streams are
    sent, before the noise of this process's HTTP clients."""
    server, steps = timed_server
    # Long enough for several steps meanwhile however fast the tokenizer (30,000 tokens once left room for 3)
    words = "lorem ipsum dolor sit amet " * 6_000
    assert len(tiny_llama.engine.tokenize(words)) >= 60_000
    warmed = [gevent.event.Event(), gevent.event.Event()]

    def read(i: int) -> None:
        body = {"prompt": f"Stream {i}:", "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}
        with server.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
            received = 0
            for event in events(r):
                received += bool(event.data)
                if received == 100:
                    warmed[i].set()
                if received == 400:
                    return

    readers = [gevent.spawn(read, i) for i in range(2)]
    assert all(event.wait(60) for event in warmed)
    with server.client() as http:
        sent = time.monotonic()
        response = http.post("/v1/completions", json={"prompt": words, "max_tokens": 40_000})
        answered = time.monotonic()
    gevent.joinall(readers, timeout=60, raise_error=True)
    assert response.status_code == 400 and "context window" in response.json()["error"]["message"]
    # One tokenizer, the engine's: the front end encoded the prompt with it while the engine thread decoded with it.
    assert server.manager.default.tokenizer is steps[0][2].tokenizer
    tokens_at = [at for at, ids, _ in steps if len(ids) == 2]  # steps that gave both streams a token
    gaps = [b - a for a, b in zip(tokens_at, tokens_at[1:])]
    during = [b - a for a, b in zip(tokens_at, tokens_at[1:]) if b > sent and a < answered]
    print(
        f"a 60,000-token prompt tokenized in {(answered - sent) * 1e3:.0f} ms beside 2 streams: their largest gap "
        f"{max(during) * 1e3:.1f} ms meanwhile, median {statistics.median(gaps) * 1e3:.1f} ms"
    )
    # A step that waited for the tokenizing would follow the one before by the whole tokenizing at least (109-143 ms
    # here). The bound is half of that over the median: scheduling alone (two cores for the engine's two threads,
    # the front-end thread and this process) once stretched a gap to 2.02 times the median, 18.8 ms.
    assert max(during) < statistics.median(gaps) + (answered - sent) / 2
    assert len(during) >= 4, "the streams must run while the long prompt is tokenized"


def test_a_front_end_call_past_stall_seconds_is_a_503_and_health_says_stalled(tiny_model_dirs, monkeypatch):
    """A request never hangs on the front-end thread: past stall_seconds it gets a 503 it may retry, and /health
    says the worker is stalled until the call returns."""
    started, returned = SimpleQueue(), SimpleQueue()

    def slow_prompt_ids(tokenizer, prompts, keep):  # on the front-end thread: a native sleep, as a stuck call
        started.put(True)
        get_original("time", "sleep")(1.0)
        returned.put(True)
        return [[1, 2, 3] for _ in prompts]

    monkeypatch.setattr(served_model_module, "prompt_ids", slow_prompt_ids)
    with InProcessServer(tiny_settings(tiny_model_dirs, stall_seconds=0.2)) as server, server.client() as http:
        refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        # The 0.2 s count the call's time in the queue too: on a busy machine it may start only now, and the
        # worker is stalled 0.2 s into it (the health check's own clock), until it returns at 1 s.
        assert started.get(timeout=10)
        health = http.get("/health")
        while health.status_code == 200 and returned.empty():
            gevent.sleep(0.01)
            health = http.get("/health")
        assert returned.get(timeout=10)
        assert http.get("/health").status_code == 200
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "front_end_timeout"
    assert health.status_code == 503 and health.json()["status"] == "stalled"


def test_token_ids_are_taken_on_the_hub_and_text_on_the_front_end_thread(tiny_api, monkeypatch):
    """Token ids need no tokenizer: they skip the front-end thread's queue (a burst of them waited behind it)."""
    threads = []
    prompt_ids = served_model_module.prompt_ids

    def recorded(tokenizer, prompts, keep):
        threads.append(get_original("threading", "get_native_id")())
        return prompt_ids(tokenizer, prompts, keep)

    monkeypatch.setattr(served_model_module, "prompt_ids", recorded)
    with tiny_api.client() as http:
        for prompt in ([1, 2, 3], "Hi"):
            assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
    hub = get_original("threading", "get_native_id")()
    assert threads[0] == hub and threads[1] != hub
