"""What a KV store must do, whatever keeps its blocks: a directory (``directory``) or a Redis (``redis_blocks``).

A block is found by its namespace (``namespace``: the model and every setting that changes its values) and its
key (the prefix hash chain of its tokens). What the store holds is a framed block (``block_file``): whoever reads
it checks the frame, so a backend need not trust its medium.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class StoreCounters:
    """Cumulative, for metrics; each process counts what it did."""

    bytes_read: int = 0
    bytes_written: int = 0
    evicted_blocks: int = 0
    corrupt_blocks: int = 0  # removed: truncated, foreign or failing their checksum
    read_errors: int = 0  # reads that failed for the medium's reasons
    write_errors: int = 0  # writes that failed so: a full disk, a read-only or vanished directory
    dropped_blocks: int = 0  # not written: the writer was too far behind


class KVStore(Protocol):
    counters: StoreCounters
    location: str  # for the logs

    def contains(self, namespace: bytes, key: bytes) -> bool:
        """Whether a block may be there (cheap: no read)."""

    def get(self, namespace: bytes, key: bytes) -> bytes | None:
        """The framed block, or None where it is absent; marks it recently used."""

    def put(self, namespace: bytes, key: bytes, framed: list[memoryview], used_ns: int = 0) -> bool:
        """Store a framed block (its parts in order), whole or not at all; False where it was there already.
        ``used_ns``: when it counts as last used (ns since the epoch; 0: now), where the store orders by use.
        Raises ``OSError`` where the medium refuses (full, read-only, gone)."""

    def discard(self, namespace: bytes, key: bytes) -> None:
        """Remove a block that did not pass its frame's checks."""

    def mark_used(self, namespace: bytes, keys: list[bytes]) -> None:
        """Mark the blocks there recently used, in the order given: the last most recently. Raises ``OSError``
        where the medium is away."""
