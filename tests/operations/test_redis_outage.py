"""Redis goes away: streams go on from the worker's memory, resumes that need Redis get a 503,
and when it returns every stream is mirrored again. A worker that dies ends its readers elsewhere."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import gevent
import httpx
import pytest
import redis

from wsgi_infer import SamplingParams
from wsgi_infer.server.metrics import ModelMetrics
from wsgi_infer.server.streaming import sse
from wsgi_infer.server.streaming.redis_store import RedisStore
from wsgi_infer.server.streaming.stream_endings import API_SHAPES
from wsgi_infer.server.streaming.stream_log import StreamLog

from ..support.in_process import interrupted_endings
from ..support.server import GunicornServer, RedisServer, labelled_samples, stop_together
from ..support.sse_client import Event, events, text_of

pytestmark = pytest.mark.slow  # real processes

HEARTBEAT_S = 2.0
LONG = 800  # tokens: each stream is still generating while Redis dies (seconds of steps for four)


def body(prompt: str, max_tokens: int = LONG) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def instances(tiny_model_dirs, tmp_path_factory):
    """Redis (the last of a list: a test may restart it), and two instances sharing it (a resume
    on the second only finds the stream in Redis)."""
    redis_servers = [RedisServer(tmp_path_factory.mktemp("redis"))]
    settings = {
        "model": tiny_model_dirs["llama"],
        "dtype": "float32",
        "quantization": "none",
        "heartbeat_seconds": HEARTBEAT_S,
        "redis_url": redis_servers[0].url,
    }
    try:
        with GunicornServer(settings) as first, GunicornServer(settings) as second:
            yield redis_servers, first.wait_ready(), second.wait_ready()
            stop_together([first, second])
    finally:
        for redis_server in redis_servers:
            redis_server.stop()


def take(stream: Iterator[Event], received: list[Event], count: int | None = None) -> None:
    """Append the next ``count`` data events of ``stream`` to ``received`` (all of them with None)."""
    for event in stream:
        if event.data:
            received.append(event)
            if count is not None and (count := count - 1) == 0:
                return


def test_streams_outlive_a_redis_outage_and_are_mirrored_again(instances, tiny_llama):
    redis_servers, first, second = instances
    redis_server = redis_servers[-1]
    prompts = [f"Outage {i}" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    expected = [out.text for out in tiny_llama.generate(prompts, params)]
    with first.client() as http, second.client() as other, ThreadPoolExecutor(4) as pool, ExitStack() as opened:
        responses = [opened.enter_context(http.stream("POST", "/v1/completions", json=body(p))) for p in prompts]
        streams, received = [events(r) for r in responses], [[] for _ in prompts]
        for stream, seen in zip(streams, received, strict=True):
            take(stream, seen, 3)
        mark = len(first.lines)
        redis_server.stop(signal.SIGKILL)
        first.wait_for_log(r"Redis is unavailable", after=mark)
        assert first.metrics()["wsgi_infer:num_requests_running"] > 0  # the outage hit running streams

        readers = [pool.submit(take, stream, seen) for stream, seen in zip(streams, received, strict=True)]
        stream_id = responses[0].headers["x-stream-id"]
        _assert_outage_answers(http, other, stream_id)
        for reader in readers:
            reader.result(timeout=120)

        for seen, text in zip(received, expected, strict=True):
            assert [int(e.id) for e in seen] == list(range(1, len(seen) + 1))
            assert seen[-1].data == "[DONE]" and text_of(seen) == text  # nothing lost, nothing cut

        marks = len(first.lines), len(second.lines)
        redis_servers.append(redis_server.again())  # empty: the mirrors copy every event again
        first.wait_for_log(r"Redis is back", after=marks[0])
        second.wait_for_log(r"Redis is back", after=marks[1])
        first.wait_for_metric("wsgi_infer:streams_unmirrored", 0)
        with other.stream("GET", f"/v1/streams/{stream_id}") as r:
            assert r.status_code == 200
            replay = [e for e in events(r) if e.data]
        assert [(e.id, e.data) for e in replay] == [(e.id, e.data) for e in received[0]]
        with other.stream("GET", f"/v1/streams/{_cut_after(http, 'After the outage')}") as r:
            assert r.status_code == 200 and [e for e in events(r) if e.data][-1].data == "[DONE]"


def _assert_outage_answers(http: httpx.Client, other: httpx.Client, stream_id: str) -> None:
    """While Redis is down: new streams work, resumes here work from memory, elsewhere get a JSON 503."""
    with http.stream("POST", "/v1/completions", json=body("During the outage", 20)) as r:
        assert r.status_code == 200 and [e for e in events(r) if e.data][-1].data == "[DONE]"
    with http.stream("GET", f"/v1/streams/{stream_id}", headers={"Last-Event-ID": "1"}) as r:
        first_resumed = next(e for e in events(r) if e.data)
        assert r.status_code == 200 and first_resumed.id == "2"
    elsewhere = other.get(f"/v1/streams/{stream_id}")
    assert elsewhere.status_code == 503 and elsewhere.headers["retry-after"] == "1"
    assert elsewhere.json()["error"]["code"] == "store_unavailable"


def _cut_after(http: httpx.Client, prompt: str, max_tokens: int = 50) -> str:
    with http.stream("POST", "/v1/completions", json=body(prompt, max_tokens)) as r:
        return r.headers["x-stream-id"]  # leaving the block cuts the connection


def test_a_resume_elsewhere_continues_a_stream_whose_worker_is_killed(instances, tiny_llama):
    """The worker dies under the stream (its master starts another); the resume on the other instance, which was
    reading Redis's copy, continues the generation there once the lease has lapsed: the whole text, each token
    once."""
    _, first, second = instances
    prompt, max_tokens = "Killed mid-stream", 2000  # seconds of steps: it runs at the kill
    expected = tiny_llama.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    with first.client() as http:
        stream_id = _cut_after(http, prompt, max_tokens)
    with second.client(timeout=10 * HEARTBEAT_S) as other:
        with other.stream("GET", f"/v1/streams/{stream_id}") as r:
            assert r.status_code == 200
            iterator = events(r)
            received = [next(e for e in iterator if e.data)]
            assert received[0].id == "1"
            for pid in first.worker_pids():
                os.kill(pid, signal.SIGKILL)
            received += [e for e in iterator if e.data]
    assert [int(e.id) for e in received] == list(range(1, len(received) + 1))
    assert received[-1].data == "[DONE]" and text_of(received) == expected[0].text
    continued = labelled_samples(httpx.get(f"{second.url}/metrics").text, "wsgi_infer:streams_continued_total")
    assert continued == {(("outcome", "continued"),): 1.0}


def test_a_mirror_that_slept_through_an_outage_copies_its_whole_log_again(tmp_path, caplog):
    """Only the mirror that fails sees an outage; one waiting for its stream's next event meanwhile
    must not trust what the old Redis held once an empty one is back."""
    redis_server = RedisServer(tmp_path)
    # A long heartbeat: the sleeping mirror renews nothing, so it never meets the outage itself.
    store = RedisStore(redis_server.url, keep_seconds=60, heartbeat=30, metrics=ModelMetrics("mirror-test"))
    client = redis.Redis.from_url(redis_server.url)
    busy, sleeping = (StreamLog(name, grace=60, on_release=lambda: None) for name in ("busy", "sleeping"))

    def until(condition, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, what
            gevent.sleep(0.01)  # the mirrors are greenlets of this thread: let them run

    def copied(stream_log: StreamLog) -> list[bytes]:
        try:
            return [fields.get(b"event", b"<end>") for _, fields in client.xrange(store.key(stream_log.stream_id))]
        except redis.ConnectionError:
            return []

    try:
        for stream_log in (busy, sleeping):
            stream_log.append(sse.event({"n": 1}))
            store.mirror(stream_log)
        until(lambda: copied(busy) and copied(sleeping), "the first events were never mirrored")
        redis_server.stop(signal.SIGKILL)
        busy.append(sse.event({"n": 2}))  # its mirror fails, and takes Redis for gone
        until(lambda: "Redis is unavailable" in caplog.text, "the busy mirror never saw Redis fail")
        sleeping.append(sse.event({"n": 2}))
        redis_server = redis_server.again()
        for stream_log in (busy, sleeping):
            stream_log.finish()
        until(lambda: copied(busy)[-1:] == copied(sleeping)[-1:] == [b"<end>"], "the mirrors never ended")
        for stream_log in (busy, sleeping):
            assert copied(stream_log) == [e.encode() for e in stream_log.events] + [b"<end>"]
    finally:
        redis_server.stop()


@pytest.mark.parametrize("api", API_SHAPES)
def test_a_reader_elsewhere_ends_a_lost_stream_in_its_apis_shape(tmp_path, api):
    """The generating worker is gone (its producer lease lapsed) while another reads its stream from Redis: the
    reader's last event is the error in the stream's own API's shape (its number after the events read)."""
    redis_server = RedisServer(tmp_path)
    store = RedisStore(redis_server.url, keep_seconds=60, heartbeat=0.2, metrics=ModelMetrics(f"lost-{api}"))
    client = redis.Redis.from_url(redis_server.url)
    stream_log = StreamLog(f"lost-{api}", grace=60, on_release=lambda: None, api=api)
    key = store.key(stream_log.stream_id)
    try:
        for n in (1, 2):
            stream_log.append(sse.event({"n": n}))
        store.mirror(stream_log)
        deadline = time.monotonic() + 20
        while len(client.xrange(key)) < 2:
            assert time.monotonic() < deadline, "the events were never mirrored"
            gevent.sleep(0.01)  # the mirror is a greenlet of this thread: let it run
        reader = store.open(stream_log.stream_id)
        client.delete(f"{key}:producer")  # as its lease lapses when the worker dies (no greenlet renews it now)
        frames = list(reader.read(after=1, heartbeat=0.2))
    finally:
        redis_server.stop()
    assert frames[0] == ""  # at once: the response's headers go out with it
    frames = list(filter(None, frames))  # and each quiet read's, which writes nothing
    assert frames[0] == f"id: 2\n{stream_log.events[1]}"
    name, data = sse.fields(frames[-1])
    error = json.loads(data)
    assert name == "error"
    if api == "anthropic":
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    elif api == "responses":
        assert (error["type"], error["code"], error["sequence_number"]) == ("error", "stream_lost", 2)
    else:  # the event the route writes on the generating worker, where it can
        assert error["error"]["code"] == "stream_lost"
        assert frames[-1] == interrupted_endings(error["error"]["message"], "stream_lost")["openai"]


