"""Resumable streams: every event has an id; GET /v1/streams/<id> with Last-Event-ID resumes."""

from __future__ import annotations

import signal
import time

import pytest

from wsgi_infer import SamplingParams

from ..support.server import ENDLESS, GunicornServer, stop_together, wait_until
from ..support.sse_client import events, text_of

pytestmark = pytest.mark.slow  # real processes

BODY = {
    "prompt": "Resume me",
    "max_tokens": 300,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.fixture(scope="module")
def server(gunicorn_server, tiny_model_dirs):
    # A cut stream is abandoned one heartbeat interval after its reader left: 10 s is the window a
    # resume has, far more than it needs. Finished streams expire after 5 s: their replay comes within it even
    # beside a CI stall (0.9-2 s).
    settings = {
        "model": tiny_model_dirs["llama"],
        "dtype": "float32",
        "quantization": "none",
        "heartbeat_seconds": 10.0,
        "resume_keep_seconds": 5.0,
    }
    return gunicorn_server(settings)


def start_then_cut(
    server: GunicornServer,
    after: int = 5,
    path: str = "/v1/completions",
    body: dict = BODY,
    headers: dict | None = None,
):
    """Start a stream, read ``after`` events, drop the connection; the stream id and the events."""
    with server.client(headers=headers or {}) as http, http.stream("POST", path, json=body) as r:
        received = []
        for event in events(r):
            if event.data:
                received.append(event)
            if len(received) == after:
                return r.headers["x-stream-id"], received  # leaving the block cuts the connection
    raise AssertionError(
        f"the stream ended before the cut: {r.status_code}, {received}\n" + "\n".join(server.lines[-30:])
    )


def test_a_cut_stream_resumes_from_the_next_event(server, tiny_llama):
    expected = tiny_llama.generate("Resume me", SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))[0].text
    stream_id, received = start_then_cut(server)
    assert [e.id for e in received] == ["1", "2", "3", "4", "5"]
    with server.client() as http, http.stream("GET", f"/v1/streams/{stream_id}", headers={"Last-Event-ID": "5"}) as r:
        assert r.status_code == 200
        rest = [e for e in events(r) if e.data]
    assert [int(e.id) for e in rest] == list(range(6, 6 + len(rest)))  # nothing lost, nothing repeated
    assert rest[-1].data == "[DONE]" and rest[-2].json["usage"]["completion_tokens"] == 300
    assert text_of(received) + text_of(rest) == expected


def test_a_cut_chat_stream_resumes_over_plain_http(server, tiny_llama):
    messages = [{"role": "user", "content": "Resume this chat"}]
    expected = tiny_llama.chat(messages, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0].text
    body = {"messages": messages, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    stream_id, received = start_then_cut(server, path="/v1/chat/completions", body=body)
    with server.client() as http, http.stream("GET", f"/v1/streams/{stream_id}", headers={"Last-Event-ID": "5"}) as r:
        rest = [e for e in events(r) if e.data]
    assert [int(e.id) for e in rest] == list(range(6, 6 + len(rest))) and rest[-1].data == "[DONE]"
    chunks = [e.json["choices"][0]["delta"] for e in received + rest[:-1]]
    assert chunks[0]["role"] == "assistant"
    assert "".join(c.get("content", "") for c in chunks) == expected


def test_a_finished_stream_replays_then_expires(server):
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 5}) as r:
            stream_id = r.headers["x-stream-id"]
            original = [e for e in events(r) if e.data]
        with http.stream("GET", f"/v1/streams/{stream_id}") as r:
            replay = [e for e in events(r) if e.data]
        assert [(e.id, e.data) for e in replay] == [(e.id, e.data) for e in original]
        deadline = time.monotonic() + 20
        while http.get(f"/v1/streams/{stream_id}").status_code == 200:  # kept 5 s after it finished
            assert time.monotonic() < deadline, "the finished stream never expired"
            time.sleep(0.1)
        gone = http.get(f"/v1/streams/{stream_id}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "stream_not_found"


def test_unknown_stream_and_bad_last_event_id(server):
    with server.client() as http:
        missing = http.get("/v1/streams/nope")
        assert missing.status_code == 404 and "unknown or has expired" in missing.json()["error"]["message"]
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 3}) as r:
            stream_id = r.headers["x-stream-id"]
            list(events(r))
        bad = http.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": "x"})
        assert bad.status_code == 400


