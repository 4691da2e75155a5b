"""A stream's log in the worker's memory, without a server: what its readers get on the wire."""

from __future__ import annotations

import itertools
import json

import gevent
import gevent.event
import pytest
from openai._streaming import SSEDecoder

from wsgi_infer.server.metrics import ModelMetrics
from wsgi_infer.server.streaming import sse, stream_log
from wsgi_infer.server.streaming.stream_endings import RETRY_MS, error_event
from wsgi_infer.server.streaming.stream_log import StreamInterrupted, StreamLog, StreamLogs

from ..support.in_process import interrupted_endings


def new_log() -> StreamLog:
    return StreamLog("s", grace=60.0, on_release=lambda: None)


def test_a_heartbeat_between_numbered_events_is_no_event_for_the_openai_sdk():
    log = new_log()
    log.append(sse.event({"n": 1}))
    reader = log.read(0, heartbeat=0.01)
    assert next(reader) == ""  # at once: the response's headers go out with it
    wire = [next(reader), next(reader)]  # the event, then a heartbeat: nothing came for a while
    assert wire[1] == sse.HEARTBEAT
    log.append(sse.event({"n": 2}))
    log.finish()
    wire += list(reader)
    decoded = list(SSEDecoder().iter_bytes(iter(["".join(wire).encode()])))
    assert [(e.id, json.loads(e.data)) for e in decoded] == [("1", {"n": 1}), ("2", {"n": 2})]


def test_a_quiet_reader_yields_a_look_per_look_interval_and_a_heartbeat_per_heartbeat(monkeypatch):
    """Empty strings write nothing: they give the response a moment to look at its client (``until_gone``)."""
    monkeypatch.setattr(stream_log, "LOOK_SECONDS", 0.01)
    assert list(itertools.islice(new_log().read(0, heartbeat=60.0), 4)) == [""] * 4  # no heartbeat a minute away
    reader = new_log().read(0, heartbeat=0.5)
    looks = list(itertools.takewhile(lambda written: written != sse.HEARTBEAT, reader))
    assert looks == [""] * len(looks) and len(looks) >= 2  # the headers' own, then a look or more


def test_the_backlog_counts_what_no_reader_has_taken():
    log = new_log()
    events = [sse.event({"text": "x" * size}) for size in (10, 20, 30)]
    for text in events:
        log.append(text)
    assert log.backlog_bytes == sum(len(e) for e in events)
    reader = log.read(0, heartbeat=1.0)
    next(reader), next(reader)  # the headers' empty string, then the first event
    assert log.backlog_bytes == sum(len(e) for e in events)  # handed out, not yet written
    next(reader)  # the server asks for the next one: the first is written
    assert log.backlog_bytes == len(events[1]) + len(events[2])


def test_a_waiting_reader_wakes_on_append_and_on_finish():
    log, took = new_log(), gevent.event.Event()
    taken: list[str] = []

    def read() -> None:
        for event in filter(None, log.read(0, heartbeat=30.0)):  # the empty strings aside
            taken.append(event)
            took.set()

    reader = gevent.spawn(read)
    gevent.sleep(0)  # the reader runs until it waits
    log.append(sse.event({"n": 1}))
    assert took.wait(timeout=5) and not reader.dead  # the append alone woke it (its heartbeat is 30 s away)
    log.finish()
    reader.join(timeout=5)
    assert reader.dead and taken == [f"id: 1\n{sse.event({'n': 1})}"]


def test_a_stream_read_elsewhere_when_its_reader_here_left_is_abandoned_once_that_reader_is_gone_too():
    """A resume on another worker (through Redis) holds the stream while it reads; when it leaves too, nobody
    tells this worker: the stream is looked at again each grace period until nobody reads it anywhere."""
    elsewhere, abandoned = [True, True, False], gevent.event.Event()
    log = StreamLog("s", grace=0.01, on_release=abandoned.set, read_elsewhere=lambda: elsewhere.pop(0))
    log.append(sse.event({"n": 1}))
    reader = log.read(0, heartbeat=1.0)
    next(reader)
    reader.close()  # the client here left: a reader elsewhere took the stream over, then left too
    assert abandoned.wait(timeout=10) and elsewhere == []


def test_an_event_the_mirror_has_not_copied_wakes_no_heartbeat():
    """With Redis, each event is readable once the mirror has copied it: its append woke the reader, which wrote a
    heartbeat before every event (as many writes again)."""
    log = new_log()
    log.copied(0)  # a mirror runs: nothing readable yet
    taken: list[str] = []
    reader = gevent.spawn(lambda: taken.extend(filter(None, log.read(0, heartbeat=30.0))))
    gevent.sleep(0)
    log.append(sse.event({"n": 1}))
    gevent.sleep(0)  # the reader wakes, and finds nothing readable
    gevent.sleep(0)
    log.copied(1)
    log.finish()
    reader.join(timeout=5)
    assert reader.dead and taken == [f"id: 1\n{sse.event({'n': 1})}"]


