"""A model's text side (tokenizer, grammar vocabulary) outlives its unload, on a real server: a model of a
262,144-token vocabulary loads again, and answers a constrained request again, while another model's stream never
waits long between tokens. Built again, that tokenizer holds the GIL for about a second and llguidance's view of it
for one and a half (tokenizers and llguidance build them without releasing it), and every stream waits."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from wsgi_infer.engine.loading.model_loader import load_tokenizer

from ..conftest import save_tiny_model
from ..support.model_servers import Stream, serving
from ..support.server import ENDLESS

pytestmark = pytest.mark.slow  # a real server

LARGE_VOCABULARY = 262_144  # Gemma 3's
GAP_SECONDS = 0.4  # the running stream's bound; issue 63 asks 150 ms of a quiet machine (BENCHMARKS.md's probe)
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
def server(tmp_path_factory, tiny_model_dirs, large_vocabulary_dir):
    tables = f"""
[models.tiny]
path = "{tiny_model_dirs["llama"]}"
[models.large]
path = "{large_vocabulary_dir}"
"""
    yield from serving(tmp_path_factory.mktemp("text-sides"), tiny_model_dirs, tables)


def constrained(server, model: str) -> dict:
    """A chat answer in SCHEMA: its first compile builds the model's grammar vocabulary."""
    response_format = {"type": "json_schema", "json_schema": {"name": "open", "schema": SCHEMA}}
    body = {"model": model, "messages": [{"role": "user", "content": "Open?"}], "max_tokens": 48}
    body |= {"temperature": 0, "response_format": response_format}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def unload(server, model: str) -> None:
    mark = len(server.lines)
    r = httpx.post(f"{server.url}/v1/models/{model}/unload", timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "unloaded", r.text
    server.wait_for_log(rf"model {model} freed", after=mark)


def test_a_reload_keeps_the_text_side_and_stalls_no_stream(server):
    first = constrained(server, "large")  # its first load, and its grammar vocabulary: both built once
    unload(server, "large")
    running = Stream("tiny", ENDLESS).run(server)
    assert running.started.wait(60)
    mark, asked = len(server.lines), time.monotonic()
    again = constrained(server, "large")  # loads it again, and compiles a grammar for it again
    answered = time.monotonic()
    running.stop.set()
    running.join()
    assert again["message"]["content"] == first["message"]["content"]
    assert isinstance(json.loads(first["message"]["content"])["open"], bool)
    spanning = [at for at in running.arrivals if asked <= at <= answered]
    assert len(spanning) >= 10  # the stream ran through the load and the compile
    gaps = [b - a for a, b in zip(spanning, spanning[1:])]
    print(f"reload and compile: {answered - asked:.2f} s, {len(spanning)} tiny tokens, the largest gap "
          f"{max(gaps) * 1e3:.0f} ms")  # fmt: skip
    assert max(gaps) < GAP_SECONDS
    server.wait_for_log(r"large-vocabulary\w*: its text side kept from its last load", after=mark)