def cancelled_while_read(reader: GunicornServer, canceller: GunicornServer, headers: dict | None = None) -> tuple:
    """An endless stream on ``reader``, cancelled through ``canceller`` after its first events: the cancel's reply,
    the events its reader saw after the cancel, and how long they took to end."""
    body, headers = {**BODY, "max_tokens": ENDLESS}, headers or {}
    with reader.client(headers=headers) as http, http.stream("POST", "/v1/completions", json=body) as r:
        received = events(r)
        assert next(e for e in received if e.data)
        with canceller.client(headers=headers) as other:
            start, cancel = time.monotonic(), other.delete(f"/v1/streams/{r.headers['x-stream-id']}")
            assert cancel.status_code == 200, cancel.text
            rest = []
            for event in (e for e in received if e.data):
                rest.append(event)
                if time.monotonic() - start > 10:  # not ended: the assertions on its end fail
                    break
            again = other.delete(f"/v1/streams/{r.headers['x-stream-id']}")
    return cancel.json(), rest, time.monotonic() - start, again.json()


def test_a_cancelled_stream_ends_at_once_for_its_reader_and_frees_everything(server):
    """A cut stream waits a heartbeat (10 s here) for a resume; a client's stop (DELETE) did not exist: the chat
    page's Stop held the generation, its key's place and its blocks for the heartbeat."""
    mark = len(server.lines)
    cancel, rest, seconds, again = cancelled_while_read(server, server)
    assert cancel["cancelled"] and not again["cancelled"]
    assert rest[-2].json["choices"][0]["finish_reason"] == "abort"
    assert rest[-1].name == "error" and rest[-1].json["error"]["code"] == "stream_cancelled"
    assert seconds < 5, seconds  # not a heartbeat's wait
    wait_until(lambda: server.metrics()["wsgi_infer:open_streams"] == 0, "the cancelled stream closed")
    # the engine's answer to the abort, which comes after the counters it changed (its blocks freed)
    server.wait_for_log(r"response ended early, aborted 1 unfinished", after=mark, timeout=10)
    metrics = server.metrics()
    assert metrics["wsgi_infer:kv_blocks_free"] == metrics["wsgi_infer:kv_blocks_total"]
    with server.client() as http:
        assert http.delete("/v1/streams/nope").json()["error"]["code"] == "stream_not_found"


KEY_ONE, KEY_TWO = ({"Authorization": f"Bearer {key}"} for key in ("key-one", "key-two"))


@pytest.fixture(scope="module")
def instances(tiny_model_dirs, redis_url):
    """Two servers sharing one Redis, as two hosts behind one proxy; two API keys."""
    settings = {
        "model": tiny_model_dirs["llama"],
        "dtype": "float32",
        "quantization": "none",
        "heartbeat_seconds": 10.0,
        "redis_url": redis_url,
        "api_key": "key-one,key-two",
    }
    with GunicornServer(settings) as first, GunicornServer(settings) as second:
        yield first.wait_ready(), second.wait_ready()
        # A quick stop: the lease test leaves an endless stream unread, which a drain waits out for its grace (a
        # heartbeat here, 10 s) before it counts the worker idle.
        stop_together([first, second], signal.SIGINT)


def test_a_resume_can_reach_another_instance_sharing_redis(instances, tiny_llama):
    expected = tiny_llama.generate("Resume me", SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))[0].text
    first, second = instances
    stream_id, received = start_then_cut(first, headers=KEY_ONE)
    with second.client(headers=KEY_ONE) as http:  # the other instance: only Redis holds the stream there
        with http.stream("GET", f"/v1/streams/{stream_id}", headers={"Last-Event-ID": "5"}) as r:
            assert r.status_code == 200
            rest = [e for e in events(r) if e.data]
        assert http.get("/v1/streams/unknown").status_code == 404
        assert http.get(f"/v1/streams/{stream_id}", headers=KEY_TWO).status_code == 404  # another key's
    assert [int(e.id) for e in received + rest] == list(range(1, 1 + len(received) + len(rest)))
    assert rest[-1].data == "[DONE]"
    assert text_of(received) + text_of(rest) == expected
    past_the_end = {"Last-Event-ID": str(len(received) + len(rest) + 10)}
    for server in instances:  # nothing after it, from memory as from Redis (which said stream_lost: none died)
        with server.client(headers=KEY_ONE) as http:
            with http.stream("GET", f"/v1/streams/{stream_id}", headers=past_the_end) as r:
                assert r.status_code == 200 and [e.data for e in events(r) if e.data] == []


def test_a_stream_cancelled_through_another_instance_ends_where_it_runs(instances):
    """The word goes through Redis: the instance generating it hears it with its next lease renewal (a second)."""
    first, second = instances
    cancel, rest, seconds, _ = cancelled_while_read(first, second, KEY_ONE)
    assert cancel["cancelled"] and rest[-1].json["error"]["code"] == "stream_cancelled" and seconds < 5, seconds
    with second.client(headers=KEY_TWO) as http:
        assert http.delete(f"/v1/streams/{cancel['id']}").status_code == 404  # another key's


