"""What a soak's clients share: the failures they count, the tally, and reading a stream of Server-Sent Events."""

from __future__ import annotations

import math
import threading
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tests.support.sse_client import events

RETRYABLE_503 = ("server_shutting_down", "model_not_ready")  # what a client may retry: a reload, a model's load


def prompt_field(api: str, prompt: str) -> dict:
    return {"prompt": prompt} if api == "completion" else {"messages": [{"role": "user", "content": prompt}]}


def choice_text(api: str, choice: dict, streamed: bool) -> str:
    if api == "completion":
        return choice.get("text") or ""
    return (choice.get("delta" if streamed else "message") or {}).get("content") or ""


class Hung(Exception):
    """A request that did not finish within --request-timeout."""


class Failed(Exception):
    """A check failed; ``category`` is how the summary counts it."""

    def __init__(self, category: str, detail: str) -> None:
        super().__init__(f"{category}: {detail}")
        self.category = category
        self.detail = detail


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


def percentile(values: list[float] | array, q: float) -> float | None:
    if not len(values):
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
