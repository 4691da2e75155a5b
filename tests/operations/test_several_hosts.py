"""Three servers behind a real nginx running the shipped several-host file (scripts/nginx/wsgi-infer-hosts.conf),
sharing one real Redis and nothing else: a conversation keeps to one host, other requests go to the least busy,
and a draining or dead host is passed over without a failed request."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from ..support.nginx_proxy import NginxProxy, silent_address
from ..support.server import ENDLESS, GunicornServer, stop_together, wait_until
from ..support.sse_client import events

pytestmark = pytest.mark.slow  # real processes

SHORT = {"prompt": "Which host?", "max_tokens": 2, "temperature": 0}
ENDLESS_STREAM = {"prompt": "Hold on", "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}


@contextmanager
def three_hosts(tiny_model_dirs, redis_url: str, *gunicorn_args: str) -> Iterator[list[GunicornServer]]:
    settings = {
        "model": tiny_model_dirs["llama"],
        "dtype": "float32",
        "quantization": "none",
        "heartbeat_seconds": 0.3,
        "redis_url": redis_url,
    }
    with ExitStack() as stack:
        hosts = [stack.enter_context(GunicornServer(settings, *gunicorn_args)) for _ in range(3)]
        yield [host.wait_ready() for host in hosts]
        stop_together(hosts)


@pytest.fixture(scope="module")
def hosts(tiny_model_dirs, redis_url):
    with three_hosts(tiny_model_dirs, redis_url) as servers:
        yield servers


@pytest.fixture(scope="module")
def nginx(hosts):
    with NginxProxy.hosts(addresses(hosts)) as proxy:
        yield proxy


def served_by(nginx: NginxProxy, send: Callable[[], object], requests: int = 1) -> list[str]:
    """The host that answered each of the ``requests`` that ``send`` makes (``post``s: nginx's log of them)."""
    first = len(nginx.sent)
    send()
    assert len(nginx.sent) == first + requests, nginx.sent[first:]
    tried = nginx.upstreams(nginx.sent[first:])
    assert all(status != "502" for *_, (_, status) in tried), tried  # the last host tried answered
    return [hosts[-1][0] for hosts in tried]


def post(nginx: NginxProxy, path: str, body: dict, **headers: str) -> dict:
    reply = httpx.post(f"{nginx.url}{path}", json=body, headers=nginx.tagged(headers), timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def posts(nginx: NginxProxy, count: int, path: str, body: dict, **headers: str) -> Callable[[], None]:
    return lambda: [post(nginx, path, body, **headers) for _ in range(count)]


def addresses(servers: list[GunicornServer]) -> list[str]:
    return [f"127.0.0.1:{server.port}" for server in servers]


def test_a_host_that_answers_no_connect_is_passed_over(hosts):
    """A host powered off neither refuses nor resets: its conversations' requests waited proxy_connect_timeout, then
    got nginx's 504 (a timeout was not retried). Now another host serves them, and nginx's workers share the host's
    failure (its upstreams' zones)."""
    with silent_address(connects=False) as silent, NginxProxy.hosts([silent, *addresses(hosts)[:2]]) as proxy:
        first_tries = []
        for conversation in (f"off{i}" for i in range(60)):  # a third of them are the silent host's
            served = served_by(proxy, posts(proxy, 1, "/v1/completions", SHORT, **{"X-Session-Id": conversation}))
            (tries,) = proxy.upstreams(proxy.sent[-1:])
            assert served[0] != silent, tries
            first_tries.append(tries[0])
            if first_tries.count((silent, "504")) and len(first_tries) >= 12:
                break
    assert first_tries.count((silent, "504")) == 1, first_tries  # tried once, then passed over for fail_timeout


@pytest.mark.parametrize("named_by", ["X-Session-Id", "prompt_cache_key", "user"])
def test_each_conversation_keeps_to_one_host_and_conversations_spread(nginx, named_by):
    owners = set()
    for conversation in (f"conversation-{i}" for i in range(12)):  # all on one host of three: 3^-11, about 6e-6
        headers = {named_by: conversation} if named_by == "X-Session-Id" else {}
        body = SHORT if headers else {**SHORT, named_by: conversation}
        served = served_by(nginx, posts(nginx, 2, "/v1/completions", body, **headers), 2)
        assert len(set(served)) == 1, (conversation, served)
        owners.add(served[0])
    assert len(owners) > 1


def test_a_responses_chain_keeps_to_the_host_of_its_conversation(nginx):
    ask = {"input": "Hello there", "max_output_tokens": 2, "temperature": 0}
    chain = [post(nginx, "/v1/responses", ask)["id"]]  # no conversation yet: the least busy host

    def continue_it() -> None:  # each turn continues the one before, stored in the shared Redis
        for _ in range(4):
            chain.append(post(nginx, "/v1/responses", {**ask, "previous_response_id": chain[-1]})["id"])

    served = served_by(nginx, continue_it, 4)
    assert len(set(served)) == 1, served
    assert {turn[:21] for turn in chain} == {chain[0][:21]}  # "resp_" and the conversation's 16 hex digits


def test_requests_without_a_conversation_go_to_the_least_busy_host(hosts, nginx):
    held = []  # each stream's events: a dropped generator would close its connection
    with ExitStack() as streams:
        for _ in range(2):  # each endless stream holds its host's connection
            http = streams.enter_context(httpx.Client(base_url=nginx.url, timeout=60))
            held.append(events(streams.enter_context(http.stream("POST", "/v1/completions", json=ENDLESS_STREAM))))
            assert next(e for e in held[-1] if e.data)

        def running() -> list[float]:
            return [host.metrics()["wsgi_infer:num_requests_running"] for host in hosts]

        wait_until(lambda: sorted(running()) == [0, 1, 1], "the second stream on another host than the first")
        idle = addresses(hosts)[running().index(0)]
        # Short requests, one after another, all go to the one host without a stream (round robin: to each).
        assert served_by(nginx, posts(nginx, 4, "/v1/completions", SHORT), 4) == [idle] * 4


def test_a_draining_host_then_a_dead_one_are_passed_over(tiny_model_dirs, redis_url):
    """SIGTERM: the host stops accepting, answers 503 on kept-alive connections, and finishes its stream; SIGKILL:
    it refuses. Either way its conversations' requests are served by the others, none failing."""
    # Keep-alive 3 s (nginx's pool holds 4): the connection of the turn just before the SIGTERM is still pooled when
    # the next turn comes; the drain's deadline is 10 - 3 - 2 = 5 s.
    gunicorn_args = ("--graceful-timeout", "10", "--keep-alive", "3")
    with (
        three_hosts(tiny_model_dirs, redis_url, *gunicorn_args) as servers,
        NginxProxy.hosts(addresses(servers)) as proxy,
    ):
        owners = {}  # a conversation of each host (as above: all on one, about 1e-7)
        for conversation in (f"c{i}" for i in range(16)):
            (owner,) = served_by(proxy, posts(proxy, 1, "/v1/completions", SHORT, **{"X-Session-Id": conversation}))
            owners.setdefault(addresses(servers).index(owner), conversation)
        draining, dead = list(owners)[:2]
        held = {"X-Session-Id": owners[draining]}
        with (
            httpx.Client(base_url=proxy.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=ENDLESS_STREAM, headers=held) as reply,
        ):
            received = events(reply)
            assert next(e for e in received if e.data)
            # A turn of its conversation beside the stream: nginx pools that second connection to the host.
            assert served_by(proxy, posts(proxy, 1, "/v1/completions", SHORT, **held)) == [addresses(servers)[draining]]
            servers[draining].process.send_signal(signal.SIGTERM)
            servers[draining].wait_for_log(r"draining: 1 open requests")
            # Its conversation, while its own stream still runs there: another host answers every request. The
            # first is sent on the pooled connection, which the draining host answers with a 503 (no longer
            # listening, it refuses the others' new connections).
            served = served_by(proxy, posts(proxy, 3, "/v1/completions", SHORT, **held), 3)
            assert addresses(servers)[draining] not in served
            (first_tries, *_) = proxy.upstreams(proxy.sent[-3:])
            assert first_tries[0] == (addresses(servers)[draining], "503"), first_tries
            ending = [e for e in received if e.data][-1]
        assert ending.name == "error" and ending.json["error"]["code"] == "server_shutting_down"
        assert servers[draining].process.wait(15) == 0
        os.killpg(servers[dead].process.pid, signal.SIGKILL)  # master and workers
        servers[dead].process.wait(10)
        served = served_by(proxy, posts(proxy, 3, "/v1/completions", SHORT, **{"X-Session-Id": owners[dead]}), 3)
        (survivor,) = set(range(3)) - {draining, dead}
        assert set(served) == {addresses(servers)[survivor]}
