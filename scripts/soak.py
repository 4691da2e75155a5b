#!/usr/bin/env python
"""Soak test: mixed load on a real gunicorn for a chosen duration, with one SIGHUP reload half way.

Starts `gunicorn -c gunicorn.conf.py` itself (tests/support/server.py's GunicornServer) and runs
--concurrency client loops, each drawing at random (seeded, so a run repeats): greedy
/v1/completions and /v1/chat/completions, streamed or not, of 1 to 1,000 tokens (log-uniform,
so short ones dominate); sampled requests with n = 2..4; streams cut after k events, some of
them resumed with GET /v1/streams/<id> and Last-Event-ID; bad bodies that must get a 4xx JSON
error. Every greedy text is compared with its reference: each prompt is generated once at
start-up with logprobs, and the text of L tokens is the reference's first L token texts (less
a trailing incomplete character, which the server holds back; special tokens add no text). The
server runs in float32 by default: in bf16 on the CPU a request's greedy output changes with
the batch it shares (and with a prefix-cache hit), so no reference would hold. Half way it
sends SIGHUP to the master and waits for the new worker's log lines and for the old worker's exit.

Every --sample-every seconds it records the workers' RSS and open fds (summed), the
`wsgi_infer:greenlets` gauge (None where the server has no such gauge), KV blocks in use and
the client-side p99 inter-token latency of that window. At the end it stops the load, waits
(polling /metrics, with a deadline) for every KV block to be free and no request to be
running or waiting, stops the server, and writes OUT/soak.json, OUT/soak.png and
OUT/server.log. The 30-minute run of the default model (a KV cache that holds the load without
thrashing preemptions, and the 5% bound on RSS and fd drift):

    .venv/bin/python scripts/soak.py --duration 1800 --kv-cache-mb 1024 --max-drift 0.05 --out soak-out

Exit status 1 on any 5xx, hung client, greedy mismatch, other failed check, or KV blocks not
back to idle; also on RSS or fd drift above --max-drift when given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import sys
import threading
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support.server import GunicornServer  # noqa: E402
from tests.support.sse_client import events  # noqa: E402

MAX_LENGTH = 1000
SPECIAL_TOKEN = re.compile(r"<[^<>\s]+>")  # how a special token decodes alone; the text skips it
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
COMPLETION_PROMPTS = (
    "The quick brown fox",
    "Once upon a time",
    "In 1999,",
    "def main():",
    "Paris is",
    "The recipe for bread",
    "Dear committee,",
    "Water boils at",
)
CHAT_PROMPTS = ("What is the capital of France?", "Tell me a story.", "Write a haiku about rain.", "Explain TCP.")
# How often a client loop sends each kind of request. Loop i starts with kind i (mod 6), so even
# a short run has each.
KIND_WEIGHTS = {"greedy": 10, "greedy_stream": 7, "disconnect": 2, "resume": 2, "sampled_n": 3, "bad_request": 2}
MAX_CUT_AFTER = 32  # a cut stream is dropped after 1 to this many events
RETRYABLE_503 = ("server_shutting_down", "model_not_ready")  # what a client may retry during a reload
MAX_RETRIES = 10
IDLE_TIMEOUT_S = 60.0  # a cut stream nobody resumes is aborted after one heartbeat interval


class Hung(Exception):
    """A request that did not finish within --request-timeout."""


class Failed(Exception):
    """A check failed; ``category`` is how the summary counts it."""

    def __init__(self, category: str, detail: str) -> None:
        super().__init__(f"{category}: {detail}")
        self.category = category
        self.detail = detail


@dataclass
class Reference:
    """One prompt's greedy output of the longest length, with each token's text."""

    api: str  # "completion" or "chat"
    prompt: str
    text: str
    pieces: list[str]  # each token decoded alone, special tokens included
    prefixes: list[str] = field(init=False)  # prefixes[k]: the text of the first k tokens
    limit: int = field(init=False)  # lengths up to this have an exactly known text

    def __post_init__(self) -> None:
        self.prefixes, self.limit = [""], len(self.pieces)
        for k, piece in enumerate(self.pieces):
            text = self.prefixes[-1]
            if self.text.startswith(text + piece):
                text += piece
            elif "\ufffd" in piece or not SPECIAL_TOKEN.fullmatch(piece):
                # A character split over tokens decodes to U+FFFD token by token: the text of
                # lengths from here on is not known exactly.
                self.limit = k
                break
            # else a special token (with ignore_eos the model writes <|im_end|> and such): no text
            self.prefixes.append(text)

    def expected(self, length: int) -> str:
        """The text of ``length`` tokens: the server holds back a trailing undecodable piece."""
        k = length
        while k > 0 and self.prefixes[k].endswith("\ufffd"):
            k -= 1
        return self.prefixes[k]

    def body(self, length: int, stream: bool) -> dict:
        body = {**prompt_field(self.api, self.prompt), "max_tokens": length, "temperature": 0, "ignore_eos": True}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body


def prompt_field(api: str, prompt: str) -> dict:
    return {"prompt": prompt} if api == "completion" else {"messages": [{"role": "user", "content": prompt}]}


def choice_text(api: str, choice: dict, streamed: bool) -> str:
    if api == "completion":
        return choice.get("text") or ""
    return (choice.get("delta" if streamed else "message") or {}).get("content") or ""


def build_references(http: httpx.Client, max_model_len: int, parallel: int) -> dict[str, list[Reference]]:
    """Every prompt's reference, ``parallel`` at a time (greedy output does not depend on the batch)."""

    def one(api: str, prompt: str) -> Reference:
        count = http.post("/tokenize", json=prompt_field(api, prompt)).json()["count"]
        body = {**prompt_field(api, prompt), "max_tokens": min(MAX_LENGTH, max_model_len - count)}
        body.update(temperature=0, ignore_eos=True, logprobs=0 if api == "completion" else True)
        response = http.post(PATHS[api], json=body, timeout=600)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        if api == "completion":
            pieces = choice["logprobs"]["tokens"]
        else:
            pieces = [entry["token"] for entry in choice["logprobs"]["content"]]
        return Reference(api, prompt, choice_text(api, choice, streamed=False), pieces)

    jobs = [("completion", p) for p in COMPLETION_PROMPTS] + [("chat", p) for p in CHAT_PROMPTS]
    with ThreadPoolExecutor(parallel) as pool:
        refs = list(pool.map(lambda job: one(*job), jobs))
    return {api: [r for r in refs if r.api == api and r.limit > 0] for api in PATHS}


