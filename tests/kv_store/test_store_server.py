"""The KV store in real servers: a restart and a second worker take a prompt's blocks from it, as the usage and
the metrics say; a store that vanishes degrades with one warning and a metric, and every request is served."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ..conftest import tiny_settings
from ..support.server import GunicornServer, RedisServer, wait_until

pytestmark = pytest.mark.slow  # real servers

PROMPT = "In the old town by the river, the bakers rose before dawn to light their ovens, and " * 8


def _complete(http: httpx.Client) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _settings(tiny_model_dirs, store: Path) -> dict:
    return tiny_settings(tiny_model_dirs, kv_store_dir=store, speculative="none")


def test_a_restarted_server_reads_the_prompt_from_the_store(tiny_model_dirs, tmp_path):
    with GunicornServer(_settings(tiny_model_dirs, tmp_path)).wait_ready() as server, server.client() as http:
        cold = _complete(http)
        assert _cached(cold) == 0
        assert server.stop() == 0  # a graceful stop writes every block it queued
    full_blocks = (cold["usage"]["prompt_tokens"] - 1) // 4 * 4  # blocks of 4 tokens; the last token computed
    with GunicornServer(_settings(tiny_model_dirs, tmp_path)).wait_ready() as server, server.client() as http:
        warm = _complete(http)
        assert _cached(warm) == full_blocks
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        metrics = server.metrics()
        assert metrics["wsgi_infer:external_prefix_cache_hits_total"] == full_blocks
        assert metrics["wsgi_infer:external_prefix_cache_queries_total"] == warm["usage"]["prompt_tokens"]
        assert metrics["wsgi_infer:prefix_cache_hits_total"] == 0  # none from memory
        assert metrics["wsgi_infer:kv_store_bytes_read_total"] > 0 == metrics["wsgi_infer:kv_store_degraded"]


def test_a_worker_that_never_saw_the_prompt_reads_it_from_the_store(tiny_model_dirs, tmp_path):
    with GunicornServer(_settings(tiny_model_dirs, tmp_path), "--workers", "2") as server:
        first, second = server.clients_on_two_workers()
        try:
            cold = _complete(first)
            written = cold["usage"]["prompt_tokens"] // 4  # the prompt's full blocks
            wait_until(lambda: len(list(tmp_path.rglob("*.kv"))) == written, "the first worker's writes")
            warm = _complete(second)
        finally:
            first.close(), second.close()
        assert _cached(warm) == (cold["usage"]["prompt_tokens"] - 1) // 4 * 4
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert server.metrics()["wsgi_infer:external_prefix_cache_hits_total"] == _cached(warm)


def test_a_vanished_store_degrades_with_one_warning_and_serves_every_request(tiny_model_dirs, tmp_path):
    store = tmp_path / "kv"
    with GunicornServer(_settings(tiny_model_dirs, store)).wait_ready() as server, server.client() as http:
        shutil.rmtree(store)
        first = _complete(http)
        server.wait_for_log(rf"KV store {store}: .*nothing is written there for 30 s")
        other = http.post("/v1/completions", json={"prompt": "Another " + PROMPT, "max_tokens": 8})
        assert other.status_code == 200 and http.get("/health").status_code == 200
        again = _complete(http)  # from memory still
        assert _cached(again) > 0 and again["choices"][0]["text"] == first["choices"][0]["text"]
        server.wait_for_metric("wsgi_infer:kv_store_degraded", 1)
        assert server.metrics()["wsgi_infer:kv_store_write_errors_total"] == 1  # then nothing tried for 30 s
        assert sum("nothing is written there" in line for line in server.lines) == 1
        assert not store.exists()  # never created again: a vanished mount must not fill the disk beneath it


def test_a_host_reads_the_prompt_another_wrote_to_redis_and_serves_on_without_it(tiny_model_dirs, tmp_path):
    """Two servers that share nothing but a Redis for the KV store (as two hosts): the second takes the first's
    blocks; with Redis gone, it serves every request, the store degraded with one warning."""
    import redis as redis_py

    with RedisServer(tmp_path) as redis:
        settings = tiny_settings(tiny_model_dirs, kv_store_url=redis.url, speculative="none")
        with GunicornServer(settings) as one, GunicornServer(settings) as other:
            with one.wait_ready().client() as http:
                cold = _complete(http)
            blocks = redis_py.Redis.from_url(redis.url)
            written = cold["usage"]["prompt_tokens"] // 4  # the prompt's full blocks
            wait_until(lambda: len(blocks.keys("wsgi-infer:kv:*")) == written, "the first host's writes")
            with other.wait_ready().client() as http:
                warm = _complete(http)
                assert _cached(warm) == (cold["usage"]["prompt_tokens"] - 1) // 4 * 4
                assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
                assert other.metrics()["wsgi_infer:external_prefix_cache_hits_total"] == _cached(warm)
                redis.stop()
                for ask in ("Another " + PROMPT, "A third " + PROMPT):
                    assert http.post("/v1/completions", json={"prompt": ask, "max_tokens": 8}).status_code == 200
                other.wait_for_log(rf"KV store redis://127\.0\.0\.1:{redis.port}/0: .*nothing is written there")
                other.wait_for_metric("wsgi_infer:kv_store_degraded", 1)
                assert http.get("/health").status_code == 200
            assert sum("nothing is written there" in line for line in other.lines) == 1


# The KV store's reader and writer, as in a gevent worker: native threads (the bridge's), sockets patched.
_TWO_THREADS = """
import sys
from gevent import monkey
monkey.patch_all()
from _queue import SimpleQueue
from wsgi_infer.engine.kv_store.redis_blocks import RedisStore
start_native_thread = monkey.get_original("_thread", "start_new_thread")
store, done = RedisStore(sys.argv[1]), SimpleQueue()
block = [memoryview(bytes(range(256)) * (32 << 10))]  # 8 MiB: no socket buffer holds it
start_native_thread(lambda: done.put(store.get(b"n", b"absent")), ())  # the reader: its connection, first
assert done.get(timeout=10) is None
start_native_thread(lambda: done.put(store.put(b"n", b"k", block)), ())  # the writer
assert done.get(timeout=20), "the block was there already"
start_native_thread(lambda: done.put(store.get(b"n", b"k")), ())  # the reader again
assert done.get(timeout=20) == block[0]
import redis
checker = redis.Redis.from_url(sys.argv[1])
own = checker.client_id()
others = [c for c in checker.client_list() if int(c["id"]) != own]
assert len(others) == 2, others  # the reader's and the writer's, each kept
"""


def test_the_reader_and_the_writer_each_have_their_own_redis_connection(tmp_path):
    with RedisServer(tmp_path) as redis:
        run = subprocess.run([sys.executable, "-c", _TWO_THREADS, redis.url], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_once_redis_is_back_neither_thread_reuses_a_connection_from_before_it_went(tmp_path):
    """A Redis that restarted while the server was idle: the reader's failure started the wait, and after it the
    writer's first command went out on its own dead connection, failing again for a second wait (the KV store
    probe: 35-70 s without the store after a 1 s blip)."""
    import redis as redis_py

    from wsgi_infer.engine.kv_store.redis_blocks import RedisStore

    with RedisServer(tmp_path) as redis:
        store = RedisStore(redis.url)
        store.put(b"n", b"k", [memoryview(b"block")])  # each role's connection made
        assert store.get(b"n", b"k") == b"block"
        redis_py.Redis.from_url(redis.url).client_kill_filter(_type="normal", skipme=True)  # as a restart does
        with pytest.raises(OSError):
            store.get(b"n", b"k")  # the reader finds its connection dead: the wait begins
        store._retry_at = 0.0  # the wait is over
        assert store.put(b"n", b"k2", [memoryview(b"block")])  # the writer's, made again
        assert store.get(b"n", b"k2") == b"block"
