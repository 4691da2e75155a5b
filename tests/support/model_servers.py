"""Servers of several models (a models table), and streams read on a thread beside them: the model tests' own."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from ..conftest import tiny_settings
from .server import LOOPBACK_TLS, GunicornServer, labelled_samples
from .sse_client import events

PROMPT = "The capital of France is"
LONG = 4000  # tokens that outlast a test step (EOS ignored), within SmolLM2's window


def serving(folder, tiny_model_dirs, tables: str, **settings) -> Iterator[GunicornServer]:
    """A module's server of the models ``tables`` name (the tiny models' settings besides), stopped after it."""
    config = folder / "models.toml"
    config.write_text(tables)
    merged = tiny_settings(tiny_model_dirs, models_config=config, **settings)
    del merged["model"]  # the file names every model
    server = GunicornServer(merged).wait_ready()
    yield server
    server.stop()


@dataclass
class Stream:
    """A completion streamed on a thread: its text, and when each token event came."""

    model: str
    max_tokens: int
    text: str = ""
    arrivals: list[float] = field(default_factory=list)
    last: dict = field(default_factory=dict)  # the last data event's JSON ([DONE] aside)
    started: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)  # set: the reader leaves at its next token
    thread: threading.Thread | None = None

    def run(self, server: GunicornServer) -> Stream:
        self.thread = threading.Thread(target=self._read, args=(server,), daemon=True)
        self.thread.start()
        return self

    def _read(self, server: GunicornServer) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        body["ignore_eos"] = self.max_tokens >= LONG
        with server.client(timeout=120) as http, http.stream("POST", "/v1/completions", json=body) as r:
            for event in events(r):
                if not event.data or event.data == "[DONE]":
                    continue
                self.last = event.json
                if event.name is None and self.last["choices"]:
                    self.arrivals.append(time.monotonic())
                    self.text += self.last["choices"][0]["text"]
                    self.started.set()
                if self.stop.is_set():
                    return

    def join(self) -> Stream:
        self.thread.join(120)
        assert not self.thread.is_alive()
        return self


def engine_steps(server: GunicornServer, model: str, above: int) -> tuple[float, float]:
    """``model``'s engine steps so far, and those that computed more than ``above`` tokens (a bucket's bound of
    ``wsgi_infer:iteration_tokens_total``)."""
    text = httpx.get(f"{server.url}/metrics", verify=LOOPBACK_TLS).text
    buckets = labelled_samples(text, "wsgi_infer:iteration_tokens_total_bucket", model)
    steps = buckets[(("le", "+Inf"),)]
    return steps, steps - buckets[(("le", f"{float(above)}"),)]


def prompt_beside_stream(
    server: GunicornServer, streaming: str, body: dict, model: str, above: int
) -> tuple[httpx.Response, float, float]:
    """``body`` posted while ``streaming`` streams (EOS ignored; a token after the answer shows it still runs): the
    answer, ``model``'s engine steps meanwhile, and those of them that computed more than ``above`` tokens."""
    running = Stream(streaming, LONG).run(server)
    assert running.started.wait(60)
    before = engine_steps(server, model, above)
    with server.client(timeout=120) as http:
        answer = http.post("/v1/completions", json=body)
    running.started.clear()
    assert running.started.wait(60)
    running.stop.set()
    running.join()
    steps, over = (after - earlier for after, earlier in zip(engine_steps(server, model, above), before))
    return answer, steps, over


def completion_body(prompt: str | list[int], max_tokens: int, **extra) -> dict:
    """A greedy streamed completion."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}


def assert_idle(server: GunicornServer) -> None:
    """Nothing open, running or waiting, and every KV block free."""
    metrics = server.metrics()
    assert metrics["wsgi_infer:open_streams"] == 0
    assert metrics["wsgi_infer:num_requests_running"] == 0
    assert metrics["wsgi_infer:num_requests_waiting"] == 0
    assert metrics["wsgi_infer:kv_blocks_free"] == metrics["wsgi_infer:kv_blocks_total"]