def published_past_the_bound(events) -> list[str]:
    """The events a stream's log ends with when its events, never read, pass a backlog bound of 100 bytes."""
    logs = StreamLogs(keep_seconds=60, grace=60, backlog_bytes=100, redis_url=None, metrics=ModelMetrics("bound"))
    log = logs.publish(events, on_release=lambda: None)
    while not log.finished:
        log.wait(len(log.events), timeout=10)
    return log.events


def test_a_stream_past_the_backlog_bound_ends_as_its_route_ends_an_interrupted_stream():
    closed = []

    def route_events():
        try:
            while True:
                yield sse.event({"text": "x" * 40})
        except StreamInterrupted as exc:
            yield sse.event({"ended": exc.code}, name="route-error")
        finally:
            closed.append(True)  # where a route releases its generation

    ending = published_past_the_bound(route_events())
    assert ending[-1] == sse.event({"ended": "stream_backlog_exceeded"}, name="route-error")
    assert ending[:-1] == [sse.event({"text": "x" * 40})] * 2 and closed == [True]  # 114 bytes: past the bound


def test_a_route_that_does_not_end_an_interrupted_stream_gets_the_error_the_openai_routes_write():
    def route_events():
        while True:
            yield sse.event({"text": "x" * 40})

    ending = published_past_the_bound(route_events())[-1]
    message = json.loads(sse.fields(ending)[1])["error"]["message"]
    assert ending == interrupted_endings(message, "stream_backlog_exceeded")["openai"]


@pytest.mark.parametrize("code", ["server_shutting_down", "engine_stopped", "stream_abandoned"])
def test_an_interrupted_stream_ends_as_a_reader_of_redis_ends_it(code):
    """The same interruption reaches a client the same way, from the generating worker or from Redis's copy read
    elsewhere (``stream_endings``): OpenAI's error of a 503, the cause in its code, and a retry hint."""
    elsewhere = error_event("openai", 7, "cut short", code)
    assert interrupted_endings("cut short", code) == {"openai": elsewhere, "native": elsewhere}
    name, data = sse.fields(elsewhere)
    error = {"message": "cut short", "type": "service_unavailable_error", "param": None, "code": code}
    assert name == "error" and json.loads(data) == {"error": error} and f"\nretry: {RETRY_MS}\n" in elsewhere


def test_a_continued_stream_skips_the_events_its_client_has_and_ends_where_its_run_differs():
    """A stream continued here (``api.continuation``) writes its first events again: those its client has are
    checked and dropped; where one differs, the stream ends as its route ends an interrupted stream."""
    known = [sse.event({"n": n}) for n in (1, 2)]
    metrics = ModelMetrics("continued")
    logs = StreamLogs(keep_seconds=60, grace=60, backlog_bytes=10_000, redis_url=None, metrics=metrics)

    def route(first: list[int]):
        try:
            yield from (sse.event({"n": n}) for n in first)
            yield None  # a heartbeat between: no event
            yield sse.event({"n": 3})
        except StreamInterrupted as exc:
            yield sse.event({"ended": exc.code})

    for first, ending in (([1, 2], {"n": 3}), ([1, 5], {"ended": "stream_lost"})):
        log = logs.publish(route(first), on_release=lambda: None, known=known)
        while not log.finished:
            log.wait(len(log.events), timeout=5)  # the pump greenlet runs meanwhile
        assert log.events == [*known, sse.event(ending)]
    diverged = metrics.streams_continued("diverged")._value.get()  # prometheus_client's own count
    assert diverged == 1


def test_while_a_mirror_copies_the_stream_readers_get_only_what_redis_holds():
    """So that a host continuing the stream after this one died has every event a client had; with Redis away
    (``copied(None)``), every event goes out."""
    log = new_log()
    log.copied(0)
    for n in (1, 2, 3):
        log.append(sse.event({"n": n}))
    reader = log.read(0, heartbeat=0.01)
    assert [next(reader), next(reader)] == ["", sse.HEARTBEAT]  # three events, none in Redis yet
    log.copied(2)
    assert [next(reader), next(reader), next(reader)] == [
        f"id: 1\n{sse.event({'n': 1})}",
        f"id: 2\n{sse.event({'n': 2})}",
        sse.HEARTBEAT,
    ]
    log.finish()
    assert next(reader) == sse.HEARTBEAT  # finished, but its last event is not in Redis yet
    log.copied(None)
    assert list(reader) == [f"id: 3\n{sse.event({'n': 3})}"]
