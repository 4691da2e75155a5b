"""The limits' state in Redis (``redis_url``): every worker of every server on it counts against one record per
key, updated under redis-py's lock. Each worker keeps a heartbeat key alive while it runs; the open requests of a
worker whose heartbeat expired (it died, or its host did) are dropped when the key's state is next read."""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Callable
from typing import TypeVar

import gevent

T = TypeVar("T")
PREFIX = "wsgi-infer:limits:"
HEARTBEAT_SECONDS = 10


class RedisUnavailable(RuntimeError):
    pass


class RedisLimitStore:
    def __init__(self, url: str) -> None:
        import redis  # optional: pip install "wsgi-infer[redis]"

        self._client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self._errors = (redis.RedisError, OSError)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        gevent.spawn(self._beat)  # for the worker's life

    def update(self, key_id: str, change: Callable[[dict], T]) -> T:
        try:
            with self._client.lock(f"{PREFIX}lock:{key_id}", timeout=5, blocking_timeout=5):
                raw = self._client.get(f"{PREFIX}key:{key_id}")
                state = json.loads(raw) if raw else {}
                result = change(state)
                self._client.set(f"{PREFIX}key:{key_id}", json.dumps(state), ex=86400)
        except self._errors as exc:
            raise RedisUnavailable(f"Redis: {exc}") from None
        return result

    def alive(self, owners: set[str]) -> set[str]:
        ordered = sorted(owners)
        beats = self._client.mget([f"{PREFIX}owner:{owner}" for owner in ordered]) if ordered else []
        return {owner for owner, beat in zip(ordered, beats) if beat is not None}

    def _beat(self) -> None:
        while True:
            try:
                self._client.set(f"{PREFIX}owner:{self.owner}", b"1", ex=3 * HEARTBEAT_SECONDS)
            except self._errors:
                pass  # an outage: requests are refused nothing meanwhile (``Tenants.admit``), and beats resume
            gevent.sleep(HEARTBEAT_SECONDS)
