"""Resumable streams: every SSE event of a response is kept, numbered, in a log.

A pump greenlet turns the engine's output into events and appends them here;
HTTP responses only read the log from an event id on, so a client that lost
its connection (EventSource does this by itself, with Last-Event-ID) resumes
the same generation where it left off. Logs stay readable for a while after
their stream finished. This is the in-process store: correct with one worker.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import gevent
import gevent.event

from . import sse


class StreamLog:
    """``on_abandoned`` runs when the stream is unfinished and nobody has read it
    for ``grace`` seconds: the client is gone for good, so its generation stops."""

    def __init__(self, stream_id: str, grace: float, on_abandoned: Callable[[], None]) -> None:
        self.stream_id = stream_id
        self.events: list[str] = []
        self.finished = False
        self.finished_at = 0.0
        self.readers = 0
        self._grace = grace
        self._on_abandoned = on_abandoned
        self._changed = gevent.event.Event()

    def append(self, text: str) -> None:
        """Record one SSE event (without id); readers see it with the next id."""
        self.events.append(f"id: {len(self.events) + 1}\n{text}")
        self._changed.set()

    def finish(self) -> None:
        self.finished = True
        self.finished_at = time.monotonic()
        self._changed.set()

    def read(self, after: int, heartbeat: float) -> Iterator[str]:
        """Events after id ``after``, waiting for new ones (heartbeats meanwhile) until the end."""
        self.readers += 1
        try:
            position = max(0, after)
            while True:
                while position < len(self.events):
                    position += 1
                    yield self.events[position - 1]
                if self.finished:
                    return
                self._changed.clear()
                if not self._changed.wait(heartbeat) and position == len(self.events):
                    yield sse.HEARTBEAT
        finally:
            self.readers -= 1
            if not self.readers and not self.finished:
                gevent.spawn_later(self._grace, self._abandon_if_unread)

    def _abandon_if_unread(self) -> None:
        if not self.readers and not self.finished:
            self._on_abandoned()


class StreamLogs:
    """The logs of this worker, by stream id; finished ones expire after ``keep_seconds``."""

    def __init__(self, keep_seconds: float, grace: float) -> None:
        self.keep_seconds = keep_seconds
        self.grace = grace
        self._logs: dict[str, StreamLog] = {}

    def create(self, on_abandoned: Callable[[], None]) -> StreamLog:
        self._expire()
        log = StreamLog(uuid.uuid4().hex, self.grace, on_abandoned)
        self._logs[log.stream_id] = log
        return log

    def get(self, stream_id: str) -> StreamLog | None:
        self._expire()
        return self._logs.get(stream_id)

    def _expire(self) -> None:
        now = time.monotonic()
        for stream_id in [i for i, log in self._logs.items() if log.finished and now - log.finished_at > self.keep_seconds]:
            del self._logs[stream_id]


def spawn_pump(log: StreamLog, events: Iterator[str | None]) -> gevent.Greenlet:
    """Copy ``events`` into ``log`` in a greenlet of its own; None items (heartbeats) are dropped."""

    def pump() -> None:
        try:
            for text in events:
                if text is not None:
                    log.append(text)
        finally:
            log.finish()

    return gevent.spawn(pump)