def test_a_mirror_back_from_an_outage_to_find_its_stream_ended_by_another_host_hands_it_over(tmp_path):
    """A host paused past its lease (a VM's pause) has a Redis command time out as it wakes; by then another host
    continued its stream to the end. Its mirror, asking Redis what it holds, took that end for its own and stopped,
    leaving its reader waiting on a generation nobody copies (the failover test hung 300 s in a loaded run)."""
    redis_server = RedisServer(tmp_path)
    store = RedisStore(redis_server.url, keep_seconds=60, heartbeat=0.2, metrics=ModelMetrics("woken"))
    client = redis.Redis.from_url(redis_server.url)
    stream_log = StreamLog("woken", grace=60, on_release=lambda: None)
    key = store.key(stream_log.stream_id)
    try:
        stream_log.append(sse.event({"n": 1}))
        store.mirror(stream_log)
        deadline = time.monotonic() + 20
        while not client.xrange(key):
            assert time.monotonic() < deadline, "the first event was never mirrored"
            gevent.sleep(0.01)  # the mirror is a greenlet of this thread: let it run
        client.delete(f"{key}:producer")  # the other host's continuation, to its end
        client.xadd(key, {"event": sse.event({"n": "theirs"})}, id="2-0")
        client.xadd(key, {"end": "1"}, id="3-0")
        store._epoch += 1  # as Redis's return after an error: the mirror asks Redis what it holds
        stream_log.append(sse.event({"n": 2}))
        while not stream_log.moved:
            assert time.monotonic() < deadline + 20, "the mirror took the other host's end for its own"
            gevent.sleep(0.01)
    finally:
        redis_server.stop()