def test_a_stored_response_is_continued_on_another_instance_by_its_key_only(instances):
    first, second = instances
    ask = {"input": "Hello there", "max_output_tokens": 4, "temperature": 0}
    with first.client(headers=KEY_ONE) as http:
        created = http.post("/v1/responses", json=ask).json()
    with second.client(headers=KEY_ONE) as http:
        assert http.get(f"/v1/responses/{created['id']}").json() == created
        follow = http.post("/v1/responses", json={**ask, "previous_response_id": created["id"]}).json()
        assert follow["status"] == "incomplete" and follow["usage"]["input_tokens"] > created["usage"]["input_tokens"]
        refused = http.post("/v1/responses", json={**ask, "previous_response_id": created["id"]}, headers=KEY_TWO)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "previous_response_not_found"


def test_a_streams_leases_last_seconds_whatever_the_heartbeat(instances, redis_url):
    """Renewed every second and lapsing after three renewals missed: with these servers' 10 s heartbeats, a host
    that dies is known to be gone (``stream_lost``) within seconds; three heartbeats were 30 s."""
    import redis as redis_py

    first, second = instances
    leases = redis_py.Redis.from_url(redis_url)
    body = {**BODY, "max_tokens": ENDLESS}
    with first.client(headers=KEY_ONE) as http, http.stream("POST", "/v1/completions", json=body) as r:
        produced = events(r)  # held: a dropped generator would close the connection
        assert next(e for e in produced if e.data)
        (producer,) = [k for k in leases.keys("wsgi-infer:stream:*:producer") if r.headers["x-stream-id"].encode() in k]
        key = producer.removesuffix(b":producer").decode()  # its key's too (a stream's id is kept apart by key)
        assert 0 < leases.pttl(producer) <= 3000
        assert_renewed(leases, producer)
        with second.client(headers=KEY_ONE) as other, other.stream("GET", f"/v1/streams/{r.headers['x-stream-id']}"):
            wait_until(lambda: leases.exists(f"{key}:reader"), "the reader's lease")
            assert 0 < leases.pttl(f"{key}:reader") <= 3000
            assert_renewed(leases, f"{key}:reader")


def assert_renewed(leases, key: str | bytes) -> None:
    """The lease ``key`` is renewed: it comes to have more time left than a lease set once could (by 300 ms)."""
    left, since = leases.pttl(key), time.monotonic()

    def renewed() -> bool:
        unrenewed = left - 1000 * (time.monotonic() - since)  # read before the pttl: at least what it would have
        return leases.pttl(key) > unrenewed + 300

    wait_until(renewed, f"{key!r} renewed", timeout=10)


def test_a_responses_stream_is_read_while_it_runs_then_only_while_it_is_stored(instances):
    """Deleted, or ended with ``store: false``, a response's stream replays nowhere: not by its own route nor by
    /v1/streams, on neither instance (the other reads Redis's copy); it was readable for the streams' keep time."""
    first, second = instances
    ask = {"input": "Hello there", "temperature": 0, "stream": True}
    response_id, _ = start_then_cut(
        first, path="/v1/responses", body={**ask, "max_output_tokens": 300}, headers=KEY_ONE
    )
    urls = (f"/v1/responses/{response_id}?stream=true", f"/v1/streams/{response_id}")
    with second.client(headers=KEY_ONE) as http:
        refused = http.delete(f"/v1/responses/{response_id}")  # still generating: not yet stored, and no 404
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "response_in_progress", refused.text
        assert http.delete(f"/v1/streams/{response_id}").json()["cancelled"]
        wait_until(lambda: http.get(f"/v1/responses/{response_id}").status_code == 200, "the cancelled one stored")
        assert [http.get(url).status_code for url in urls] == [200, 200]
        assert http.delete(f"/v1/responses/{response_id}").json()["deleted"]
    unstored = []
    for server in instances:
        with server.client(headers=KEY_ONE) as http:
            with http.stream("POST", "/v1/responses", json={**ask, "max_output_tokens": 3, "store": False}) as r:
                unstored.append(r.headers["x-stream-id"])
                assert [e.json["type"] for e in events(r) if e.data][-1] == "response.incomplete"
    for server in instances:
        with server.client(headers=KEY_ONE) as http:
            for stream_id in (response_id, *unstored):
                assert [http.get(url.replace(response_id, stream_id)).status_code for url in urls] == [404, 404]
