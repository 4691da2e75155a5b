"""Limits per API key on real servers: a 429 in OpenAI's shape with Retry-After and x-ratelimit-* headers, a limit
that two workers (and, through Redis, two servers) count together, counters that recover, and metrics by key id
that never show the key."""

from __future__ import annotations

import json
import os
import signal
import socket

import httpx
import openai
import pytest

from wsgi_infer.server.tenants.redis_limits import HEARTBEAT_SECONDS, PREFIX

from ..support.server import GunicornServer, RedisServer, labelled_samples, wait_until

pytestmark = pytest.mark.slow  # real processes

KEYS = """
[keys.solo]
key = "solo-secret"
max_concurrent_requests = 1

[keys.meter]
key = "meter-secret"
generated_tokens_per_minute = 1200

[keys.free]
key = "free-secret"
"""


def _settings(tiny_model_dirs, tmp_path, **more) -> dict:
    (tmp_path / "keys.toml").write_text(KEYS)
    keys_file = str(tmp_path / "keys.toml")
    return {"model": tiny_model_dirs["llama"], "dtype": "float32", "keys_file": keys_file, **more}


def _ask(http: httpx.Client, key: str, timeout: float | None = None, **body) -> httpx.Response:
    body = {"prompt": "Once upon a time", "max_tokens": 4, **body}
    headers = {"Authorization": f"Bearer {key}"}
    return http.post("/v1/completions", json=body, headers=headers, **({"timeout": timeout} if timeout else {}))


def _open_stream(http: httpx.Client, key: str):
    """A streamed request that stays open (EOS ignored, far from its end) until the caller closes it."""
    body = {"prompt": "Once upon a time", "max_tokens": 30_000, "ignore_eos": True, "stream": True}
    response = http.send(
        http.build_request("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}),
        stream=True,
    )
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: {"))  # admitted, and generating
    return response


def _assert_limited(response: httpx.Response, limit_word: str) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert limit_word in error["message"] and int(response.headers["retry-after"]) >= 1


def test_a_key_over_its_concurrency_gets_429_from_the_other_worker_too(tiny_model_dirs, tmp_path):
    with GunicornServer(_settings(tiny_model_dirs, tmp_path), "--workers", "2") as server:
        first, second = server.clients_on_two_workers()
        try:
            stream = _open_stream(first, "solo-secret")
            _assert_limited(_ask(second, "solo-secret"), "requests open")
            assert _ask(second, "free-secret").status_code == 200  # other keys are served meanwhile
            stream.close()  # the client leaves: the worker aborts it and frees the key's slot
            wait_until(lambda: _ask(second, "solo-secret").status_code == 200, "solo's slot freed")
        finally:
            first.close(), second.close()
        text = httpx.get(f"{server.url}/metrics").text
        assert "secret" not in text
        limited = labelled_samples(text, "wsgi_infer:key_rate_limited_total")
        assert limited[(("key", "solo"), ("limit", "concurrent_requests"))] >= 1
        requests = labelled_samples(text, "wsgi_infer:key_requests_total")
        assert requests[(("key", "free"),)] == 1 and requests[(("key", "solo"),)] >= 2


def test_generated_tokens_a_minute_refuse_with_retry_after_and_recover(tiny_model_dirs, tmp_path):
    with GunicornServer(_settings(tiny_model_dirs, tmp_path)).wait_ready() as server, server.client() as http:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="meter-secret", max_retries=0)
        model = client.models.list().data[0].id
        # 8 choices of 165 tokens: 1,320 generated in about the time of 165 (a second or two), from a bucket of
        # 1,200 that refills 20 a second: in debt for 6 s from the request's end, when its tokens are taken.
        first = client.completions.with_raw_response.create(
            model=model, prompt="Once", max_tokens=165, n=8, extra_body={"ignore_eos": True}
        )
        assert first.headers["x-ratelimit-limit-output-tokens"] == "1200"
        assert first.headers["x-ratelimit-remaining-output-tokens"] == "1200"  # taken when the request ends
        refused = _ask(http, "meter-secret")
        _assert_limited(refused, "generated tokens per minute")
        assert refused.headers["x-ratelimit-remaining-output-tokens"] == "0"
        assert 1 <= int(refused.headers["retry-after"]) <= 7
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=model, prompt="Once", max_tokens=2)
        assert _ask(http, "free-secret").status_code == 200
        wait_until(lambda: _ask(http, "meter-secret").status_code == 200, "the bucket refilled", timeout=20)


