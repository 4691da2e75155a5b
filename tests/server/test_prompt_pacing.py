"""A long prompt beside streams of the same model, with no API keys: it is read in paced chunks, so that the streams
keep their tokens coming, where it took a whole step's 512 tokens (a 2,048-token prompt held a 1B model's streams
for 1.4 s a chunk on a Xeon)."""

from __future__ import annotations

import httpx
import pytest

from ..conftest import tiny_settings
from ..support.model_servers import Stream
from ..support.server import ENDLESS, engine_steps

pytestmark = pytest.mark.slow  # a real server

MIN_CHUNK = 15  # with the decode beside it, a step of 16 tokens: a bucket's bound of the steps' histogram


@pytest.fixture(scope="module")
def server(gunicorn_server, tiny_model_dirs):
    # the pacer's target of 1 ms keeps it at its floor (8 tokens), below the minimum chunk
    return gunicorn_server(tiny_settings(tiny_model_dirs, shared_step_ms=1, min_prefill_chunk=MIN_CHUNK))


def test_a_long_prompt_comes_in_chunks_of_the_minimum_beside_a_stream_of_the_same_model(server):
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    running = Stream(model, ENDLESS).run(server)
    assert running.started.wait(60)
    before = engine_steps(server, model, MIN_CHUNK + 1)
    with server.client(timeout=120) as http:
        answer = http.post("/v1/completions", json={"prompt": "word " * 300, "max_tokens": 1})
    running.started.clear()
    assert running.started.wait(60)  # the stream still runs after the answer
    running.stop.set()
    running.join()
    assert answer.status_code == 200, answer.text
    prompt_tokens = answer.json()["usage"]["prompt_tokens"]
    steps, over_16 = (after - earlier for after, earlier in zip(engine_steps(server, model, MIN_CHUNK + 1), before))
    assert prompt_tokens > 256 and steps > prompt_tokens / MIN_CHUNK and over_16 == 0  # whole: one step of 301