class Stats:
    """What the client loops saw, shared between them and the sampler."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: dict[str, Counter] = defaultdict(Counter)  # kind -> outcome -> count
        self.failures: list[dict] = []
        self.retried: Counter = Counter()  # why a request was sent again
        self.greedy_checked = 0  # greedy texts compared equal to their reference
        self.all_gaps = array("d")
        self._window: list[float] = []

    def record(self, kind: str, outcome: str = "ok", greedy_checked: bool = False) -> None:
        with self.lock:
            self.outcomes[kind][outcome] += 1
            self.greedy_checked += greedy_checked

    def fail(self, kind: str, category: str, detail: str) -> None:
        with self.lock:
            self.outcomes[kind]["failed"] += 1
            self.failures.append({"t": time.time(), "kind": kind, "category": category, "detail": detail[:2000]})

    def retry(self, reason: str) -> None:
        with self.lock:
            self.retried[reason] += 1

    def add_gap(self, gap: float) -> None:
        with self.lock:
            self._window.append(gap)
            self.all_gaps.append(gap)

    def take_window(self) -> list[float]:
        with self.lock:
            window, self._window = self._window, []
        return window

    def totals(self) -> tuple[int, int]:
        """Requests done and failed so far."""
        with self.lock:
            done = sum(sum(c.values()) for c in self.outcomes.values())
            return done, len(self.failures)


@dataclass
class StreamRead:
    """What one read of an SSE response saw."""

    stream_id: str
    last_id: int
    texts: dict[int, str] = field(default_factory=lambda: defaultdict(str))
    usage: dict | None = None
    done: bool = False
    error_code: str | None = None
    data_events: int = 0


def read_stream(
    response: httpx.Response, api: str, after: int, cut_after: int, deadline: float, on_gap: Callable | None = None
) -> StreamRead:
    """Read events numbered from ``after + 1`` on; return early after ``cut_after`` data events
    (0: never); fails on an event id out of sequence. ``on_gap`` gets the seconds between
    consecutive chunks that carry text, as they come."""
    read = StreamRead(response.headers.get("x-stream-id", ""), after)
    last_content = None
    for event in events(response):
        if time.monotonic() > deadline:
            raise Hung(f"stream {read.stream_id} still open at its deadline")
        if not event.data:
            continue  # a heartbeat
        if event.id != str(read.last_id + 1):
            raise Failed("protocol", f"event id {event.id} after {read.last_id} in stream {read.stream_id}")
        read.last_id += 1
        read.data_events += 1
        if event.name == "error":
            read.error_code = event.json["error"]["code"]
        elif event.data == "[DONE]":
            read.done = True
        else:
            chunk = event.json
            read.usage = chunk.get("usage") or read.usage
            pieces = [(c["index"], choice_text(api, c, streamed=True)) for c in chunk["choices"]]
            for index, text in pieces:
                read.texts[index] += text
            if on_gap is not None and any(text for _, text in pieces):
                now = time.monotonic()
                if last_content is not None:
                    on_gap(now - last_content)
                last_content = now
        if read.data_events == cut_after:
            break
    return read


def draw_length(rng: random.Random, limit: int) -> int:
    """Log-uniform over 1..MAX_LENGTH, so short requests dominate; at most ``limit``."""
    return max(1, min(limit, int(math.exp(rng.uniform(0, math.log(MAX_LENGTH + 1))))))


@dataclass
class LoadContext:
    """What every client loop shares."""

    url: str
    refs: dict[str, list[Reference]]
    max_model_len: int
    stats: Stats
    stop: threading.Event
    request_timeout: float
    seed: int
    reload_sent_at: float | None = None  # monotonic time of the SIGHUP, once sent


def bad_requests(max_model_len: int) -> list[tuple[str, str, dict | bytes | None, int]]:
    """(method, path, body, status): each must be answered with that status and an OpenAI error object."""
    return [
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
        ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400),
        ("POST", "/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
        ("POST", "/v1/chat/completions", {"messages": "not a list"}, 400),
        ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": max_model_len}, 400),  # over the context
        ("POST", "/v1/completions", {"prompt": "x", "best_of": 3}, 400),
        ("POST", "/v1/completions", b"{not json", 400),
        ("GET", "/v1/streams/no-such-stream", None, 404),
    ]


def retry_code(response: httpx.Response) -> str | None:
    """The error code of a 503 that asks to be retried (Retry-After) during a reload, else None."""
    if response.status_code != 503 or "retry-after" not in response.headers:
        return None
    response.read()
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None  # not our error shape: the caller reports the 503
    return code if code in RETRYABLE_503 else None


def expect_ok(response: httpx.Response, what: str) -> None:
    if response.status_code != 200:
        response.read()
        category = "5xx" if response.status_code >= 500 else "unexpected_4xx"
        raise Failed(category, f"{what}: {response.status_code} {response.text[:500]}")


def mismatch(ref: Reference, length: int, text: str, usage: dict | None) -> Failed:
    expected = ref.expected(length)
    at = next((i for i, (a, b) in enumerate(zip(text, expected)) if a != b), min(len(text), len(expected)))
    return Failed(
        "mismatch",
        f"{ref.api} {ref.prompt!r} max_tokens={length} usage={usage}: {len(text)} chars against "
        f"{len(expected)}, first difference at {at}: {text[at : at + 40]!r} != {expected[at : at + 40]!r}",
    )


class ClientLoop(threading.Thread):
    """One client sending requests back to back until the load stops; ``kind`` is the current one."""

    def __init__(self, index: int, ctx: LoadContext) -> None:
        super().__init__(name=f"client-{index}", daemon=True)
        self.ctx = ctx
        self.index = index
        self.rng = random.Random(ctx.seed * 10_000 + index)
        self.kind = "idle"
        self.current = ""  # what the request in flight asked for, for the report of a hang
        self.bad = bad_requests(ctx.max_model_len)

    def run(self) -> None:
        send = {
            "greedy": self._greedy,
            "greedy_stream": partial(self._stream, cut=False, resume=False),
            "disconnect": partial(self._stream, cut=True, resume=False),
            "resume": partial(self._stream, cut=True, resume=True),
            "sampled_n": self._sampled_n,
            "bad_request": self._bad_request,
        }
        kinds, weights = zip(*KIND_WEIGHTS.items())
        first = kinds[self.index % len(kinds)]
        with httpx.Client(base_url=self.ctx.url) as http:
            while not self.ctx.stop.is_set():
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
            self.ctx.stats.retry(f"503 {code}")
            time.sleep(min(5.0, float(response.headers["retry-after"])))  # as the server asked
        raise Failed("retries_exhausted", f"{method} {path}: still refused after {MAX_RETRIES} tries")

    def _pick(self, shortest: int = 1) -> tuple[Reference, int]:
        ref = self.rng.choice(self.ctx.refs[self.rng.choice(list(PATHS))])
        length = max(draw_length(self.rng, ref.limit), min(shortest, ref.limit))
        self.current = f"{ref.api} {ref.prompt!r} max_tokens={length}"
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
            self._check_stream(ref, length, read)
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
            reload_sent_at = self.ctx.reload_sent_at
            if response.status_code == 404 and reload_sent_at is not None and started < reload_sent_at:
                # Logs are kept in the worker's memory: a new worker cannot know an old one's stream.
                self.ctx.stats.record("resume", "lost_to_reload")
                return
            expect_ok(response, "resume")
            rest = read_stream(response, ref.api, cut.last_id, 0, deadline, self.ctx.stats.add_gap)
        rest.texts[0] = cut.texts[0] + rest.texts[0]
        self._check_stream(ref, length, rest)

    def _check_stream(self, ref: Reference, length: int, read: StreamRead) -> None:
        """The whole text equals the reference; a stream the reload ended holds a prefix of it."""
        text = read.texts[0]
        if not ref.expected(length).startswith(text):
            raise mismatch(ref, length, text, read.usage)
        if read.error_code == "server_shutting_down":
            self.ctx.stats.record(self.kind, "interrupted_by_reload")
            return
        if read.error_code is not None:
            raise Failed("stream_error", f"{self.kind} stream {read.stream_id} ended with error {read.error_code}")
        if not read.done:
            raise Failed("protocol", f"{self.kind} stream {read.stream_id} ended without [DONE] or an error event")
        if (read.usage or {}).get("completion_tokens") != length or text != ref.expected(length):
            raise mismatch(ref, length, text, read.usage)
        self.ctx.stats.record(self.kind, greedy_checked=True)

    def _sampled_n(self, http: httpx.Client) -> None:
        """n = 2..4 sampled choices (temperature 0.8, a seed), streamed or not: all n, all full length."""
        ref, length = self._pick()
        n, stream = self.rng.randint(2, 4), self.rng.random() < 0.5
        self.current += f" n={n} stream={stream}"
        body = {**ref.body(length, stream), "temperature": 0.8, "seed": self.rng.randrange(1 << 31), "n": n}
        self.kind = "sampled_n"
        deadline = time.monotonic() + self.ctx.request_timeout
        with self._open(http, "POST", PATHS[ref.api], json=body) as response:
            expect_ok(response, self.kind)
            if stream:
                read = read_stream(response, ref.api, 0, 0, deadline)  # choices interleave: no ITL
                indices, usage = set(read.texts), read.usage
            else:
                answer = response.read() and response.json()
                indices, usage = {c["index"] for c in answer["choices"]}, answer["usage"]
        if stream and read.error_code == "server_shutting_down":
            self.ctx.stats.record(self.kind, "interrupted_by_reload")
            return
        if stream and (read.error_code or not read.done):
            raise Failed("protocol", f"n={n} stream {read.stream_id}: error {read.error_code}, done {read.done}")
        if indices != set(range(n)) or (usage or {}).get("completion_tokens") != n * length:
            raise Failed("protocol", f"n={n} max_tokens={length}: choices {sorted(indices)}, usage {usage}")
        self.ctx.stats.record(self.kind)

    def _bad_request(self, http: httpx.Client) -> None:
        method, path, body, status = self.rng.choice(self.bad)
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


GAUGES = ("kv_blocks_total", "kv_blocks_free", "num_requests_running", "num_requests_waiting", "open_streams")
GREENLETS = "greenlets"  # a gauge the server may not export yet: then None in every sample


def read_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Our gauges from /metrics by short name, each summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {f"wsgi_infer:{name}": name for name in (*GAUGES, GREENLETS)}
    values: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=timeout).text):
        for sample in family.samples:
            if sample.name in wanted:
                values[wanted[sample.name]] += sample.value
    return dict(values)


def blocks_in_use(metrics: dict[str, float]) -> float | None:
    if "kv_blocks_total" not in metrics or "kv_blocks_free" not in metrics:
        return None
    return metrics["kv_blocks_total"] - metrics["kv_blocks_free"]


def process_usage(pids: list[int]) -> tuple[int, int]:
    """RSS bytes and open fds summed over the processes (one that just exited counts nothing)."""
    rss = fds = 0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            rss += process.memory_info().rss
            fds += process.num_fds()
        except psutil.NoSuchProcess:
            continue
    return rss, fds


def percentile(values: list[float] | array, q: float) -> float | None:
    if not len(values):
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


class Sampler(threading.Thread):
    """Every ``every`` seconds: the workers' RSS and fds, the server's gauges, this window's p99 ITL."""

    def __init__(self, server: GunicornServer, stats: Stats, every: float, t0: float) -> None:
        super().__init__(name="sampler", daemon=True)
        self.server, self.stats, self.every, self.t0 = server, stats, every, t0
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.phase = "load"  # then "reload", "load", "last_requests" and "idle", as soak() moves on

    def run(self) -> None:
        # On a fixed grid: a slow sample (the reload holds new connections) delays no later one.
        due = self.t0 + self.every
        while not self.stop.wait(max(0.0, due - time.monotonic())):
            self.samples.append(self.sample())
            due += self.every * max(1, math.ceil((time.monotonic() - due) / self.every))

    def sample(self) -> dict:
        pids = sorted(self.server.worker_pids())  # read each time: the reload replaces the workers
        rss, fds = process_usage(pids)
        try:
            metrics, metrics_error = read_metrics(self.server.url, timeout=self.every), None
        except httpx.HTTPError as exc:
            metrics, metrics_error = {}, repr(exc)
        window = self.stats.take_window()
        done, failed = self.stats.totals()
        return {
            "t": round(time.monotonic() - self.t0, 3),
            "phase": self.phase,
            "worker_pids": pids,
            "rss_bytes": rss,
            "open_fds": fds,
            "greenlets": metrics.get(GREENLETS),
            "kv_blocks_in_use": blocks_in_use(metrics),
            "requests_running": metrics.get("num_requests_running"),
            "requests_waiting": metrics.get("num_requests_waiting"),
            "open_streams": metrics.get("open_streams"),
            "p99_itl_s": percentile(window, 99),
            "itl_gaps": len(window),
            "requests_done": done,
            "failures": failed,
            "metrics_error": metrics_error,
        }


