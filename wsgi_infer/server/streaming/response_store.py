"""Stored responses of the Responses API (``store: true``): in the worker's memory, or in Redis so that any worker
continues a conversation (``previous_response_id``). Each record belongs to the API key that created it; another
key finds nothing, as if the id did not exist."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Protocol

from .redis_store import StoreUnavailable

MAX_IN_MEMORY = 10_000  # per worker; the oldest go first


class ResponseStore(Protocol):
    def put(self, response_id: str, owner: str, record: dict) -> None: ...

    def get(self, response_id: str, owner: str) -> dict | None: ...

    def delete(self, response_id: str, owner: str) -> bool: ...


class MemoryResponses:
    def __init__(self, keep_seconds: float) -> None:
        self._keep = keep_seconds
        self._records: OrderedDict[str, tuple[float, str, dict]] = OrderedDict()

    def put(self, response_id: str, owner: str, record: dict) -> None:
        self._expire()
        self._records[response_id] = (time.monotonic() + self._keep, owner, record)
        while len(self._records) > MAX_IN_MEMORY:
            self._records.popitem(last=False)

    def get(self, response_id: str, owner: str) -> dict | None:
        self._expire()
        entry = self._records.get(response_id)
        return entry[2] if entry is not None and entry[1] == owner else None

    def delete(self, response_id: str, owner: str) -> bool:
        if self.get(response_id, owner) is None:
            return False
        del self._records[response_id]
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        while self._records and next(iter(self._records.values()))[0] < now:
            self._records.popitem(last=False)


class RedisResponses:
    """One key per response, expiring with it; the owner is stored beside the record."""

    def __init__(self, url: str, keep_seconds: float) -> None:
        import redis  # optional: pip install "wsgi-infer[redis]"

        self._client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self._errors = (redis.RedisError, OSError)
        self._keep = max(1, int(keep_seconds))

    @staticmethod
    def key(response_id: str) -> str:
        return f"wsgi-infer:response:{response_id}"

    def put(self, response_id: str, owner: str, record: dict) -> None:
        value = json.dumps({"owner": owner, "record": record}, ensure_ascii=False)
        self._call(self._client.set, self.key(response_id), value, ex=self._keep)

    def get(self, response_id: str, owner: str) -> dict | None:
        raw = self._call(self._client.get, self.key(response_id))
        entry = json.loads(raw) if raw is not None else None
        return entry["record"] if entry is not None and entry["owner"] == owner else None

    def delete(self, response_id: str, owner: str) -> bool:
        if self.get(response_id, owner) is None:
            return False
        return bool(self._call(self._client.delete, self.key(response_id)))

    def _call(self, method, *args, **kwargs):
        try:
            return method(*args, **kwargs)
        except self._errors as exc:
            raise StoreUnavailable(f"the response store (Redis) is unavailable: {exc}") from None


def response_store(redis_url: str | None, keep_seconds: float) -> ResponseStore:
    return RedisResponses(redis_url, keep_seconds) if redis_url else MemoryResponses(keep_seconds)
