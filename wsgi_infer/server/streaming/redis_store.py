"""Resumable streams shared through Redis, best effort.

The worker generating a stream keeps its log in memory (``stream_log``); a
mirror greenlet per stream copies the events into a Redis stream (entry ids
``n-0``), so that any worker or host sharing the Redis can serve a resume.
Redis is never on a stream's path: while it is away, streams go on from
memory, a resume that needs Redis gets ``StoreUnavailable`` (a 503), and when
it returns each mirror catches up from the last entry Redis holds.

Two short leases tie readers and writers together: the generating worker
renews ``<key>:producer`` while its stream runs, so a reader elsewhere ends
with a ``stream_lost`` event soon after that worker died; readers renew
``<key>:reader``, so the generating worker knows somebody still reads. Each
is renewed every second at least (every heartbeat where that is shorter) and
lapses after three renewals missed, whatever the heartbeat: a host that dies
is known to be gone within seconds, not three heartbeats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import gevent
import gevent.event

from ..errors import anthropic_error_body, error_body
from . import sse
from .stream_record import RequestRecord, StreamRecord, decode_batch, encode_batch

if TYPE_CHECKING:
    from ..metrics import ModelMetrics

log = logging.getLogger(__name__)


class MirroredLog(Protocol):
    """What a mirror reads of a stream's log (``stream_log.StreamLog``)."""

    stream_id: str
    api: str
    events: list[str]
    record: StreamRecord | None
    finished: bool
    finished_at: float

    def wait(self, seen: int, timeout: float) -> bool:
        """Until the log holds more than ``seen`` events or has finished."""


class ReadableLog(Protocol):
    def read(self, after: int, heartbeat: float) -> Iterator[str]:
        """Events after id ``after``, with their ``id:`` lines."""


# Continues a stream here whose generating host died: its log here, or None (continued elsewhere, or not at all).
Continuer = Callable[[], ReadableLog | None]

RETRY_MS = 1000
LEASE_RENEWAL_SECONDS = 1.0  # at most; a lease lapses after three renewals missed
API_SHAPES = ("openai", "anthropic", "responses")  # the shapes a stream read here may end in: see _error_event


class StoreUnavailable(Exception):
    """Redis cannot be reached right now."""


