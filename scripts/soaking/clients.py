"""The soak's client loops: each sends requests back to back, drawn at random (seeded, so a run repeats), to the
models in use at the time, and checks every answer against its model's references."""

from __future__ import annotations

import math
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import httpx

from .references import MAX_LENGTH, PATHS, ModelReferences, Reference, answer_of, bad_requests, mismatch
from .streams import Failed, Hung, Stats, StreamRead, choice_text, expect_ok, read_stream, retry_code

# How often a client loop sends each kind of request to a generating model (an embedding model gets embeddings).
# Loop i starts with kind i (mod 8), so even a short run has each.
KIND_WEIGHTS = {
    "greedy": 10,
    "greedy_stream": 7,
    "disconnect": 2,
    "resume": 2,
    "sampled_n": 3,
    "bad_request": 2,
    "structured": 2,
    "tools": 2,
}
MAX_CUT_AFTER = 32  # a cut stream is dropped after 1 to this many events
MAX_RETRIES = 10
# An encoder run through transformers pads its batch: the shapes of its products change with the batch and so does
# float32's rounding (the soak measured up to 1.2e-7, a few units in the last place); a wrong input is off by 0.1.
EMBEDDING_TOLERANCE = 1e-6


def draw_length(rng: random.Random, limit: int) -> int:
    """Log-uniform over 1..MAX_LENGTH, so short requests dominate; at most ``limit``."""
    return max(1, min(limit, int(math.exp(rng.uniform(0, math.log(MAX_LENGTH + 1))))))


@dataclass
class LoadContext:
    """What every client loop shares."""

    url: str
    models: list[ModelReferences]  # in the order the churn visits them
    stats: Stats
    stop: threading.Event
    request_timeout: float
    seed: int
    in_use: int  # how many models take requests at a time (all of them: no churn)
    churn_seconds: float  # every this often the models in use move one along the list
    started: float = 0.0  # monotonic time the load began
    reload_sent_at: float | None = None  # monotonic time of the SIGHUP, once sent
    reload_done_at: float | None = None  # and of the old workers' exit, once they are gone

    def models_in_use(self) -> list[ModelReferences]:
        shift = int((time.monotonic() - self.started) / self.churn_seconds) if self.churn_seconds else 0
        return [self.models[(shift + i) % len(self.models)] for i in range(self.in_use)]

    def reloading(self, started: float) -> bool:
        """Whether a request sent at ``started`` may meet the reload: until the old workers exit, both answer
        requests (a draining one on its connections kept alive). Only then may it be told the server is shutting
        down, or be resumed by a worker that never saw its stream. (A stream begun after the SIGHUP was resumed 7 s
        after it, while the old worker drained for 13 s: not found, CI, 2026-12-04.)"""
        return self.reload_sent_at is not None and (self.reload_done_at is None or started < self.reload_done_at)


