"""Streams copied to Redis: any worker or host resumes them, and continues them where their host died.

The worker generating a stream keeps its log in memory (``stream_log``); a mirror greenlet per stream copies its
events into a Redis stream (entry ids ``n-0``) with the record another host needs to continue it
(``stream_record``). An event goes out to clients once Redis holds it, so that a host continuing the stream has
every event a client had. While Redis is away streams go on from memory (a resume that needs Redis gets
``StoreUnavailable``, a 503), and when it returns each mirror catches up from the last entry Redis holds.

Short leases tie readers and writers together: the generating worker renews ``<key>:producer``, readers
``<key>:reader``, each every second at least, lapsing after three renewals missed. A reader elsewhere that sees
the producer's lapse before the stream's end continues it (``api.continuation``) or ends it with ``stream_lost``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import gevent
import gevent.event

from . import sse
from .leases import LeaseLost, Leases
from .log_shapes import Continuer, MirroredLog
from .redis_reader import RedisStreamReader
from .stream_endings import error_event
from .stream_record import RequestRecord

if TYPE_CHECKING:
    from ..metrics import ModelMetrics

log = logging.getLogger(__name__)


LEASE_RENEWAL_SECONDS = 1.0  # at most; a lease lapses after three renewals missed


class StoreUnavailable(Exception):
    """Redis cannot be reached right now."""


class RedisStore:
    def __init__(self, url: str, keep_seconds: float, heartbeat: float, metrics: ModelMetrics) -> None:
        import redis  # optional: pip install "wsgi-infer[redis]"

        # A blocked read waits one heartbeat; anything slower than that means Redis is unwell.
        self._client = redis.Redis.from_url(url, socket_timeout=heartbeat + 2, socket_connect_timeout=2)
        self._errors = (redis.RedisError, OSError)
        self._refused = redis.ResponseError  # a command Redis ran and refused (a stream's entry id taken already)
        self._keep = keep_seconds
        self._heartbeat = heartbeat
        self._renewal = min(heartbeat, LEASE_RENEWAL_SECONDS)
        self._lease_ms = int(3000 * self._renewal)
        self._leases = Leases(self._client, self._lease_ms)
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
        sent = None
        if self._up.is_set():
            try:
                sent, _ = self._push(stream_log, None, renew=True, announce=True)
                stream_log.copied(sent[0])  # its events go out once Redis holds them
            except self._errors as exc:
                self._down(exc)
        self._metrics.streams_unmirrored.inc()
        self._metrics.greenlets.inc()
        gevent.spawn(self._mirror, stream_log, sent).link(self._mirror_ended)

    def _mirror_ended(self, _: gevent.Greenlet) -> None:
        self._metrics.streams_unmirrored.dec()
        self._metrics.greenlets.dec()

    def _mirror(self, stream_log: MirroredLog, sent: tuple[int, int] | None) -> None:
        """Copy the log into Redis until it has ended there, or has expired here unmirrored. ``sent``: the events
        and record batches Redis holds; None: ask it."""
        epoch, renewed_at = self._epoch, time.monotonic()
        while True:
            if not self._up.is_set():
                stream_log.copied(None)  # no client waits for Redis while it is away
            if not self._up.wait(self._heartbeat):
                if stream_log.finished and time.monotonic() - stream_log.finished_at > self._keep:
                    return
                continue
            if epoch != self._epoch:  # Redis came back, perhaps empty: ask what it holds
                sent, epoch = None, self._epoch
            renew = time.monotonic() - renewed_at >= self._renewal / 2  # leases and expiries: not at every event
            try:
                sent, ended = self._push(stream_log, sent, renew or sent is None)
                renewed_at = time.monotonic() if renew else renewed_at
            except LeaseLost:
                away = "stream %s: another host continues it (this host was away past its lease); its copy here stops"
                log.warning(away, stream_log.stream_id)
                return stream_log.moved_elsewhere()
            except self._errors as exc:
                sent = None
                stream_log.copied(None)
                self._down(exc)
                continue
            stream_log.copied(sent[0])
            if ended:
                return
            stream_log.wait(sent[0], self._renewal)  # a quiet stream's lease renewed all the same

    def _push(
        self, stream_log: MirroredLog, sent: tuple[int, int] | None, renew: bool, announce: bool = False
    ) -> tuple[tuple[int, int], bool]:
        """Append what Redis lacks, and with ``renew`` renew the producer lease and the keys' expiries: the events
        and record batches Redis holds, and whether the end is written too. The batches go first: Redis never
        holds an event without its batch. ``announce``: a new stream, whose copy holds what its log holds."""
        key, request = self.key(stream_log.stream_id), stream_log.record and stream_log.record.request
        if announce:
            sent = (stream_log.known, len(stream_log.record.batches) if stream_log.record else 0)
        elif sent is None:
            last = self._client.xrevrange(key, count=1)
            if last and b"end" in last[0][1]:  # written before a lost reply; or, unfinished here, by another host
                if not stream_log.finished:  # that continued it to its end while this one slept (a paused VM)
                    raise LeaseLost(key)
                return (len(stream_log.events), 0), True
            sent = (int(last[0][0].split(b"-")[0]) if last else 0, self._client.llen(f"{key}:batches"))
        else:
            request = None  # written already (and again after an outage: Redis may have lost it)
        (events_sent, batches_sent), total, finished = sent, len(stream_log.events), stream_log.finished
        batches = stream_log.record.batches if stream_log.record else []
        num_batches = len(batches)
        # Unfinished keys expire too, so a worker that died leaves nothing behind for ever.
        expiry = max(1, int(self._keep + 3 * self._heartbeat))
        if renew or finished:
            self._leases.renew(key, total)  # before any write: another host's continuation keeps its own
        pipe = self._client.pipeline(transaction=False)
        if request is not None:
            pipe.set(f"{key}:request", request.encode(), ex=expiry)
        if num_batches > batches_sent and not finished:
            pipe.rpush(f"{key}:batches", *batches[batches_sent:num_batches])
        for index in range(events_sent, total):
            pipe.xadd(key, {"event": stream_log.events[index]}, id=f"{index + 1}-0")
        if finished:
            pipe.xadd(key, {"end": "1"}, id=f"{total + 1}-0")
            pipe.delete(f"{key}:producer", f"{key}:request", f"{key}:batches")  # nothing left to continue
        elif renew:
            pipe.expire(f"{key}:request", expiry)
            pipe.expire(f"{key}:batches", expiry)
        if renew or finished:
            pipe.expire(key, expiry)
            pipe.set(f"{key}:api", stream_log.api, ex=expiry)  # for readers elsewhere that must end it
        pipe.exists(f"{key}:cancel")  # asked for by a client's cancel elsewhere (``cancel``)
        try:
            cancelled = pipe.execute()[-1]
        except self._refused:  # an entry id another host wrote first: the stream may be its now
            self._leases.check(key)
            raise
        if cancelled and not finished:
            stream_log.cancel()
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
    def cancel(self, stream_id: str) -> bool:
        """Ask the worker generating the stream to stop it (its mirror sees the word within a renewal); whether it
        was still generating. Raises StoreUnavailable."""
        key = self.key(stream_id)
        try:
            if not self._client.exists(f"{key}:producer"):
                return False
            return bool(self._client.set(f"{key}:cancel", "1", px=self._lease_ms))
        except self._errors as exc:
            self._down(exc)
            raise StoreUnavailable("the stream store (Redis) is unavailable; retry the cancel") from None

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

    def ended(self, stream_id: str) -> bool:
        """Whether Redis holds the stream's end. Raises StoreUnavailable."""
        try:
            return self._has_end(self.key(stream_id))
        except self._errors as exc:
            self._down(exc)
            raise StoreUnavailable("the stream store (Redis) is unavailable; retry the resume") from None

    def _has_end(self, key: str) -> bool:
        last = self._client.xrevrange(key, count=1)
        return bool(last) and b"end" in last[0][1]

    def claim(self, stream_id: str) -> tuple[RequestRecord, list[str], list[str]] | None:
        """Take over a stream whose producer lease lapsed before its end: its lease (one host continues it), request,
        record batches and events; None where another host took it, or it cannot be continued (ended, no request)."""
        key = self.key(stream_id)
        if not self._leases.take(key):
            return None
        request, entries = self._client.get(f"{key}:request"), self._client.xrange(key)
        if request is None or (entries and b"end" in entries[-1][1]):
            self._client.delete(f"{key}:producer")
            return None
        batches = [batch.decode() for batch in self._client.lrange(f"{key}:batches", 0, -1)]
        return RequestRecord.decode(request), batches, [fields[b"event"].decode() for _, fields in entries]

    def hold(self, stream_id: str) -> gevent.Greenlet:
        """Renew a claimed stream's lease until the greenlet is killed: while it is set up here (a model may load)."""
        return self._leases.hold(self.key(stream_id), self._renewal, self._errors, self._down)

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
        yield ""  # the headers at once; and one per empty read (``StreamLog.read``)
        try:
            while True:
                self._client.set(f"{key}:reader", "1", px=self._lease_ms)
                reply = self._client.xread({key: last}, block=int(1000 * self._renewal), count=256)
                if not reply:
                    if not self._client.exists(f"{key}:producer"):
                        if self._has_end(key):  # read from past its end (its end's entry comes before): nothing
                            return
                        continued = continue_here(number) if continue_here is not None else None
                        if continued is not None:
                            yield from continued.read(number, heartbeat)
                            return
                        if not self._client.exists(f"{key}:producer"):  # nor continued elsewhere
                            message = "the worker generating this stream is gone, and it could not be continued here"
                            yield error_event(api, number, message, "stream_lost")
                            return
                    quiet += 1
                    yield sse.HEARTBEAT if quiet % per_heartbeat == 0 else ""
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
            yield error_event(api, number, message, "store_unavailable")
