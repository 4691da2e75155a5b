"""A model's text side, its tokenizer built as the worker starts and its grammar vocabulary by its first constrained
request, outlives its unload, on a real server: a model of a 262,144-token vocabulary loads for the first time,
answers its first constrained request, loads again, and answers one again, while another model's stream never waits
long between tokens. Built during a load, that tokenizer would hold the GIL for about a second (tokenizers builds it
without releasing it) and every stream would wait; llguidance's view of it is built through its C interface, which
holds none (its Python binding held it for one and a half)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from functools import partial

import httpx
import pytest

from wsgi_infer.engine.loading.model_loader import load_tokenizer
from wsgi_infer.engine.sampling.grammar import GrammarCompiler

from ..conftest import save_tiny_model
from ..support.model_servers import Stream, serving
from ..support.server import ENDLESS, wait_until
from ..support.warm_starts import dying_with_this_process

pytestmark = pytest.mark.slow  # a real server

LARGE_VOCABULARY = 262_144  # Gemma 3's
# The running stream's bound; issue 63 asks 150 ms of a quiet machine (BENCHMARKS.md's probe). Here the test shares
# two cores with another test process: the largest gaps were 18-51 ms on a quiet Xeon and 473 ms in a clean-clone CI
# run; a text side built during a load held them 1,087 ms (planted, WSGI_INFER_TEXT_SIDES_AT_START=false), and the
# grammar vocabulary's Python binding 1.6-2.1 s. Beside a busy process as well (three runnable threads and another
# test process on two cores) the gaps are the scheduler's (907 and 1,426 ms in clean-clone CI runs, 2026-12-07):
# that test bounds the build's time, and a model of its own is first compiled beside the stream alone.
GAP_SECONDS = 0.75
SCHEMA = {"type": "object", "properties": {"open": {"type": "boolean"}}, "required": ["open"]}
SCHEMA["additionalProperties"] = False  # a short answer, whatever the random weights favour


@pytest.fixture(scope="module")
def large_vocabulary_dir(tmp_path_factory, default_model_dir):
    """A tiny Llama for the default tokenizer grown to 262,144 tokens: each new one two older ones merged."""
    tokenizer = load_tokenizer(default_model_dir)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    pieces = list(vocab)[200:1000]
    grown = ((a, b) for a in pieces for b in pieces if a + b not in vocab)
    while len(vocab) < LARGE_VOCABULARY:
        a, b = next(grown)
        vocab[a + b] = len(vocab)
        merges.append([a, b])
    path = tmp_path_factory.mktemp("large-vocabulary")
    tokenizer.save_pretrained(path)
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return save_tiny_model("llama", load_tokenizer(path), path)


@pytest.fixture(scope="module")
def second_large_vocabulary_dir(tmp_path_factory, large_vocabulary_dir):
    """Another model of it, whose first compile builds its own grammar vocabulary."""
    return shutil.copytree(large_vocabulary_dir, tmp_path_factory.mktemp("large-vocabulary"), dirs_exist_ok=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dirs, large_vocabulary_dir, second_large_vocabulary_dir):
    tables = f"""
