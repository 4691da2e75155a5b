"""Limits per API key without a server: the keys file, the priority cap, and the ledger's arithmetic (buckets that
refill over a minute, concurrent and queued requests, headers) on a clock the test moves; two workers on one
database, and a dead worker's requests dropped."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys

import pytest

from wsgi_infer import SamplingParams
from wsgi_infer.server.settings import ServerSettings
from wsgi_infer.server.tenants.keys import KeysConfigError, load_keys
from wsgi_infer.server.tenants.limits import Ledger, duration
from wsgi_infer.server.tenants.local_store import LocalLimitStore
from wsgi_infer.server.tenants.registry import Tenants

from ..support.scheduling import Clock


def _policy(tmp_path, **limits):
    lines = ["[keys.team]", 'key = "team-key"'] + [f"{name} = {value}" for name, value in limits.items()]
    (tmp_path / "keys.toml").write_text("\n".join(lines))
    (policy,) = load_keys([], str(tmp_path / "keys.toml"))
    return policy


def test_the_keys_file_gives_ids_weights_and_caps_and_names_what_is_wrong(tmp_path):
    digest = hashlib.sha256(b"hashed-key").hexdigest()
    path = tmp_path / "keys.toml"
    path.write_text(f'[keys.batch]\nkey_sha256 = "{digest}"\nweight = 0.5\nmin_priority = 10\n')
    plain, batch = load_keys(["env-key"], str(path))
    # its place, never a hash of it: /metrics is public by default, and the hash of a weak key is undone offline
    assert plain.id == "api-key-1" and plain.weight == 1 and not plain.limited
    assert batch.id == "batch" and batch.weight == 0.5 and batch.digest == bytes.fromhex(digest)
    tenants = Tenants(ServerSettings(api_key="env-key", keys_file=str(path)))
    assert tenants.ledger is None  # no key has a limit: nothing to count
    assert tenants.identify(["nope", "hashed-key"]).id == "batch" and tenants.identify(["nope"]) is None
    assert tenants.identify(["env-key"]).id == plain.id
    params = [SamplingParams(priority=-5), SamplingParams(priority=20)]
    Tenants.share(batch, params)
    assert [(p.tenant, p.tenant_weight, p.priority) for p in params] == [("batch", 0.5, 10), ("batch", 0.5, 20)]
    for text, says in [
        ('[keys.a]\nkey = "k"\nweight = 0\n', "weight"),
        ('[keys.a]\nkey = "k"\nmax_queued = 3\n', "max_queued"),
        ('[keys.a]\nkey = "k"\nkey_sha256 = "' + digest + '"\n', "one of them"),
        ('[keys.a]\nkey = "k"\n[keys.b]\nkey = "k"\n', "twice"),
        ("[models.a]\n", "only \\[keys.NAME\\] tables"),
        ("", "no \\[keys.NAME\\] table"),
    ]:
        path.write_text(text)
        with pytest.raises(KeysConfigError, match=says) as raised:
            load_keys([], str(path))
        assert "\n" not in str(raised.value)  # one line: pydantic's took four


def test_concurrent_and_queued_requests_free_up_as_requests_start_and_end(tmp_path):
    policy = _policy(tmp_path, max_concurrent_requests=2, max_queued_requests=1)
    ledger = Ledger(LocalLimitStore(str(tmp_path)))
    first = ledger.admit(policy, 10).ticket
    refused = ledger.admit(policy, 10)
    assert refused.ticket is None and refused.limit == "queued_requests" and refused.retry_after == 1
    ledger.started(policy, first)
    second = ledger.admit(policy, 10).ticket
    ledger.started(policy, second)
    refused = ledger.admit(policy, 10)
    assert refused.limit == "concurrent_requests" and "2 requests open" in refused.message
    ledger.finish(policy, first, 5)
    assert ledger.admit(policy, 10).ticket


def test_buckets_refill_over_a_minute_and_say_when_in_the_headers(tmp_path):
    clock = Clock(1000.0)
    policy = _policy(tmp_path, prompt_tokens_per_minute=600, generated_tokens_per_minute=120, requests_per_minute=60)
    ledger = Ledger(LocalLimitStore(str(tmp_path)), clock)
    admitted = ledger.admit(policy, 500)
    assert admitted.headers["x-ratelimit-remaining-tokens"] == "100"
    assert admitted.headers["x-ratelimit-reset-tokens"] == "50s"  # 500 tokens at 10 a second
    assert admitted.headers["x-ratelimit-limit-requests"] == "60"
    assert admitted.headers["x-ratelimit-remaining-requests"] == "59"
    refused = ledger.admit(policy, 300)
    assert refused.limit == "prompt_tokens_per_minute" and refused.retry_after == pytest.approx(20)
    assert refused.headers["x-ratelimit-remaining-tokens"] == "100"
    clock.now += 20
    ledger.finish(policy, ledger.admit(policy, 200).ticket, 180)  # 60 more generated than a minute's
    refused = ledger.admit(policy, 1)
    assert refused.limit == "generated_tokens_per_minute" and refused.retry_after == pytest.approx(30.5)
    assert refused.headers["x-ratelimit-remaining-output-tokens"] == "0"
    clock.now += 30.5
    assert ledger.admit(policy, 1).ticket
    too_large = ledger.admit(policy, 601)
    assert too_large.limit == "prompt_tokens_per_minute" and too_large.retry_after is None


def test_two_workers_count_against_one_limit_and_a_dead_ones_requests_are_dropped(tmp_path):
    policy = _policy(tmp_path, max_concurrent_requests=2)
    one, other, ghost = (Ledger(LocalLimitStore(str(tmp_path))) for _ in range(3))
    first = one.admit(policy, 1).ticket
    assert first and other.admit(policy, 1).ticket
    assert one.admit(policy, 1).limit == "concurrent_requests"  # one request each, two in all
    one.finish(policy, first, 0)
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ghost.store.owner = exited.stdout.strip()  # a worker that has died since
    assert ghost.admit(policy, 1).ticket
    assert one.admit(policy, 1).ticket  # the dead worker's request no longer counts
    assert one.admit(policy, 1).limit == "concurrent_requests"


def test_a_worker_opens_the_masters_store_while_another_process_holds_its_lock(tmp_path):
    # Switching a new database to WAL needs a lock SQLite does not wait for: of two workers that booted together,
    # one failed ("database is locked"). The master prepares it before forking them; then no opening needs that.
    LocalLimitStore.prepare(str(tmp_path))
    holder = sqlite3.connect(tmp_path / "limits.sqlite3", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # a worker mid-update, or still making the tables
    try:
        ledger = Ledger(LocalLimitStore(str(tmp_path)))  # a worker booting meanwhile
    finally:
        holder.execute("ROLLBACK")
    assert ledger.admit(_policy(tmp_path, max_concurrent_requests=1), 1).ticket


def test_reset_durations_are_written_as_openai_writes_them():
    assert [duration(s) for s in (0.0171, 1, 59.2, 360)] == ["18ms", "1s", "1m0s", "6m0s"]