def test_a_keys_cached_prefixes_are_its_own_and_a_cache_salt_parts_them_further(tiny_model_dirs, tmp_path):
    """One key cannot learn from cached_tokens (or its first token's time) what another key sent: prefixes are
    hashed with the key's id, and with vLLM's cache_salt where a request gives one."""

    def cached(key: str, **body) -> int:
        response = _ask(http, key, prompt="Once upon a time there was a dragon. " * 12, max_tokens=1, **body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with GunicornServer(_settings(tiny_model_dirs, tmp_path)).wait_ready() as server, server.client() as http:
        assert cached("free-secret") == 0
        assert cached("free-secret") > 0  # the same key, the same prompt
        assert cached("solo-secret") == 0  # another key
        assert cached("free-secret", cache_salt="one") == 0
        assert cached("free-secret", cache_salt="one") > 0
        refused = _ask(http, "free-secret", cache_salt="")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"


def test_redis_holds_a_limit_across_two_servers(tiny_model_dirs, tmp_path):
    with RedisServer(tmp_path) as redis:
        settings = _settings(tiny_model_dirs, tmp_path, redis_url=redis.url)
        with GunicornServer(settings).wait_ready() as one, GunicornServer(settings).wait_ready() as other:
            with one.client() as first, other.client() as second:
                stream = _open_stream(first, "solo-secret")
                _assert_limited(_ask(second, "solo-secret"), "requests open")
                stream.close()
                wait_until(lambda: _ask(second, "solo-secret").status_code == 200, "solo's slot freed")


def test_with_redis_gone_limited_keys_are_served_uncounted_with_one_warning_and_counted_when_it_returns(
    tiny_model_dirs, tmp_path
):
    """Redis stops: a key of one request at most gets three at once and a fourth, uncounted, and one warning
    says so. Redis back (empty), the key is counted again."""
    with RedisServer(tmp_path) as redis:
        with GunicornServer(_settings(tiny_model_dirs, tmp_path, redis_url=redis.url)) as server:
            _uncounted_while_redis_is_gone(server.wait_ready(), redis)


def test_a_dead_servers_open_request_counts_until_its_heartbeat_expires(tiny_model_dirs, tmp_path):
    """A server holding a key's one request dies (SIGKILL to its master and workers): the other server refuses the
    key while the dead one's heartbeat lives (at most three beats, 30 s), and serves it once the heartbeat is gone
    (deleted here, as its expiry would)."""
    import redis as redis_py

    with RedisServer(tmp_path) as redis:
        settings = _settings(tiny_model_dirs, tmp_path, redis_url=redis.url)
        with GunicornServer(settings).wait_ready() as one, GunicornServer(settings).wait_ready() as other:
            (dead_worker,) = one.worker_pids()
            _open_stream(one.client(), "solo-secret")
            with other.client() as http:
                _assert_limited(_ask(http, "solo-secret"), "requests open")
                os.killpg(one.process.pid, signal.SIGKILL)
                one.process.wait(10)
                _assert_limited(_ask(http, "solo-secret"), "requests open")  # its heartbeat lives on
                client = redis_py.Redis.from_url(redis.url)
                (beat,) = [k for k in client.keys(f"{PREFIX}owner:*") if f":{dead_worker}:".encode() in k]
                assert 0 < client.ttl(beat) <= 3 * HEARTBEAT_SECONDS
                client.delete(beat)
                assert _ask(http, "solo-secret").status_code == 200


def _uncounted_while_redis_is_gone(server: GunicornServer, redis: RedisServer) -> None:
    with server.client() as http:
        stream = _open_stream(http, "solo-secret")
        _assert_limited(_ask(http, "solo-secret"), "requests open")  # counted in Redis: one open at most
        stream.close()
        redis.stop()
        streams = [_open_stream(http, "solo-secret") for _ in range(3)]  # three at once, none counted
        assert _ask(http, "solo-secret").status_code == 200
        warned = [line for line in server.lines if "limits not enforced until Redis answers again" in line]
        assert len(warned) == 1, warned
        for open_stream in streams:
            open_stream.close()
        with redis.again():
            enforced = lambda: any("Redis answers again: limits enforced" in line for line in server.lines)  # noqa: E731
            wait_until(lambda: _ask(http, "solo-secret").status_code == 200 and enforced(), "Redis back", timeout=30)
            stream = _open_stream(http, "solo-secret")
            _assert_limited(_ask(http, "solo-secret"), "requests open")
            stream.close()


def _send_stream(server: GunicornServer, key: str) -> socket.socket:
    """An endless streamed request, sent on its own connection and left unread."""
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 30_000, "ignore_eos": True, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(head.encode() + body)
    return sock


@pytest.mark.parametrize("fair_share", [True, False], ids=["fair share", "first come, first served"])
def test_a_full_queue_refuses_the_key_that_filled_it_and_serves_another(tiny_model_dirs, fair_share):
    """A flood fills every seat and the queue: its next request gets a 429, another key's is admitted. With fair
    share, a seat is taken from the flood for it: its answer comes within seconds, a preemption counted, the
    flood's streams still open. First come, first served (``fair_share`` false), it waits behind the flood."""
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "api_key": "flood-key,chat-key"}
    settings.update(max_num_seqs=2, max_waiting_requests=2, fair_share=fair_share)  # 4 requests in flight at most
    settings["stream_backlog_bytes"] = 64 << 20  # the flood's unread streams are never aborted to free a seat here
    settings["drain_seconds"] = 1
    with GunicornServer(settings).wait_ready() as server, server.client(timeout=5) as http:
        flood = [_send_stream(server, "flood-key") for _ in range(4)]
        try:
            server.wait_for_metric("wsgi_infer:num_requests_waiting", 2)
            refused = _ask(http, "flood-key")
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_requests"
            preempted = server.metrics().get("wsgi_infer:num_preemptions_total", 0)
            if not fair_share:
                with pytest.raises(httpx.ReadTimeout):  # behind 60,000 tokens of flood
                    _ask(http, "chat-key", timeout=2)
                return
            served = _ask(http, "chat-key")  # under its share of the queue; a seat is taken from the flood for it
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
            metrics = server.metrics()
            assert metrics["wsgi_infer:num_preemptions_total"] > preempted
            in_flight = metrics["wsgi_infer:num_requests_running"] + metrics["wsgi_infer:num_requests_waiting"]
            assert in_flight == 4  # the flood's streams, none ended to make room
        finally:
            for sock in flood:
                sock.close()