def reload_once(server: GunicornServer, ctx: LoadContext, t0: float) -> dict:
    """SIGHUP to the master, then wait for the new worker's engine-ready log line and the old worker's exit."""
    old = server.worker_pids()
    old_processes = [psutil.Process(pid) for pid in old]
    after = len(server.lines)
    ctx.reload_sent_at = sent = time.monotonic()
    os.kill(server.process.pid, signal.SIGHUP)
    report = {"sent_at_s": round(sent - t0, 3), "old_pids": old, "new_pids": [], "error": None}
    try:
        report["new_pids"] = server.wait_booted(after=after)
        report["new_worker_ready_after_s"] = round(time.monotonic() - sent, 3)
    except AssertionError as exc:
        report["error"] = f"no new worker became ready: {exc}"
    _, alive = psutil.wait_procs(old_processes, timeout=120)
    report["old_pids_alive"] = [p.pid for p in alive]
    report["old_exited_after_s"] = None if alive else round(time.monotonic() - sent, 3)
    return report


def join_loops(loops: list[ClientLoop], stats: Stats, timeout: float) -> None:
    """Each loop ends after its current request; one still busy after ``timeout`` is a hung client."""
    deadline = time.monotonic() + timeout
    for loop in loops:
        loop.join(max(0.0, deadline - time.monotonic()))
        if loop.is_alive():
            stats.fail(loop.kind, "hung", f"{loop.name} still in {loop.current} {timeout:.0f} s after the end")


