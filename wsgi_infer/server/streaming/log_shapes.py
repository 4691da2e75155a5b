"""What the Redis store reads of a stream's log, and how a stream is continued for a reader: the shapes
``redis_store`` needs of ``stream_log`` and ``api.continuation`` without importing them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from .stream_record import StreamRecord


class MirroredLog(Protocol):
    """What a mirror reads of a stream's log (``stream_log.StreamLog``)."""

    stream_id: str
    api: str
    events: list[str]
    known: int
    record: StreamRecord | None
    finished: bool
    finished_at: float

    def wait(self, seen: int, timeout: float) -> bool:
        """Until the log holds more than ``seen`` events or has finished."""

    def copied(self, mirrored: int | None) -> None:
        """Redis holds the first ``mirrored`` events (None: Redis is away)."""

    def cancel(self) -> bool:
        """End the stream now (a client cancelled it through another worker); whether it was still generating."""

    def moved_elsewhere(self) -> None:
        """Another host continues the stream: stop it here, its readers told to resume."""


class ReadableLog(Protocol):
    def read(self, after: int, heartbeat: float) -> Iterator[str]: ...


# A stream here whose host died, continued for a reader after the given event: its log, or None (not here).
Continuer = Callable[[int], ReadableLog | None]