def test_a_sighup_reads_the_changed_keys_file(tiny_model_dirs, tmp_path):
    with GunicornServer(_settings(tiny_model_dirs, tmp_path)).wait_ready() as server:
        old_worker = server.worker_pids()[0]

        def fresh(key: str) -> int:  # a new connection: the new worker answers once the old one has gone
            with server.client() as http:
                return _ask(http, key).status_code

        assert fresh("free-secret") == 200 and fresh("new-secret") == 401
        (tmp_path / "keys.toml").write_text('[keys.new]\nkey = "new-secret"\n')
        after = len(server.lines)
        server.process.send_signal(signal.SIGHUP)
        server.wait_booted(after=after)
        server.wait_for_log(rf"\[{old_worker}\] \[INFO\] Worker exiting")
        assert fresh("new-secret") == 200 and fresh("free-secret") == 401
        # An edit that breaks the file: one line says why, the new worker keeps the keys read before (every new
        # worker failed to boot on it, and gunicorn stopped the server: exit 3).
        (tmp_path / "keys.toml").write_text('[keys.new\nkey = "new-secret"\n')
        worker, after = server.worker_pids()[0], len(server.lines)
        server.process.send_signal(signal.SIGHUP)
        kept = r"\[ERROR\] keys file .*keys\.toml.*; the new workers keep what was read before"
        server.wait_for_log(kept, after=after)
        server.wait_booted(after=after)
        server.wait_for_log(rf"\[{worker}\] \[INFO\] Worker exiting", after=after)
        assert server.process.poll() is None and fresh("new-secret") == 200 and fresh("free-secret") == 401