class RedisStore:
    def __init__(self, url: str, keep_seconds: float, heartbeat: float, metrics: ModelMetrics) -> None:
        import redis  # optional: pip install "wsgi-infer[redis]"

        # A blocked read waits one heartbeat; anything slower than that means Redis is unwell.
        self._client = redis.Redis.from_url(url, socket_timeout=heartbeat + 2, socket_connect_timeout=2)
        self._errors = (redis.RedisError, OSError)
        self._keep = keep_seconds
        self._heartbeat = heartbeat
        self._renewal = min(heartbeat, LEASE_RENEWAL_SECONDS)
        self._lease_ms = int(3000 * self._renewal)
        self._up = gevent.event.Event()
        self._up.set()
        # Counts Redis's returns: a mirror's idea of what Redis holds is only good within one epoch
        # (a mirror that never failed itself may have slept through the outage).
        self._epoch = 0
        self._probe: gevent.Greenlet | None = None
        self._metrics = metrics

    @staticmethod
    def key(stream_id: str) -> str:
        return f"wsgi-infer:stream:{stream_id}"

    # --- health ---------------------------------------------------------------------
    def _down(self, exc: Exception) -> None:
        """An operation failed: stop using Redis until one probe greenlet reaches it again."""
        if self._up.is_set():
            log.warning("Redis is unavailable (%s); streams go on from memory, resumes elsewhere wait", exc)
            self._up.clear()
        if self._probe is None or self._probe.dead:
            self._probe = gevent.spawn(self._wait_until_back)

    def _wait_until_back(self) -> None:
        delay = 0.05
        while True:
            try:
                self._client.ping()
                break
            except self._errors:
                gevent.sleep(delay)  # a retry back-off, not a wait for an event
                delay = min(2 * delay, 1.0)
        log.info("Redis is back; streams are mirrored again")
        self._epoch += 1
        self._up.set()

    # --- the generating worker ----------------------------------------------------------
    def mirror(self, stream_log: MirroredLog) -> None:
        """Announce the stream (a resume elsewhere finds it as soon as its client has the id),
        then copy it in a greenlet of its own."""
        if self._up.is_set():
            try:
                self._client.set(f"{self.key(stream_log.stream_id)}:producer", "1", px=self._lease_ms)
            except self._errors as exc:
                self._down(exc)
        self._metrics.streams_unmirrored.inc()
        self._metrics.greenlets.inc()
        gevent.spawn(self._mirror, stream_log).link(self._mirror_ended)

    def _mirror_ended(self, _: gevent.Greenlet) -> None:
        self._metrics.streams_unmirrored.dec()
        self._metrics.greenlets.dec()

    def _mirror(self, stream_log: MirroredLog) -> None:
        """Copy the log into Redis until it has ended there, or has expired here unmirrored."""
        sent: tuple[int, int] | None = None  # events and record batches Redis holds; None: ask it
        epoch = self._epoch
        while True:
            if not self._up.wait(self._heartbeat):
                if stream_log.finished and time.monotonic() - stream_log.finished_at > self._keep:
                    return
                continue
            if epoch != self._epoch:  # Redis came back, perhaps empty: ask what it holds
                sent, epoch = None, self._epoch
            try:
                sent, ended = self._push(stream_log, sent)
            except self._errors as exc:
                sent = None
                self._down(exc)
                continue
            if ended:
                return
            stream_log.wait(sent[0], self._renewal)  # a quiet stream's lease renewed all the same

    def _push(self, stream_log: MirroredLog, sent: tuple[int, int] | None) -> tuple[tuple[int, int], bool]:
        """Append what Redis lacks and renew the producer lease: the events and record batches Redis holds, and
        whether the end is written too. The batches go first: Redis never holds an event without its batch."""
        key = self.key(stream_log.stream_id)
        if sent is None:
            last = self._client.xrevrange(key, count=1)
            if last and b"end" in last[0][1]:  # written before a lost reply
                return (len(stream_log.events), 0), True
            sent = (int(last[0][0].split(b"-")[0]) if last else 0, self._client.llen(f"{key}:batches"))
            request = stream_log.record and stream_log.record.request  # (again: Redis may have lost it)
        else:
            request = None
        (events_sent, batches_sent), total, finished = sent, len(stream_log.events), stream_log.finished
        batches = stream_log.record.batches if stream_log.record else []
        num_batches = len(batches)
        # Unfinished keys expire too, so a worker that died leaves nothing behind for ever.
        expiry = max(1, int(self._keep + 3 * self._heartbeat))
        pipe = self._client.pipeline(transaction=False)
        if request is not None:
            pipe.set(f"{key}:request", request.encode(), ex=expiry)
        if num_batches > batches_sent and not finished:
            pipe.rpush(f"{key}:batches", *map(encode_batch, batches[batches_sent:num_batches]))
        for index in range(events_sent, total):
            pipe.xadd(key, {"event": stream_log.events[index]}, id=f"{index + 1}-0")
        if finished:
            pipe.xadd(key, {"end": "1"}, id=f"{total + 1}-0")
            pipe.delete(f"{key}:producer", f"{key}:request", f"{key}:batches")  # nothing left to continue
        else:
            pipe.set(f"{key}:producer", "1", px=self._lease_ms)
            pipe.expire(f"{key}:request", expiry)
            pipe.expire(f"{key}:batches", expiry)
        pipe.expire(key, expiry)
        pipe.set(f"{key}:api", stream_log.api, ex=expiry)  # for readers elsewhere that must end it
        pipe.execute()
        return (total, num_batches), finished

    def read_elsewhere(self, stream_id: str) -> bool:
        """Whether a reader in another process holds the stream (False while Redis is away)."""
        if not self._up.is_set():
            return False
        try:
            return bool(self._client.exists(f"{self.key(stream_id)}:reader"))
        except self._errors as exc:
            self._down(exc)
            return False

    # --- readers anywhere ---------------------------------------------------------------
    def open(self, stream_id: str) -> RedisStreamReader | None:
        """A reader of the stream's copy; None if Redis knows nothing of it. Raises StoreUnavailable."""
        key = self.key(stream_id)
        if self._up.is_set():
            try:
                if self._client.exists(key, f"{key}:producer"):
                    api = (self._client.get(f"{key}:api") or b"openai").decode()
                    return RedisStreamReader(self, stream_id, api)
                return None
            except self._errors as exc:
                self._down(exc)
        raise StoreUnavailable("the stream store (Redis) is unavailable; retry the resume")

    def claim(self, stream_id: str) -> tuple[RequestRecord, list, list[str]] | None:
        """Take over a stream whose producer lease lapsed before its end: its lease (one host continues it), its
        request, record batches and events; None where another host took it first, or nothing is left to continue
        (it ended, or its request was not kept)."""
        key = self.key(stream_id)
        if not self._client.set(f"{key}:producer", "1", nx=True, px=self._lease_ms):
            return None
        request, entries = self._client.get(f"{key}:request"), self._client.xrange(key)
        if request is None or (entries and b"end" in entries[-1][1]):
            self._client.delete(f"{key}:producer")
            return None
        batches = [decode_batch(batch) for batch in self._client.lrange(f"{key}:batches", 0, -1)]
        return RequestRecord.decode(request), batches, [fields[b"event"].decode() for _, fields in entries]

    def hold(self, stream_id: str) -> gevent.Greenlet:
        """Renew a claimed stream's lease until the greenlet is killed: while its request is set up here (a model
        loading may take longer than a lease), before its mirror renews it."""

        def renew() -> None:
            while True:
                gevent.sleep(self._renewal)  # a renewal period, not a wait for an event
                try:
                    self._client.set(f"{self.key(stream_id)}:producer", "1", px=self._lease_ms)
                except self._errors as exc:
                    return self._down(exc)

        return gevent.spawn(renew)

    def give_up(self, stream_id: str) -> None:
        """A stream this host claimed and could not continue: its lease goes at once, so that readers end."""
        self._client.delete(f"{self.key(stream_id)}:producer")

    def read(
        self, stream_id: str, after: int, heartbeat: float, api: str = "openai", continue_here: Continuer | None = None
    ) -> Iterator[str]:
        """Events after id ``after`` with their ``id:`` lines, a heartbeat per quiet interval, and an error event in
        the stream's ``api``'s shape if Redis goes away or the generating worker died before the end and the stream
        is not continued: here (``continue_here`` gives the log of the stream it continued) or by another host."""
        key, last, number = self.key(stream_id), f"{after}-0", after
        quiet, per_heartbeat = 0, max(1, round(heartbeat / self._renewal))  # empty reads, and those a heartbeat
        try:
            while True:
                self._client.set(f"{key}:reader", "1", px=self._lease_ms)
                reply = self._client.xread({key: last}, block=int(1000 * self._renewal), count=256)
                if not reply:
                    if not self._client.exists(f"{key}:producer"):
                        continued = continue_here() if continue_here is not None else None
                        if continued is not None:
                            yield from continued.read(number, heartbeat)
                            return
                    if not self._client.exists(f"{key}:producer"):  # nor continued elsewhere
                        yield _error_event(api, number, "the worker generating this stream is gone", "stream_lost")
                        return
                    quiet += 1
                    if quiet % per_heartbeat == 0:
                        yield sse.HEARTBEAT
                    continue
                quiet = 0
                for entry_id, fields in reply[0][1]:
                    last = entry_id
                    if b"end" in fields:
                        return
                    number = int(entry_id.split(b"-")[0])
                    yield f"id: {number}\n{fields[b'event'].decode()}"
        except self._errors as exc:
            self._down(exc)
            message = "the stream store (Redis) became unavailable; resume again later"
            yield _error_event(api, number, message, "store_unavailable")


class RedisStreamReader:
    """A stream as Redis holds it, read like a ``StreamLog``."""

    def __init__(self, store: RedisStore, stream_id: str, api: str) -> None:
        self._store = store
        self.stream_id = stream_id
        self.api = api
        self.continue_here: Continuer | None = None  # where its generating host died: continue it here

    def read(self, after: int, heartbeat: float) -> Iterator[str]:
        return self._store.read(self.stream_id, after, heartbeat, self.api, self.continue_here)


def _error_event(api: str, events_before: int, message: str, code: str) -> str:
    """The event that ends a stream read here in its API's shape: Anthropic's error, the Responses API's ``error``
    event (numbered after the ``events_before`` the stream's numbers count from 0), else OpenAI's error."""
    if api == "anthropic":
        data = anthropic_error_body(message, 503)
    elif api == "responses":
        data = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": events_before}
    else:
        data = error_body(message, 503, code=code)
    return sse.event(data, name="error", retry_ms=RETRY_MS)
