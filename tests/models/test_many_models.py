"""Several models from one real server, chosen by `model`: the tiny Llama (loaded at start), the shipped SmolLM2
(its GGUF, on the CPU kernels; loaded on demand), all-MiniLM-L6-v2 (embeddings) and a file that cannot load. Each
model's greedy text equals that model's alone, streams on one model keep flowing while another loads, a failed
model fails alone, and a SIGTERM ends the streams of every model with their terminal event."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import psutil
import pytest

from wsgi_infer.engine.loading.model_paths import default_model_path
from wsgi_infer.engine.sampling_params import SamplingParams

from ..conftest import tiny_settings
from ..support.model_servers import LONG, PROMPT, Stream, prompt_beside_stream
from ..support.server import ENDLESS, GunicornServer, parse_metrics, wait_until

pytestmark = pytest.mark.slow  # a real server of real models

# Every load here takes LOAD_SECONDS longer, on its loader thread; a running stream's largest gap while another
# model loads stays below LOAD_GAP_SECONDS. The issue asks 1 s of a quiet machine (BENCHMARKS.md's probe), 165 ms
# here; beside two-worker servers starting, a CI run saw 1.98 s, which passes. The load's wait on the engine
# thread (planted) holds the stream the whole LOAD_SECONDS: 2.5 s once, too near that stall.
LOAD_GAP_SECONDS = 3.0
LOAD_SECONDS = 5.0


@pytest.fixture(scope="module")
def models_server(tmp_path_factory, tiny_model_dirs, minilm_dir):
    folder = tmp_path_factory.mktemp("models")
    broken = folder / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    config = folder / "models.toml"
    config.write_text(
        f"""
[models.tiny]
path = "{tiny_model_dirs["llama"]}"
aliases = ["tiny-alias"]

[models.smollm2]
path = "{default_model_path()}"
dtype = "auto"
quantization = "auto"

[models.minilm]
path = "{minilm_dir}"

[models.broken]
path = "{broken}"
"""
    )
    settings = tiny_settings(tiny_model_dirs, models_config=config, drain_seconds=1, test_load_seconds=LOAD_SECONDS)
    settings["shared_step_ms"] = 1  # a paced prefill step: the pacer's floor, 8 tokens, never more
    del settings["model"]  # the file names every model; the first is the default
    server = GunicornServer(settings, "--graceful-timeout", "10").wait_ready()
    (server.first_worker,) = server.worker_pids()
    server.threads_at_ready = thread_ids(server.first_worker)
    yield server
    server.stop()


def thread_ids(pid: int) -> set[int]:
    return {thread.id for thread in psutil.Process(pid).threads()}


def greedy(llm, max_tokens: int) -> str:
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens))[0].text


def test_models_lists_every_model_with_its_state(models_server):
    models_server.wait_for_log(r"broken: model failed to load")  # its text side, built once the first model serves
    sdk = openai.OpenAI(base_url=f"{models_server.url}/v1", api_key="x", max_retries=0)
    listed = {m.id: m for m in sdk.models.list().data}
    assert list(listed) == ["tiny", "smollm2", "minilm", "broken"]
    assert listed["tiny"].state == "loaded" and listed["tiny"].max_model_len > 0
    assert {listed[name].state for name in ("smollm2", "minilm")} == {"unloaded"}  # loaded on demand
    # its text side failed as the worker started: so would its load (it was "unloaded" until a request)
    assert listed["broken"].state == "failed" and "model failed to load" in listed["broken"].failure
    assert [listed[name].task for name in listed] == ["generate", "generate", "embed", "generate"]  # known unloaded
    assert sdk.models.retrieve("tiny-alias").id == "tiny"  # an alias names its model
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.completions.create(model="gpt-5", prompt=PROMPT, max_tokens=2)
    error = missing.value.body
    assert error["code"] == "model_not_found" and all(repr(n) in error["message"] for n in listed)


def test_streams_on_two_models_equal_each_alone_and_a_load_stalls_neither(models_server, tiny_llama, packed_llm):
    """A tiny stream runs through SmolLM2's load on demand (its first request, from the moment it is asked for to
    its first token: longer than LOAD_SECONDS), its tokens never further apart than the bound. Then both models
    stream at once, each greedy text equal to that model's own engine."""
    running = Stream("tiny", ENDLESS).run(models_server)
    assert running.started.wait(60)
    asked = time.monotonic()
    smollm2 = Stream("smollm2", 24).run(models_server).join()  # waits for the load, then streams
    loaded_at = smollm2.arrivals[0]
    running.stop.set()
    running.join()
    assert loaded_at - asked > LOAD_SECONDS
    first = max(i for i, at in enumerate(running.arrivals) if at < asked)  # the stream spans the whole load
    last = min(i for i, at in enumerate(running.arrivals) if at > loaded_at)
    spanning = running.arrivals[first : last + 1]
    during = [b - a for a, b in zip(spanning, spanning[1:])]
    print(f"while SmolLM2 loaded ({loaded_at - asked:.1f} s): {len(during)} tiny tokens, the largest gap "
          f"{max(during) * 1e3:.0f} ms")  # fmt: skip
    assert max(during) < LOAD_GAP_SECONDS

    both = [Stream("tiny", 40).run(models_server), Stream("smollm2", 40).run(models_server)]
    tiny, small = (s.join() for s in both)
    assert tiny.text == greedy(tiny_llama, 40) and small.text == greedy(packed_llm, 40)
    assert smollm2.text == greedy(packed_llm, 24)
    with models_server.client() as http:
        default = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
    assert default["model"] == "tiny" and default["choices"][0]["text"] == greedy(tiny_llama, 8)


