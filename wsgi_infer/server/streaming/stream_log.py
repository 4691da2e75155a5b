"""Resumable streams: every SSE event of a response is kept, numbered, in a log.

A pump greenlet turns the engine's output into events and appends them to the stream's log in this worker's memory;
HTTP responses only read the log from an event id on, so a client that lost its connection (EventSource does this by
itself, with Last-Event-ID) resumes the same generation where it left off. Finished logs stay readable for
``keep_seconds``. With ``redis_url``, a mirror copies every log to Redis as well (``redis_store``), so that any worker
or host can serve a resume; the stream itself never waits for Redis.

A stream's memory is bounded: when its reader falls more than ``backlog_bytes`` behind (or stops reading without
closing), the generation is aborted and the log ends with an error event.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Generator

import gevent
import gevent.event

from ..client_connection import LOOK_SECONDS
from ..metrics import ModelMetrics
from . import sse
from .redis_store import RedisStore
from .stream_endings import MOVED, StreamInterrupted, error_event, openai_error_event
from .stream_record import StreamRecord

log = logging.getLogger(__name__)


class StreamLog:
    """One stream's events, numbered from 1, in this worker's memory.

    ``on_release`` lets go of the request behind the events (its generation stops, where it still runs), through
    ``release``: the pump calls it once the stream has ended, however it ended, and the log when the stream is
    unfinished and nobody has read it for ``grace`` seconds (here, or in another process through
    ``read_elsewhere``): the client is gone for good. A call after the first does nothing. ``api``: the API whose
    events it holds (``stream_endings.API_SHAPES``), which a reader elsewhere ends the stream in, should it have to.
    """

    def __init__(
        self,
        stream_id: str,
        grace: float,
        on_release: Callable[[], None],
        read_elsewhere: Callable[[], bool] = lambda: False,
        api: str = "openai",
        record: StreamRecord | None = None,
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self.stream_id = stream_id
        self.api = api
        self.record = record  # what another host needs to continue it (with a mirror in Redis)
        self.events: list[str] = []  # without their `id:` lines (the mirror stores them so too)
        self.finished = False
        self.finished_at = 0.0
        self.readers = 0
        self.delivered = 0  # events some reader's connection has taken, at most
        self._ends = [0]  # _ends[i]: bytes of the first i events
        self.known = 0  # continued here: the events its client had from the host that died
        self.mirrored: int | None = None  # events Redis holds, while a mirror copies them (``readable``)
        self.moved = False  # another host continues it (``moved_elsewhere``)
        self._grace = grace
        self._on_release = on_release
        self._on_cancel = on_cancel or on_release  # a client's stop: the stream ends at once (``cancel``)
        self._read_elsewhere = read_elsewhere
        self._changed = gevent.event.Event()  # replaced (never cleared) on each change

    @property
    def backlog_bytes(self) -> int:
        """Bytes of events no reader has taken yet."""
        return self._ends[-1] - self._ends[self.delivered]

    def append(self, text: str) -> None:
        """Record one SSE event (without id); readers see it with the next id."""
        self.events.append(text)
        self._ends.append(self._ends[-1] + len(text.encode()))
        self._notify()

    def start_with(self, events: list[str]) -> None:
        """A stream continued here: the events a client already has (Redis's copy), read by none yet."""
        for text in events:
            self.append(text)
        self.delivered = self.known = len(events)  # not this log's backlog: they went out before

    def finish(self) -> None:
        """No more events: readers end after the last one."""
        self.finished = True
        self.finished_at = time.monotonic()
        self._notify()

    def release(self) -> None:
        """Let go of the request behind the events (``on_release``: nothing where it was let go of already)."""
        self._on_release()

    def cancel(self) -> bool:
        """A client's stop: the generation ends now, read or not (a cut connection keeps it ``grace`` s for a
        resume); whether it was still generating."""
        if self.finished:
            return False
        self._on_cancel()
        return True

    def moved_elsewhere(self) -> None:
        """Another host continues the stream, this one having been away past its lease (its mirror's word): the
        generation here stops, and readers here end after the events Redis held, told to resume."""
        self.moved = True
        self.release()
        self._notify()

    def wait(self, seen: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s for an event after the first ``seen``, or the end; True if one came."""
        return self._wait_until(lambda: len(self.events) > seen or self.finished, timeout)

    @property
    def readable(self) -> int:
        """The events readers may have: while a mirror copies the stream to Redis, those Redis holds (a host that
        continues the stream after this one died then has every event a client had), else all of them."""
        return len(self.events) if self.mirrored is None else self.mirrored

    def copied(self, mirrored: int | None) -> None:
        """The mirror's word: Redis holds the first ``mirrored`` events (None: Redis is away, all are readable)."""
        self.mirrored = mirrored
        self._notify()

    def read(self, after: int, heartbeat: float) -> Generator[str, None, None]:
        """Events after id ``after``, waiting for new ones until the end: first an empty string (the response's
        headers go out with it, its stream id among them, though a long prefill or a queue holds the first event),
        one per ``LOOK_SECONDS`` of quiet (the caller looks at its client) and a heartbeat per ``heartbeat``."""
        self.readers += 1
        try:
            position, quiet_since = max(0, after), time.monotonic()
            yield ""
            while True:
                while position < self.readable:
                    position += 1
                    yield f"id: {position}\n{self.events[position - 1]}"
                    self.delivered = max(self.delivered, position)  # the server wrote it: next() came back
                    quiet_since = time.monotonic()
                if self._read_to_end(position):
                    return
                if self.moved and position >= self.readable:  # the events after are another host's
                    yield error_event(self.api, position, "this stream goes on on another host: resume it", MOVED)
                    return
                if not self._wait_until(lambda seen=position: self._news_after(seen), min(LOOK_SECONDS, heartbeat)):
                    if time.monotonic() - quiet_since < heartbeat:
                        yield ""
                    else:
                        yield sse.HEARTBEAT
                        quiet_since = time.monotonic()
        finally:
            self.readers -= 1
            if not self.readers and not self.finished:
                gevent.spawn_later(self._grace, self._abandon_if_unread)

    def _read_to_end(self, position: int) -> bool:
        return self.finished and position >= len(self.events)

    def _news_after(self, position: int) -> bool:
        """A readable event after the first ``position``, or the end, for a reader there."""
        return self.readable > position or self._read_to_end(position)

    def _wait_until(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait up to ``timeout`` s for the log to change until ``ready()``; whether it is. A change that leaves it
        unready (an event appended that the mirror has not copied yet) waits on: a reader wrote a heartbeat for each."""
        deadline = time.monotonic() + timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.wait(left)
        return True

    def _abandon_if_unread(self) -> None:
        if self.readers or self.finished:
            return
        if self._read_elsewhere():  # nobody tells this worker when that reader leaves: look again
            gevent.spawn_later(self._grace, self._abandon_if_unread)
        else:
            self.release()

    def _notify(self) -> None:
        changed, self._changed = self._changed, gevent.event.Event()
        changed.set()


class StreamLogs:
    """This worker's stream logs by id, and the way to other workers' logs through Redis."""

    def __init__(
        self, keep_seconds: float, grace: float, backlog_bytes: int, redis_url: str | None, metrics: ModelMetrics
    ) -> None:
        self.keep_seconds = keep_seconds
        self.grace = grace
        self.backlog_bytes = backlog_bytes
        self._logs: dict[str, StreamLog] = {}
        self._finished: deque[StreamLog] = deque()  # in the order they finished: the first to expire first
        self._greenlets = metrics.greenlets
        self.metrics = metrics
        self.store = RedisStore(redis_url, keep_seconds, grace, metrics) if redis_url else None  # the copies

    def publish(
        self,
        events: Generator[str | None, None, None],
        on_release: Callable[[], None],
        stream_id: str | None = None,
        api: str = "openai",
        record: StreamRecord | None = None,
        known: list[str] | None = None,
        on_cancel: Callable[[], None] | None = None,
    ) -> StreamLog:
        """A new log (under ``stream_id``, unique, or a new one), fed with ``events`` by a pump greenlet (and mirrored
        to Redis with its ``record``, with a store). ``known``: a stream continued here, the events its client has;
        ``events`` must start with them."""
        self._expire()
        stream_id = stream_id or uuid.uuid4().hex
        read_elsewhere = (lambda: self.store.read_elsewhere(stream_id)) if self.store else (lambda: False)
        stream_log = StreamLog(stream_id, self.grace, on_release, read_elsewhere, api, record, on_cancel)
        stream_log.start_with(known or [])
        self._logs[stream_id] = stream_log
        gevent.spawn(self._pump, stream_log, events)
        if self.store is not None:
            self.store.mirror(stream_log)
        return stream_log

    def get(self, stream_id: str):
        """This worker's log, or a reader of Redis's copy; None if unknown. Raises StoreUnavailable."""
        self._expire()
        local = self._logs.get(stream_id)
        if (local is not None and not local.moved) or self.store is None:  # a moved one: Redis holds the other's
            return local
        return self.store.open(stream_id)

    def _pump(self, stream_log: StreamLog, events: Generator[str | None, None, None]) -> None:
        """Copy ``events`` into the log; None items (heartbeats) are dropped, and so are the first of a continued
        stream, which its log holds already."""
        self._greenlets.inc()
        try:
            for number, text in enumerate(text for text in events if text is not None):
                if number >= stream_log.known:
                    stream_log.append(text)
                interrupted = self._interruption(stream_log, number, text)
                if interrupted is not None:
                    return self._end(stream_log, events, interrupted)
        finally:
            stream_log.finish()
            # and let go of the request (nothing where the events' own end did): a stream cut in its opening events
            # (a Responses frame past the backlog bound) never reached the generator whose end releases it
            stream_log.release()
            self._finished.append(stream_log)
            self._greenlets.dec()

    def _interruption(self, stream_log: StreamLog, number: int, text: str) -> StreamInterrupted | None:
        """Why the stream ends after its event ``number`` (from 0): continued here, the event differs from the one
        its client has; or its reader fell too far behind."""
        if number < stream_log.known and text != stream_log.events[number]:
            log.error("stream %s: continued here, its event %d differs from the client's", stream_log.stream_id, number)
            self.metrics.streams_continued("diverged").inc()
            message = "the stream could not be continued after its host stopped: its events differ from the first"
            return StreamInterrupted(message, "stream_lost")
        if stream_log.backlog_bytes > self.backlog_bytes:
            log.warning(
                "stream %s: the client is %d bytes behind (limit %d); generation aborted",
                *(stream_log.stream_id, stream_log.backlog_bytes, self.backlog_bytes),
            )
            message = f"the client fell more than {self.backlog_bytes} bytes behind the stream; generation aborted"
            return StreamInterrupted(message, "stream_backlog_exceeded")
        return None

    @staticmethod
    def _end(stream_log: StreamLog, events: Generator[str | None, None, None], interrupted: StreamInterrupted) -> None:
        """End the stream early with the route's own last events, as it ends an interrupted stream in its API's
        shape (an OpenAI-shaped error where it does not); the generation is aborted (the generator's ``finally``)."""
        try:
            ending = [events.throw(interrupted), *events]
        except StopIteration:
            ending = []
        except StreamInterrupted:
            ending = [openai_error_event(interrupted.message, interrupted.code)]
        finally:
            events.close()
        for text in ending:
            if text is not None:
                stream_log.append(text)

    def _expire(self) -> None:
        """Forget the logs finished more than keep_seconds ago: only those are visited, not every open stream on
        each request (5,000 queued streams made admission quadratic)."""
        expired_before = time.monotonic() - self.keep_seconds
        while self._finished and self._finished[0].finished_at < expired_before:
            expired = self._finished.popleft()
            if self._logs.get(expired.stream_id) is expired:
                del self._logs[expired.stream_id]
