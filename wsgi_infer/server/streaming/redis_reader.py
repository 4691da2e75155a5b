"""A stream as Redis holds it, read like a ``StreamLog`` from any worker or host (``redis_store.RedisStore.open``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from .log_shapes import Continuer


class StreamCopies(Protocol):
    """What a reader asks of the Redis store (``redis_store.RedisStore``)."""

    def read(
        self, stream_id: str, after: int, heartbeat: float, api: str, continue_here: Continuer | None
    ) -> Iterator[str]: ...

    def cancel(self, stream_id: str) -> bool: ...

    def ended(self, stream_id: str) -> bool: ...


class RedisStreamReader:
    """A stream as Redis holds it, read like a ``StreamLog``."""

    def __init__(self, store: StreamCopies, stream_id: str, api: str) -> None:
        self._store, self.stream_id, self.api = store, stream_id, api
        self.continue_here: Continuer | None = None  # where its generating host died: continue it here

    def read(self, after: int, heartbeat: float) -> Iterator[str]:
        return self._store.read(self.stream_id, after, heartbeat, self.api, self.continue_here)

    def cancel(self) -> bool:
        return self._store.cancel(self.stream_id)

    @property
    def finished(self) -> bool:
        return self._store.ended(self.stream_id)