def test_a_long_prompt_on_one_model_comes_in_paced_chunks_beside_another_models_stream(models_server):
    """The engine thread steps one model at a time, so a stream on the tiny model waits for each of SmolLM2's
    steps: SmolLM2 reads a prompt longer than a step's 512 tokens in paced chunks while the stream runs (8 tokens
    at most here), where alone its first chunk would take the whole budget."""
    with models_server.client(timeout=120) as http:
        assert http.post("/v1/completions", json={"model": "smollm2", "prompt": PROMPT}).status_code == 200  # loaded
    body = {"model": "smollm2", "prompt": "word " * 600, "max_tokens": 1}
    answer, steps, over_8 = prompt_beside_stream(models_server, "tiny", body, "smollm2", 8)
    assert answer.status_code == 200, answer.text
    prompt_tokens = answer.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 512 and over_8 == 0 and steps >= prompt_tokens / 8


def test_embeddings_beside_generation(models_server):
    """MiniLM embeds (loaded for it) while the tiny model streams: the stream's tokens come before, during and after
    the embedding's request, so the two did overlap. A chat sent to it first is refused without loading it."""
    running = Stream("tiny", ENDLESS).run(models_server)
    assert running.started.wait(60)
    with models_server.client(timeout=120) as http:
        wrong = http.post(
            "/v1/chat/completions", json={"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}
        )
        state_after_wrong = http.get("/v1/models/minilm").json()["state"]
        sent = time.monotonic()
        embedded = http.post("/v1/embeddings", json={"model": "minilm", "input": ["a cat", "a dog"]})
        answered = time.monotonic()
        running.started.clear()
        assert running.started.wait(60)  # a token after the answer
    running.stop.set()
    running.join()
    assert running.arrivals[0] < sent and any(sent < at < answered for at in running.arrivals)
    assert embedded.status_code == 200, embedded.text
    vectors = np.array([item["embedding"] for item in embedded.json()["data"]])
    assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_model_task"
    assert state_after_wrong == "unloaded"  # the route was wrong: nothing to load


def test_a_responses_chain_keeps_its_model(models_server):
    with models_server.client(timeout=120) as http:
        first = http.post("/v1/responses", json={"model": "smollm2", "input": "Hi", "max_output_tokens": 4})
        assert first.status_code == 200 and first.json()["model"] == "smollm2"
        body = {"previous_response_id": first.json()["id"], "input": "And then?", "max_output_tokens": 4}
        follow = http.post("/v1/responses", json=body)  # names no model: the chain's, not the default
    assert follow.status_code == 200 and follow.json()["model"] == "smollm2"


def test_a_model_that_fails_to_load_fails_alone(models_server):
    with models_server.client(timeout=120) as http:
        failed = http.post("/v1/completions", json={"model": "broken", "prompt": PROMPT, "max_tokens": 2})
        served = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        described = http.get("/v1/models/broken").json()
        health = http.get("/health")
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "model_load_failed"
    assert "model failed to load" in failed.json()["error"]["message"]
    assert described["state"] == "failed" and described["failure"] in failed.json()["error"]["message"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
    assert health.status_code == 200 and health.json()["models"]["broken"] == "failed"


def test_metrics_carry_each_models_name(models_server):
    """A request to each model moves that model's own series, whatever ran before (alone, the test passes too): a
    stream an earlier test left generates until its heartbeat finds no reader, so every model is idle first."""
    running = "wsgi_infer:num_requests_running"
    for name in ("tiny", "smollm2"):
        wait_until(lambda name=name: models_server.metrics(name).get(running) == 0, f"{name} idle", 60)
    before, usages = httpx.get(f"{models_server.url}/metrics", timeout=10).text, {}
    with models_server.client() as http:
        for name in ("tiny", "smollm2"):
            body = {"model": name, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
            usages[name] = http.post("/v1/completions", json=body).json()["usage"]
        usages["minilm"] = http.post("/v1/embeddings", json={"model": "minilm", "input": PROMPT}).json()["usage"]
    after = httpx.get(f"{models_server.url}/metrics", timeout=10).text
    for name, usage in usages.items():
        earlier, now = parse_metrics(before, name), parse_metrics(after, name)
        keys = ("wsgi_infer:prompt_tokens_total", "wsgi_infer:generation_tokens_total")
        grew = [now[key] - earlier.get(key, 0) for key in keys]
        assert grew == [usage["prompt_tokens"], 0 if name == "minilm" else 3], name


def test_the_chat_page_picks_a_model(browser, models_server, packed_llm):
    """The picker lists the models that generate (not the encoder), the default first; the chosen one answers."""
    page = browser.new_page(bypass_csp=True)  # the page's CSP refuses Playwright's string predicates (eval)
    try:
        page.goto(models_server.url + "/")
        page.wait_for_function("document.getElementById('model').options.length === 3")
        options = page.eval_on_selector_all("#model option", "options => options.map(o => o.value)")
        assert options == ["tiny", "smollm2", "broken"] and page.input_value("#model") == "tiny"
        page.select_option("#model", "smollm2")
        page.fill("#max_tokens", "12")
        page.fill("#temperature", "0")
        page.fill("#prompt", "What is the capital of France?")
        page.click("#send")
        page.wait_for_function("document.querySelector('.assistant:not(.streaming)') !== null")
        question = [{"role": "user", "content": "What is the capital of France?"}]
        expected = packed_llm.chat(question, SamplingParams(temperature=0, max_tokens=12))[0].text
        assert page.text_content(".assistant") == expected
    finally:
        page.close()


def test_every_thread_a_worker_keeps_runs_once_it_is_ready(models_server):
    """After every model loaded, embeddings, a constraint's grammar vocabulary built and a long prompt's parallel
    attention, the worker runs no thread it did not run when it said ready (the loads' threads end): the steps'
    OpenMP team, the front-end threads and scipy's BLAS threads (transformers' modeling_utils) start before."""
    with models_server.client(timeout=120) as http:
        assert http.post("/v1/embeddings", json={"model": "minilm", "input": ["a cat"]}).status_code == 200
        long = {"prompt": "a cat and a dog " * 60, "max_tokens": 4, "response_format": {"type": "json_object"}}
        for body in ({"model": "tiny"} | long, {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}):
            assert http.post("/v1/completions", json=body).status_code == 200, body
    assert models_server.worker_pids() == [models_server.first_worker]
    started_since = lambda: thread_ids(models_server.first_worker) - models_server.threads_at_ready  # noqa: E731
    wait_until(lambda: not started_since(), "no thread but the loads' started since the worker was ready", 10)


def test_a_reload_ends_every_models_streams_and_the_new_worker_serves_them_all(models_server):
    """SIGHUP: the old worker drains (1 s), its streams on both models end with their terminal event; the new
    worker loads its models as the old one did (the first at start, SmolLM2 on its first request)."""
    (old_worker,) = models_server.worker_pids()
    streams = [Stream("tiny", ENDLESS).run(models_server), Stream("smollm2", LONG).run(models_server)]
    assert all(s.started.wait(60) for s in streams)
    mark = len(models_server.lines)
    models_server.process.send_signal(signal.SIGHUP)
    models_server.wait_for_log(r"engine ready: serving tiny", after=mark)  # the new worker's first model
    for stream in streams:
        stream.join()
        assert stream.last["error"]["code"] == "server_shutting_down", stream.model
    with models_server.client(timeout=120) as http:
        for name in ("tiny", "smollm2", "minilm"):
            route, body = (
                ("/v1/embeddings", {"input": "hi"}) if name == "minilm" else ("/v1/completions", {"prompt": "Hi"})
            )
            assert http.post(route, json={"model": name, **body}).status_code == 200, name
    assert old_worker not in models_server.worker_pids()


def test_sigterm_ends_the_streams_of_every_model_and_the_requests_waiting_for_a_load(models_server):
    """Last: it stops the module's server. A request waiting for a model's load (LOAD_SECONDS) is told the server
    shuts down at once: it waited its load-wait time, and the worker with it, then was told the model had not
    loaded (30 s, the drain having counted no open request)."""
    endless = [Stream("tiny", ENDLESS).run(models_server), Stream("smollm2", LONG).run(models_server)]
    assert all(s.started.wait(60) for s in endless)
    with models_server.client() as http:
        http.post("/v1/models/minilm/unload")
    with ThreadPoolExecutor(1) as pool:
        embedding = {"model": "minilm", "input": PROMPT}
        waiting = pool.submit(lambda: models_server.client(timeout=60).post("/v1/embeddings", json=embedding))
        models = f"{models_server.url}/v1/models/minilm"
        wait_until(lambda: httpx.get(models).json()["state"] == "loading", "minilm loading")
        stopped_at = time.monotonic()
        models_server.process.terminate()
        for stream in endless:
            stream.join()
            assert stream.last["error"]["code"] == "server_shutting_down", stream.model
        told = waiting.result()
    assert time.monotonic() - stopped_at < LOAD_SECONDS and told.status_code == 503, told.text
    assert told.json()["error"]["code"] == "server_shutting_down" and told.headers["retry-after"] == "1"
    assert models_server.process.wait(30) == 0