def wait_idle(url: str, timeout: float) -> dict:
    """Poll /metrics until no KV block is in use and nothing runs, waits or streams (or the deadline)."""
    start = time.monotonic()
    while True:
        metrics = read_metrics(url)
        state = {
            "kv_blocks_in_use": blocks_in_use(metrics),
            "kv_blocks_total": metrics.get("kv_blocks_total"),
            "requests_running": metrics.get("num_requests_running"),
            "requests_waiting": metrics.get("num_requests_waiting"),
            "open_streams": metrics.get("open_streams"),
        }
        idle = all(state[k] == 0 for k in state if k != "kv_blocks_total")
        state["greenlets"] = metrics.get(GREENLETS)  # reported, not waited for: /metrics itself runs in one
        if idle or time.monotonic() - start > timeout:
            return {**state, "idle": idle, "waited_s": round(time.monotonic() - start, 3)}
        time.sleep(0.2)  # the next poll of the metric


def drift(samples: list[dict], key: str) -> float | None:
    """(max - min) / min of ``key`` over each worker generation's samples under full load after its
    first third (its warm-up), the largest over generations. The reload (old and new workers side
    by side), the last requests and the idle end are other phases, left out."""
    generations: dict[tuple, list[float]] = defaultdict(list)
    for s in samples:
        if s["phase"] == "load" and s[key]:
            generations[tuple(s["worker_pids"])].append(s[key])
    drifts = []
    for values in generations.values():
        steady = values[len(values) // 3 :]
        if len(steady) >= 2:
            drifts.append((max(steady) - min(steady)) / min(steady))
    return round(max(drifts), 4) if drifts else None


def summarize(ctx: LoadContext, samples: list[dict], reload: dict, final: dict, args: argparse.Namespace) -> dict:
    stats = ctx.stats
    categories = Counter(f["category"] for f in stats.failures)
    outcomes = {kind: dict(counts) for kind, counts in sorted(stats.outcomes.items())}
    summary = {
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "requests": outcomes,
        "requests_total": sum(sum(c.values()) for c in outcomes.values()),
        "greedy_checked": stats.greedy_checked,
        "failures_by_category": dict(categories),
        "5xx": categories["5xx"],
        "hung": categories["hung"],
        "mismatches": categories["mismatch"],
        "retried": dict(stats.retried),
        "interrupted_by_reload": sum(c.get("interrupted_by_reload", 0) for c in outcomes.values()),
        "resumes_lost_to_reload": outcomes.get("resume", {}).get("lost_to_reload", 0),
        "p99_itl_s": percentile(stats.all_gaps, 99),
        "rss_drift": drift(samples, "rss_bytes"),
        "fd_drift": drift(samples, "open_fds"),
        "rss_mib_first_last": [round(samples[i]["rss_bytes"] / 2**20, 1) for i in (0, -1)],
        "greenlets_exported": any(s["greenlets"] is not None for s in samples),
        "reload": reload,
        "final": final,
        "references": [
            {"api": r.api, "prompt": r.prompt, "limit": r.limit} for refs in ctx.refs.values() for r in refs
        ],
    }
    summary["violations"] = violations(summary, args.max_drift)
    return summary


def violations(summary: dict, max_drift: float | None) -> list[str]:
    """Why the run fails; empty when it passes."""
    found = [f"{count} {category}" for category, count in summary["failures_by_category"].items()]
    if not summary["final"]["idle"]:
        found.append(f"not idle at the end: {summary['final']}")
    reload = summary["reload"]
    if reload["error"] or not reload["new_pids"] or set(reload["new_pids"]) & set(reload["old_pids"]):
        found.append(f"the reload did not replace the worker: {reload}")
    if reload["old_pids_alive"]:
        found.append(f"old workers still alive after the reload: {reload['old_pids_alive']}")
    for key in ("rss_drift", "fd_drift"):
        if max_drift is not None and (summary[key] is None or summary[key] > max_drift):
            found.append(f"{key} {summary[key]} above {max_drift}")
    return found


def plot(samples: list[dict], summary: dict, path: Path) -> None:
    """Five stacked panels against time, the SIGHUP marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("rss_bytes", "RSS, workers (MiB)", 1 / 2**20),
        ("open_fds", "open fds, workers", 1),
        ("greenlets", "greenlets", 1),
        ("kv_blocks_in_use", "KV blocks in use", 1),
        ("p99_itl_s", "p99 ITL (ms)", 1e3),
    )
    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(10, 12))
    for ax, (key, label, scale) in zip(axes, panels):
        values = [math.nan if s[key] is None else s[key] * scale for s in samples]
        ax.plot(t, values, marker=".")
        if all(math.isnan(v) for v in values):
            ax.text(0.5, 0.5, "not exported by the server", transform=ax.transAxes, ha="center", va="center")
        reload = summary["reload"]
        ax.axvline(reload["sent_at_s"], color="tab:red", linestyle="--", label="SIGHUP")
        if reload["old_exited_after_s"] is not None:
            end = reload["sent_at_s"] + reload["old_exited_after_s"]
            ax.axvspan(reload["sent_at_s"], end, color="tab:red", alpha=0.08, label="old worker draining")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left")
    axes[-1].set_xlabel("seconds since the load started")
    verdict = "PASS" if not summary["violations"] else "FAIL: " + "; ".join(summary["violations"])[:120]
    fig.suptitle(f"soak: {summary['requests_total']} requests, c={summary['concurrency']}, {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def soak(server: GunicornServer, args: argparse.Namespace) -> dict:
    """References, then the load with its sampler and the reload half way, then the idle check."""
    started = time.monotonic()
    with server.client(timeout=600) as http:
        max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
        # As many references at once as the KV cache holds: more would only be preempted, over and over.
        blocks, block_size = server.wait_for_log(r"KV cache: (\d+) blocks of (\d+) tokens").groups()
        fits = int(blocks) * int(block_size) // (MAX_LENGTH + 64)
        refs = build_references(http, max_model_len, parallel=max(1, min(fits, 16)))
    ctx = LoadContext(server.url, refs, max_model_len, Stats(), threading.Event(), args.request_timeout, args.seed)
    t0 = time.monotonic()
    sampler = Sampler(server, ctx.stats, args.sample_every, t0)
    loops = [ClientLoop(i, ctx) for i in range(args.concurrency)]
    for thread in (sampler, *loops):
        thread.start()
    time.sleep(args.duration / 2)  # the schedule: the reload comes half way
    sampler.phase = "reload"
    reload = reload_once(server, ctx, t0)
    sampler.phase = "load"
    time.sleep(max(0.0, t0 + args.duration - time.monotonic()))
    ctx.stop.set()
    sampler.phase = "last_requests"
    stopped = time.monotonic()
    in_flight = [f"{loop.kind}: {loop.current}" for loop in loops]  # what the last phase waits for
    join_loops(loops, ctx.stats, args.request_timeout + 30)
    joined = time.monotonic()
    final = wait_idle(server.url, IDLE_TIMEOUT_S)
    sampler.stop.set()
    sampler.join()
    sampler.phase = "idle"
    sampler.samples.append(sampler.sample())
    summary = summarize(ctx, sampler.samples, reload, final, args)
    summary["max_model_len"] = max_model_len
    phases = {"references": t0 - started, "load": stopped - t0, "last_requests": joined - stopped}
    summary["phases_s"] = {name: round(seconds, 2) for name, seconds in phases.items()}
    summary["in_flight_at_stop"] = in_flight
    return {"summary": summary, "samples": sampler.samples, "failures": ctx.stats.failures}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, required=True, help="seconds of load")
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the server's default)")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="the server's dtype; float32 by default, as greedy texts are compared with references made in "
        "another batch, and in bf16 through torch on the CPU the batch's shape changes the output",
    )
    parser.add_argument("--quantization", default="auto", help="the server's packed weights (auto, none, int4, int8)")
    parser.add_argument("--concurrency", type=int, default=8, help="client loops")
    parser.add_argument("--kv-cache-mb", type=int, default=None, help="the server's KV cache (default: its own)")
    parser.add_argument("--out", type=Path, default=Path("soak-out"), help="directory for soak.json, soak.png")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="a request still open after this long has hung (1,000 tokens of the default model in float32 take "
        "2 to 3 minutes at concurrency 8 on 2 cores)",
    )
    parser.add_argument("--max-drift", type=float, default=None, help="fail on RSS or fd drift above this (0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' choices")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "model": args.model,
        "kv_cache_memory_mb": args.kv_cache_mb,
    }
    settings = {name: value for name, value in settings.items() if value is not None}
    server = GunicornServer(settings, "--access-logfile", "/dev/null")
    try:
        report = soak(server.wait_ready(), args)
    finally:
        server.stop()
        (args.out / "server.log").write_text("\n".join(server.lines) + "\n")
    report["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    plot(report["samples"], report["summary"], args.out / "soak.png")
    print(json.dumps(report["summary"], indent=1))
    for failure in report["failures"][:20]:
        print(f"FAILED {failure['kind']} {failure['category']}: {failure['detail']}", file=sys.stderr)
    return 1 if report["summary"]["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
