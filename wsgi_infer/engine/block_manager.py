"""KV-cache blocks: allocation, reference counts and prefix caching.

A block holds ``block_size`` consecutive tokens of one or more sequences (shared
prefixes). A full block is identified by a hash chained over all tokens before
it, so equal hashes mean equal prefixes. Blocks whose reference count drops to
zero go to the back of the free queue but keep their hash, so a later request
with the same prefix can take them back; allocation takes from the front, which
evicts the least recently freed cached block first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .sequence import Sequence


def chain_hash(previous: bytes, token_ids: list[int]) -> bytes:
    """Hash of a full block's tokens, chained with the previous block's hash."""
    return hashlib.blake2b(previous + array("q", token_ids).tobytes(), digest_size=16).digest()


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
        self.num_prefix_hit_blocks = 0  # cumulative, for metrics and tests

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
    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            previous = seq.block_hashes[i - 1] if i else b""
            seq.block_hashes.append(chain_hash(previous, seq.token_ids[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of ``seq``; at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish the full, computed blocks of ``seq`` for reuse by later requests."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_released_blocks, num_full):
            block = seq.block_table[i]
            if self._block_hash[block] is not None:
                continue
            block_hash = seq.block_hashes[i]
            if block_hash in self._cached:  # computed twice concurrently: keep the first
                continue
            self._block_hash[block] = block_hash
            self._cached[block_hash] = block

    # --- allocation --------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int] = ()) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens (after a cached prefix).

        Returns False, changing nothing, when the free blocks do not suffice.
        """
        if cached_prefix:
            assert not seq.block_table and seq.num_computed_tokens == 0
        reused_free = sum(1 for b in cached_prefix if self._ref_counts[b] == 0)
        num_computed = seq.num_computed_tokens + len(cached_prefix) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) - len(cached_prefix)
        if needed > len(self._free) - reused_free:
            return False
        for block in cached_prefix:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        seq.block_table.extend(cached_prefix)
        self.num_prefix_hit_blocks += len(cached_prefix)
        if cached_prefix and not seq.num_output_tokens:
            seq.num_cached_tokens = len(cached_prefix) * self.block_size
        seq.num_computed_tokens = num_computed
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; tail blocks become the first to evict."""
        for block in reversed(seq.block_table[seq.num_released_blocks :]):
            self._release(block)
        seq.block_table, seq.num_released_blocks = [], 0
        seq.num_computed_tokens = 0

    def release_behind(self, seq: Sequence, window: int) -> None:
        """Where every layer attends to its last ``window`` tokens only: give back the blocks no later token of
        ``seq`` reads (before the next one's window). They stay cached, for a later request's prefix."""
        first_read = seq.num_computed_tokens - window + 1  # the next token's window starts here
        while (seq.num_released_blocks + 1) * self.block_size <= first_read:
            self._release(seq.block_table[seq.num_released_blocks])
            seq.num_released_blocks += 1

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
