"""One pool of KV-cache blocks: allocation, reference counts and prefix caching.

A block holds ``block_size`` consecutive tokens of one or more sequences (shared
prefixes). A full block is identified by a hash chained over all tokens before
it, so equal hashes mean equal prefixes. Blocks whose reference count drops to
zero go to the back of the free queue but keep their hash, so a later request
with the same prefix can take them back; allocation takes from the front, which
evicts the least recently freed cached block first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

PLACEHOLDER = 0  # a table entry behind a sliding window that was never taken (after a prefix hit): never read


@dataclass
class BlockTable:
    """A sequence's blocks in one pool, by position. Its first ``num_released`` entries lie behind a sliding
    window: given back (or, after a prefix hit, never taken), stale, never read."""

    blocks: list[int] = field(default_factory=list)
    num_released: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # Insertion order is the LRU order: front = evicted first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # --- counters --------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (includes cached blocks that may be evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache ------------------------------------------------------------
    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding the full block of this hash, if it is still cached."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def cache_full_blocks(self, table: BlockTable, block_hashes: list[bytes], num_full: int) -> None:
        """Publish the table's first ``num_full`` blocks (computed, and hashed in ``block_hashes``) for reuse."""
        if not self.enable_prefix_caching:
            return
        for i in range(table.num_released, num_full):
            block = table.blocks[i]
            if self._block_hash[block] is not None:
                continue
            block_hash = block_hashes[i]
            if block_hash in self._cached:  # computed twice concurrently: keep the first
                continue
            self._block_hash[block] = block_hash
            self._cached[block_hash] = block

    # --- allocation --------------------------------------------------------------
    def missing(self, table: BlockTable, num_tokens: int, hits: Sequence[int | None] = (), skipped: int = 0) -> int:
        """How many blocks short the pool is of giving ``table`` its first ``num_tokens`` tokens (after a prefix
        hit: ``skipped`` placeholders, then the cached ``hits``, None for a block to fill from the KV store); 0 or
        less when they fit."""
        reused_free = sum(1 for b in hits if b is not None and self._ref_counts[b] == 0)
        to_fill = sum(1 for b in hits if b is None)
        needed = self.blocks_needed(num_tokens) - len(table.blocks) - skipped - len(hits) + to_fill
        return needed - (len(self._free) - reused_free)

    def allocate(self, table: BlockTable, num_tokens: int, hits: Sequence[int | None] = (), skipped: int = 0) -> None:
        """Give ``table`` its first ``num_tokens`` tokens' blocks, which must fit (``missing``)."""
        assert self.missing(table, num_tokens, hits, skipped) <= 0
        for block in hits:
            if block is not None:
                if self._ref_counts[block] == 0:
                    del self._free[block]
                self._ref_counts[block] += 1
        table.blocks += [PLACEHOLDER] * skipped
        table.blocks += [self._take_free_block() if block is None else block for block in hits]
        table.num_released += skipped
        for _ in range(self.blocks_needed(num_tokens) - len(table.blocks)):
            table.blocks.append(self._take_free_block())

    def free(self, table: BlockTable) -> None:
        """Release every block of ``table``; tail blocks become the first to evict."""
        for block in reversed(table.blocks[table.num_released :]):
            self._release(block)
        table.blocks, table.num_released = [], 0

    def release_before(self, table: BlockTable, first_read: int) -> None:
        """Give back the blocks wholly before position ``first_read``, which no later token reads. They stay
        cached, for a later request's prefix."""
        while (table.num_released + 1) * self.block_size <= first_read:
            self._release(table.blocks[table.num_released])
            table.num_released += 1

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        evicted = self._block_hash[block]
        if evicted is not None:
            del self._cached[evicted]
            self._block_hash[block] = None
        self._ref_counts[block] = 1
        return block