class ClientLoop(threading.Thread):
    """One client sending requests back to back until the load stops; ``kind`` is the current one."""

    def __init__(self, index: int, ctx: LoadContext) -> None:
        super().__init__(name=f"client-{index}", daemon=True)
        self.ctx = ctx
        self.index = index
        self.rng = random.Random(ctx.seed * 10_000 + index)
        self.kind = "idle"
        self.current = ""  # what the request in flight asked for, for the report of a hang
        self.model = ctx.models[0]  # the model of the request in flight

    def run(self) -> None:
        send = {
            "greedy": self._greedy,
            "greedy_stream": partial(self._stream, cut=False, resume=False),
            "disconnect": partial(self._stream, cut=True, resume=False),
            "resume": partial(self._stream, cut=True, resume=True),
            "sampled_n": self._sampled_n,
            "bad_request": self._bad_request,
            "structured": self._fixed,
            "tools": self._fixed,
            "embedding": self._embedding,
        }
        kinds, weights = zip(*KIND_WEIGHTS.items())
        first = kinds[self.index % len(kinds)]
        with httpx.Client(base_url=self.ctx.url) as http:
            while not self.ctx.stop.is_set():
                self.model = self.rng.choice(self.ctx.models_in_use())
                if self.model.task == "embed":
                    self.kind = "embedding"
                else:
                    self.kind, first = first or self.rng.choices(kinds, weights)[0], None
                try:
                    send[self.kind](http)
                except (Hung, httpx.TimeoutException) as exc:
                    self.ctx.stats.fail(self.kind, "hung", f"{self.current}: {exc!r}")
                except Failed as exc:
                    self.ctx.stats.fail(self.kind, exc.category, exc.detail)
                except httpx.TransportError as exc:
                    self.ctx.stats.fail(self.kind, "transport", repr(exc))
                except Exception as exc:  # a malformed answer: counted, and the loop goes on
                    self.ctx.stats.fail(self.kind, "client_error", repr(exc))
        self.kind = "done"

    @contextmanager
    def _open(self, http: httpx.Client, method: str, path: str, **kwargs):
        """The response, read lazily and closed on exit. Sent again while the server asks for it
        (503 + Retry-After during the reload) or closed a kept-alive connection without an answer."""
        timeout = httpx.Timeout(self.ctx.request_timeout, connect=10.0)
        for _ in range(MAX_RETRIES):
            sent = time.monotonic()
            try:
                response = http.send(http.build_request(method, path, timeout=timeout, **kwargs), stream=True)
            except httpx.RemoteProtocolError:
                self.ctx.stats.retry("connection closed before an answer")
                continue
            try:
                code = retry_code(response)
                if code is None:
                    yield response
                    return
            finally:
                response.close()
            if code == "server_shutting_down" and not self.ctx.reloading(sent):
                raise Failed("shutting_down_outside_reload", f"{method} {path}: 503 {code}")
            self.ctx.stats.retry(f"503 {code}")
            time.sleep(min(5.0, float(response.headers["retry-after"])))  # as the server asked
        raise Failed("retries_exhausted", f"{method} {path}: still refused after {MAX_RETRIES} tries")

    def _pick(self, shortest: int = 1) -> tuple[Reference, int]:
        ref = self.rng.choice(self.model.greedy[self.rng.choice(list(PATHS))])
        length = max(draw_length(self.rng, ref.limit), min(shortest, ref.limit))
        self.current = f"{ref.model} {ref.api} {ref.prompt!r} max_tokens={length}"
        return ref, length

    def _greedy(self, http: httpx.Client) -> None:
        ref, length = self._pick()
        self.kind = ref.api
        with self._open(http, "POST", PATHS[ref.api], json=ref.body(length, stream=False)) as response:
            expect_ok(response, ref.api)
            body = response.read() and response.json()
        text = choice_text(ref.api, body["choices"][0], streamed=False)
        if body["usage"]["completion_tokens"] != length or text != ref.expected(length):
            raise mismatch(ref, length, text, body["usage"])
        self.ctx.stats.record(self.kind, greedy_checked=True)

    def _stream(self, http: httpx.Client, cut: bool, resume: bool) -> None:
        """A greedy stream read to the end, or cut after k events (and then maybe resumed)."""
        ref, length = self._pick(shortest=8 if cut else 1)  # a few tokens at least, to cut
        cut_after = self.rng.randint(1, max(1, min(length // 2, MAX_CUT_AFTER))) if cut else 0
        if not cut:
            self.kind = f"{ref.api}_stream"
        started = time.monotonic()
        deadline = started + self.ctx.request_timeout
        body = ref.body(length, stream=True)
        with self._open(http, "POST", PATHS[ref.api], json=body) as response:
            expect_ok(response, self.kind)
            # Leaving the block after the cut drops the connection.
            read = read_stream(response, ref.api, 0, cut_after, deadline, self.ctx.stats.add_gap)
        if not cut or read.done or read.error_code or read.data_events < cut_after:
            self.kind = f"{ref.api}_stream"  # it ended before the cut
            self._check_stream(ref, length, read, started)
        elif not resume:
            if not ref.expected(length).startswith(read.texts[0]):
                raise mismatch(ref, length, read.texts[0], None)
            self.ctx.stats.record("disconnect")
        else:
            self._resume(http, ref, length, read, started, deadline)

    def _resume(
        self, http: httpx.Client, ref: Reference, length: int, cut: StreamRead, started: float, deadline: float
    ) -> None:
        headers = {"Last-Event-ID": str(cut.last_id)}
        path = f"/v1/streams/{cut.stream_id}"
        with self._open(http, "GET", path, headers=headers) as response:
            if response.status_code == 404 and self.ctx.reloading(started):
                # Logs are kept in the worker's memory: a new worker cannot know an old one's stream.
                self.ctx.stats.record("resume", "lost_to_reload")
                return
            expect_ok(response, "resume")
            rest = read_stream(response, ref.api, cut.last_id, 0, deadline, self.ctx.stats.add_gap)
        rest.texts[0] = cut.texts[0] + rest.texts[0]
        rest.usage = rest.usage or cut.usage  # a cut after the usage chunk leaves only [DONE] to resume
        self._check_stream(ref, length, rest, started)

    def _check_stream(self, ref: Reference, length: int, read: StreamRead, started: float) -> None:
        """The whole text equals the reference; a stream the reload ended holds a prefix of it."""
        text = read.texts[0]
        if not ref.expected(length).startswith(text):
            raise mismatch(ref, length, text, read.usage)
        if self._interrupted_by_reload(read, started):
            return
        if read.error_code is not None:
            raise Failed("stream_error", f"{self.kind} stream {read.stream_id} ended with error {read.error_code}")
        if not read.done:
            raise Failed("protocol", f"{self.kind} stream {read.stream_id} ended without [DONE] or an error event")
        if (read.usage or {}).get("completion_tokens") != length or text != ref.expected(length):
            raise mismatch(ref, length, text, read.usage)
        self.ctx.stats.record(self.kind, greedy_checked=True)

    def _interrupted_by_reload(self, read: StreamRead, started: float) -> bool:
        """A stream the server ended as it shut down: counted if the reload may have, else a failure."""
        if read.error_code != "server_shutting_down":
            return False
        if not self.ctx.reloading(started):
            raise Failed("shutting_down_outside_reload", f"{self.kind} stream {read.stream_id}")
        self.ctx.stats.record(self.kind, "interrupted_by_reload")
        return True

    def _sampled_n(self, http: httpx.Client) -> None:
        """n = 2..4 sampled choices (temperature 0.8, a seed), streamed or not: all n, all full length."""
        ref, length = self._pick()
        n, stream = self.rng.randint(2, 4), self.rng.random() < 0.5
        self.current += f" n={n} stream={stream}"
        body = {**ref.body(length, stream), "temperature": 0.8, "seed": self.rng.randrange(1 << 31), "n": n}
        self.kind = "sampled_n"
        started = time.monotonic()
        deadline = started + self.ctx.request_timeout
        with self._open(http, "POST", PATHS[ref.api], json=body) as response:
            expect_ok(response, self.kind)
            if stream:
                read = read_stream(response, ref.api, 0, 0, deadline)  # choices interleave: no ITL
                indices, usage = set(read.texts), read.usage
            else:
                answer = response.read() and response.json()
                indices, usage = {c["index"] for c in answer["choices"]}, answer["usage"]
        if stream and self._interrupted_by_reload(read, started):
            return
        if stream and (read.error_code or not read.done):
            raise Failed("protocol", f"n={n} stream {read.stream_id}: error {read.error_code}, done {read.done}")
        if indices != set(range(n)) or (usage or {}).get("completion_tokens") != n * length:
            raise Failed("protocol", f"n={n} max_tokens={length}: choices {sorted(indices)}, usage {usage}")
        self.ctx.stats.record(self.kind)

    def _bad_request(self, http: httpx.Client) -> None:
        method, path, body, status = self.rng.choice(bad_requests(self.model))
        self.current = f"{method} {path} {body!r}"
        if isinstance(body, bytes):
            kwargs = {"content": body, "headers": {"Content-Type": "application/json"}}
        else:
            kwargs = {} if body is None else {"json": body}
        with self._open(http, method, path, **kwargs) as response:
            response.read()
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = None
        if response.status_code != status or not isinstance(error, dict) or "message" not in error:
            category = "5xx" if response.status_code >= 500 else "bad_request_answer"
            raise Failed(category, f"{method} {path} {body!r}: {response.status_code} {response.text[:300]}")
        self.ctx.stats.record("bad_request")

    def _fixed(self, http: httpx.Client) -> None:
        """A structured output or a forced tool call: the whole answer equals the reference's."""
        request = next(r for r in self.model.fixed if r.kind == self.kind)
        self.current = f"{self.model.name} {self.kind}"
        with self._open(http, "POST", request.path, json=request.body) as response:
            expect_ok(response, self.kind)
            answer = answer_of(response.read() and response.json())
        if answer != request.expected:
            raise Failed("mismatch", f"{self.current}: {answer} != {request.expected}")
        self.ctx.stats.record(self.kind, greedy_checked=True)

    def _embedding(self, http: httpx.Client) -> None:
        """1 to 4 inputs in one request: each input's embedding equals its own, taken alone, within rounding."""
        inputs = self.rng.sample(list(self.model.embeddings), self.rng.randint(1, 4))
        self.current = f"{self.model.name} embeddings of {len(inputs)}"
        with self._open(http, "POST", "/v1/embeddings", json={"model": self.model.name, "input": inputs}) as response:
            expect_ok(response, self.kind)
            data = (response.read() and response.json())["data"]
        for text, item in zip(inputs, data, strict=True):
            worst = max(abs(a - b) for a, b in zip(item["embedding"], self.model.embeddings[text], strict=True))
            if worst > EMBEDDING_TOLERANCE:
                raise Failed("mismatch", f"{self.current}: {text!r} differs from its reference by up to {worst}")
        self.ctx.stats.record(self.kind, greedy_checked=True)
