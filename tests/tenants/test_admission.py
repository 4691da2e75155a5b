"""The admission door counts choices (a request's prompts × n), the sequences max_num_seqs and
max_waiting_requests bound, not HTTP requests: one request of many choices no longer fills the engine's queue past
its bound while the door counts one; a request larger than the whole door still comes in where nothing else is open.
In this process, the tiny model with a door of 4 running + 1 waiting."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import gevent
import gevent.event
import pytest

from ..conftest import tiny_settings
from ..support.in_process import InProcessServer
from ..support.server import ENDLESS
from ..support.sse_client import events

DOOR = {"max_num_seqs": 4, "max_waiting_requests": 1}  # 5 choices in flight


@pytest.fixture(scope="module")
def small_door(tiny_model_dirs):
    with InProcessServer(tiny_settings(tiny_model_dirs, **DOOR)) as server:
        yield server


def test_the_door_counts_choices_and_a_lone_large_request_comes_in(small_door):
    started, done = gevent.event.Event(), gevent.event.Event()

    def hold(n: int) -> None:  # an endless stream of n choices, open until ``done``
        body = {"prompt": [1, 2, 3], "n": n, "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}
        with small_door.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for event in events(r):
                if event.data:
                    started.set()
                if done.is_set():
                    return

    refused_before = small_door.metrics().get("wsgi_infer:requests_refused_total", 0)
    holder = gevent.spawn(hold, 3)
    try:
        assert started.wait(60)
        with small_door.client() as http:
            for body in ({"prompt": "Hi", "n": 3}, {"prompt": ["Hi", "Ho", "Ha"]}):  # 3 + 3 > 5: counted 1 + 1 before
                with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 2, "stream": True}) as r:
                    assert r.status_code == 429, body  # (streamed: admitted, it would wait behind the endless ones)
                    assert r.read() and r.json()["error"]["code"] == "too_many_requests"
            one = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert one.status_code == 200, one.text  # 3 + 1 fits, and runs beside them
        assert small_door.metrics()["wsgi_infer:requests_refused_total"] == refused_before + 2  # (no metric before)
    finally:
        done.set()
        gevent.joinall([holder], timeout=60, raise_error=True)
    model = small_door.manager.default
    with gevent.Timeout(60, AssertionError("the held stream was never released")):
        while model.num_open_choices:  # its client left: released once the stream log sees it go (the hub runs)
            gevent.sleep(0.05)
    with small_door.client() as http:  # once idle, 6 choices in one request: larger than the door, alone
        large = http.post("/v1/completions", json={"prompt": ["Hi", "Ho"], "n": 3, "max_tokens": 2})
    assert large.status_code == 200 and len(large.json()["choices"]) == 6, large.text
    assert model.num_open_choices == 0


@pytest.fixture(scope="module")
def keyed_door(tiny_model_dirs):
    with InProcessServer(tiny_settings(tiny_model_dirs, api_key="key-a,key-b", **DOOR)) as server:
        yield server


@contextmanager
def streams_at_once(server: InProcessServer, count: int, key: str | None = None) -> Iterator[list[int]]:
    """``count`` endless text streams sent at once: their statuses, once all are answered; open until the block
    ends."""
    statuses, done = [], gevent.event.Event()
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def stream(i: int) -> None:
        body = {"prompt": f"Burst number {i}", "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}
        with server.client(headers=headers) as http, http.stream("POST", "/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            if r.status_code == 200:
                done.wait(60)

    burst = [gevent.spawn(stream, i) for i in range(count)]
    try:
        with gevent.Timeout(60, AssertionError(f"the burst was not answered: {statuses}")):
            while len(statuses) < count:
                gevent.sleep(0.05)
        yield sorted(statuses)
    finally:
        done.set()
        gevent.joinall(burst, timeout=60, raise_error=True)


def released(server: InProcessServer) -> None:
    model = server.manager.default
    with gevent.Timeout(60, AssertionError("the burst's streams were never released")):
        while model.num_open_choices or any(model.open_by_key.values()):
            gevent.sleep(0.05)


def test_a_burst_of_text_prompts_is_counted_at_the_door_while_they_are_tokenized(small_door):
    """Tokenizing yields to the hub: each request of a burst saw the door's count without the others, and all came
    in (60 text prompts at once through a door of 8, the load probe; token ids, not tokenized, were counted)."""
    with streams_at_once(small_door, 8) as statuses:
        assert statuses == [200] * 5 + [429] * 3
    released(small_door)


def test_a_newcomer_keys_burst_through_a_full_door_takes_its_equal_share_only(keyed_door):
    """A full door lets in another key's requests while it holds under an equal share of it (5 / 2 keys); a burst's
    requests each saw its key hold none, and all came in."""
    with streams_at_once(keyed_door, 5, "key-a") as filled, streams_at_once(keyed_door, 6, "key-b") as newcomer:
        assert filled == [200] * 5 and newcomer == [200] * 3 + [429] * 3
    released(keyed_door)
