"""Resumable streams: every SSE event of a response is kept, numbered, in a log.

A pump greenlet turns the engine's output into events and appends them here;
HTTP responses only read the log from an event id on, so a client that lost
its connection (EventSource does this by itself, with Last-Event-ID) resumes
the same generation where it left off. Logs stay readable for a while after
their stream finished. ``MemoryStreamLog`` keeps them in this process (correct
with one worker); ``RedisStreamLog`` keeps them in a Redis stream, so that any
worker or host sharing the Redis serves any resume.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

import gevent
import gevent.event

from . import sse


class StreamLog(ABC):
    """One stream's numbered events, wherever they are kept.

    ``on_abandoned`` (given where the stream is generated) runs when the stream
    is unfinished and nobody has read it for ``grace`` seconds: the client is
    gone for good, so its generation stops.
    """

    def __init__(self, stream_id: str, grace: float, on_abandoned: Callable[[], None] | None) -> None:
        self.stream_id = stream_id
        self.finished = False
        self.readers = 0
        self._grace = grace
        self._on_abandoned = on_abandoned

    @abstractmethod
    def append(self, text: str) -> None:
        """Record one SSE event (without id); readers see it with the next id."""

    @abstractmethod
    def finish(self) -> None:
        """No more events: readers end after the last one."""

    @abstractmethod
    def _events(self, after: int, heartbeat: float) -> Iterator[str]:
        """Events after id ``after`` with their ``id:`` lines; a heartbeat after each quiet interval."""

    def _read_elsewhere(self) -> bool:
        """Whether a reader in another process still holds the stream (only a shared log knows)."""
        return False

    def read(self, after: int, heartbeat: float) -> Iterator[str]:
        """Events after id ``after``, waiting for new ones (heartbeats meanwhile) until the end."""
        self.readers += 1
        try:
            yield from self._events(max(0, after), heartbeat)
        finally:
            self.readers -= 1
            if not self.readers and not self.finished and self._on_abandoned is not None:
                gevent.spawn_later(self._grace, self._abandon_if_unread)

    def _abandon_if_unread(self) -> None:
        if not self.readers and not self.finished and not self._read_elsewhere():
            self._on_abandoned()


class MemoryStreamLog(StreamLog):
    """The log in this process's memory."""

    def __init__(self, stream_id: str, grace: float, on_abandoned: Callable[[], None]) -> None:
        super().__init__(stream_id, grace, on_abandoned)
        self.events: list[str] = []
        self.finished_at = 0.0
        self._changed = gevent.event.Event()

    def append(self, text: str) -> None:
        self.events.append(f"id: {len(self.events) + 1}\n{text}")
        self._changed.set()

    def finish(self) -> None:
        self.finished = True
        self.finished_at = time.monotonic()
        self._changed.set()

    def _events(self, after: int, heartbeat: float) -> Iterator[str]:
        position = after
        while True:
            while position < len(self.events):
                position += 1
                yield self.events[position - 1]
            if self.finished:
                return
            self._changed.clear()
            if not self._changed.wait(heartbeat) and position == len(self.events):
                yield sse.HEARTBEAT


class RedisStreamLog(StreamLog):
    """The log in a Redis stream (entry ids ``n-0``), expiring ``keep_seconds``
    after it finished. Readers on any instance renew a short lease key, so the
    instance generating the stream knows whether anybody still reads it."""

    def __init__(
        self, client, stream_id: str, grace: float, keep_seconds: float, on_abandoned: Callable[[], None] | None = None
    ) -> None:
        super().__init__(stream_id, grace, on_abandoned)
        self.key = f"wsgi-infer:stream:{stream_id}"
        self._lease = f"{self.key}:reader"
        self._client = client
        self._keep = keep_seconds
        self._next = 1

    def append(self, text: str) -> None:
        self._client.xadd(self.key, {"event": text}, id=f"{self._next}-0")
        self._next += 1

    def finish(self) -> None:
        self._client.xadd(self.key, {"end": "1"}, id=f"{self._next}-0")
        self._client.expire(self.key, max(1, int(self._keep)))
        self.finished = True

    def _events(self, after: int, heartbeat: float) -> Iterator[str]:
        last = f"{after}-0"
        while True:
            self._client.set(self._lease, "1", px=int(2000 * max(heartbeat, self._grace)))
            reply = self._client.xread({self.key: last}, block=int(1000 * heartbeat), count=256)
            if not reply:
                yield sse.HEARTBEAT
                continue
            for entry_id, fields in reply[0][1]:
                last = entry_id
                if b"end" in fields:
                    return
                yield f"id: {entry_id.split(b'-')[0].decode()}\n{fields[b'event'].decode()}"

    def _read_elsewhere(self) -> bool:
        return bool(self._client.exists(self._lease))


class StreamLogs:
    """This worker's way to the logs, by stream id: in-process, or in Redis when
    ``redis_url`` is set. Finished logs expire after ``keep_seconds``."""

    def __init__(self, keep_seconds: float, grace: float, redis_url: str | None = None) -> None:
        self.keep_seconds = keep_seconds
        self.grace = grace
        self._logs: dict[str, MemoryStreamLog] = {}
        self._redis = None
        if redis_url:
            import redis  # optional: pip install "wsgi-infer[redis]"

            self._redis = redis.Redis.from_url(redis_url)

    def create(self, on_abandoned: Callable[[], None]) -> StreamLog:
        stream_id = uuid.uuid4().hex
        if self._redis is not None:
            return RedisStreamLog(self._redis, stream_id, self.grace, self.keep_seconds, on_abandoned)
        self._expire()
        log = MemoryStreamLog(stream_id, self.grace, on_abandoned)
        self._logs[stream_id] = log
        return log

    def get(self, stream_id: str) -> StreamLog | None:
        if self._redis is not None:
            log = RedisStreamLog(self._redis, stream_id, self.grace, self.keep_seconds)
            return log if self._redis.exists(log.key) else None
        self._expire()
        return self._logs.get(stream_id)

    def _expire(self) -> None:
        now = time.monotonic()
        for stream_id in [
            i for i, log in self._logs.items() if log.finished and now - log.finished_at > self.keep_seconds
        ]:
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