[models.tiny]
path = "{tiny_model_dirs["llama"]}"
[models.large]
path = "{large_vocabulary_dir}"
[models.crowded]
path = "{second_large_vocabulary_dir}"
"""
    for server in serving(tmp_path_factory.mktemp("text-sides"), tiny_model_dirs, tables):
        server.ready_line = first_ready_line(server)
        yield server


def first_ready_line(server) -> int:
    """The log line of the first /health that says ready, asked from the moment the first model serves."""
    after = len(server.lines)
    wait_until(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 200, "/health says ready")
    return server.wait_for_line(r'"GET /health HTTP/1.1" 200', after=after)[0]


def constrained(server, model: str) -> dict:
    """A chat answer in SCHEMA: its first compile builds the model's grammar vocabulary."""
    response_format = {"type": "json_schema", "json_schema": {"name": "open", "schema": SCHEMA}}
    body = {"model": model, "messages": [{"role": "user", "content": "Open?"}], "max_tokens": 48}
    body |= {"temperature": 0, "response_format": response_format}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def completion(server, model: str) -> dict:
    body = {"model": model, "prompt": "Open", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def unload(server, model: str) -> None:
    mark = len(server.lines)
    r = httpx.post(f"{server.url}/v1/models/{model}/unload", timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "unloaded", r.text
    server.wait_for_log(rf"model {model} freed", after=mark)


def beside_a_stream(
    server, action: Callable[[], dict], what: str, built: str, bound: float | None = GAP_SECONDS
) -> dict:
    """``action``'s answer, while a tiny model's stream runs: which never waits ``bound`` for a token (None: no
    bound, the stream only keeps the other core busy); and ``built``, the large model's log line of what ``action``
    built or took (its text side, kept from its last load or built at start; its grammar vocabulary)."""
    running = Stream("tiny", ENDLESS).run(server)
    assert running.started.wait(60)
    mark, asked = len(server.lines), time.monotonic()
    answer = action()
    answered = time.monotonic()
    running.stop.set()
    running.join()
    spanning = [at for at in running.arrivals if asked <= at <= answered]
    assert len(spanning) >= 10  # the stream ran through the load
    gaps = [b - a for a, b in zip(spanning, spanning[1:])]
    print(f"{what}: {answered - asked:.2f} s, {len(spanning)} tiny tokens, the largest gap {max(gaps) * 1e3:.0f} ms")
    assert bound is None or max(gaps) < bound
    server.wait_for_log(rf"large-vocabulary\w*: {built}", after=mark)
    return answer


def test_the_worker_builds_the_text_side_of_a_model_it_has_not_loaded(server):
    """As it starts (before /health says ready: ``EngineManager._preloads_settled``), not at the model's load."""
    built, _ = server.wait_for_line(r"large: its text side built ahead of its load")
    assert built < server.ready_line, server.lines[built - 2 : server.ready_line + 2]
    r = httpx.get(f"{server.url}/v1/models/large", timeout=10)
    assert r.json()["state"] == "unloaded"


def test_a_first_load_stalls_no_stream(server):
    answer = beside_a_stream(server, lambda: completion(server, "large"), "first load", "its text side kept")
    assert answer["usage"]["completion_tokens"] == 8


def test_a_first_constrained_request_stalls_no_stream(server):
    """Its compile builds llguidance's view of the 262,144 tokens (about a second) beside the running stream."""
    answer = beside_a_stream(server, partial(constrained, server, "large"), "first compile", "llguidance's vocab")
    assert isinstance(json.loads(answer["message"]["content"])["open"], bool)


def test_a_first_constrained_request_does_not_wait_on_a_busy_neighbour(server, second_large_vocabulary_dir):
    """Beside a busy process and a stream (both cores taken), the build runs at the engine's priority, in about the
    time the same build takes in this process beside them (on the front-end thread, at nice 10, it got a tenth of a
    core: 17-24 s against 3.3 s, Xeon)."""
    hog = subprocess.Popen(dying_with_this_process(["sh", "-c", "while :; do :; done"]))
    try:
        started = time.monotonic()
        GrammarCompiler(load_tokenizer(second_large_vocabulary_dir), LARGE_VOCABULARY).vocabulary()
        here = time.monotonic() - started
        ask = partial(constrained, server, "crowded")
        answer = beside_a_stream(server, ask, "first compile beside a busy process", "llguidance's vocab", None)
    finally:
        hog.kill()
        hog.wait()
    assert isinstance(json.loads(answer["message"]["content"])["open"], bool)
    name = second_large_vocabulary_dir.name
    built = server.wait_for_log(rf"{name}: llguidance's vocabulary built in ([\d.]+) s")
    print(f"the vocabulary built in {built.group(1)} s in the server, {here:.2f} s here (with its tokenizer's load)")
    assert float(built.group(1)) < 3 * here + 1


def test_a_reload_keeps_the_text_side_and_stalls_no_stream(server):
    first = constrained(server, "large")  # its grammar vocabulary: built once
    unload(server, "large")
    again = beside_a_stream(server, lambda: constrained(server, "large"), "reload and compile", "its text side kept")
    assert again["message"]["content"] == first["message"]["content"]
    assert isinstance(json.loads(first["message"]["content"])["open"], bool)
