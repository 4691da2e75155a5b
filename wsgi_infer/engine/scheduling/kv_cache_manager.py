"""The KV cache's blocks for each group of layers, as the scheduler and the engine see them.

Most models have one group: every layer keeps every token's keys and values (or,
where every layer slides, each sequence's last window of them). A model that
mixes sliding-window layers with global ones (Gemma 3, five to one; Qwen3 with
``max_window_layers``) keeps two pools, as vLLM's hybrid allocator does: the
global layers' blocks hold a sequence's whole context, the sliding layers' its
last window only, those behind it going back as it moves on. A sequence has a
block table in each pool, over the same positions. A prefix is found cached
where every pool still holds the blocks its next token reads: all of them in the
global pool, the last window's in the sliding one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..config import SettingError
from .block_manager import BlockManager, BlockTable
from .sequence import Sequence


def chain_hash(previous: bytes, token_ids: list[int]) -> bytes:
    """Hash of a full block's tokens, chained with the previous block's hash."""
    return hashlib.blake2b(previous + array("q", token_ids).tobytes(), digest_size=16).digest()


def chain_start(tenant: str, cache_salt: str) -> bytes:
    """What a sequence's first block is chained to: nothing for a request of no tenant and no salt, else the pair's
    own hash, so that their prefixes are found by their requests alone (in memory and in the KV store)."""
    if not tenant and not cache_salt:
        return b""
    return hashlib.blake2b(f"{tenant}\0{cache_salt}".encode(), digest_size=16).digest()


@dataclass(frozen=True)
class KVGroup:
    """Layers whose keys and values share block tables: their sliding window (tokens, or 0: the whole context)
    and their pool's size."""

    layers: tuple[int, ...]
    window: int
    num_blocks: int


@dataclass
class PrefixHit:
    """A sequence's first ``num_blocks`` blocks found cached: per pool, the leading blocks its window has left
    behind (not taken) and the cached blocks after them, None where the block comes from the KV store (its
    payload in ``stored``, by hash). Allocation notes in ``fills`` each block to fill so: (pool, block id, index
    in the sequence)."""

    num_blocks: int
    tables: list[tuple[int, list[int | None]]]
    stored: Mapping[bytes, object] = field(default_factory=dict)
    fills: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_stored(self) -> int:
        """Blocks that some pool takes from the store."""
        return len(
            {self.num_blocks - len(hits) + i for _, hits in self.tables for i, b in enumerate(hits) if b is None}
        )


class KVCacheManager:
    def __init__(self, groups: list[KVGroup], block_size: int, enable_prefix_caching: bool = True) -> None:
        self.groups = groups
        self.pools = [BlockManager(g.num_blocks, block_size, enable_prefix_caching) for g in groups]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_prefix_hit_blocks = 0  # cumulative, for metrics and tests: from memory
        self.num_stored_hit_blocks = 0  # and from the KV store

    # --- counters (over every pool) ----------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(pool.num_free_blocks for pool in self.pools)

    @property
    def num_cached_blocks(self) -> int:
        return sum(pool.num_cached_blocks for pool in self.pools)

    # --- prefix cache --------------------------------------------------------------------
    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            previous = seq.block_hashes[i - 1] if i else chain_start(seq.params.tenant, seq.params.cache_salt)
            seq.block_hashes.append(chain_hash(previous, seq.token_ids[i * bs : (i + 1) * bs]))

    def find_cached_prefix(
        self, seq: Sequence, stored: Mapping[bytes, object] = MappingProxyType({})
    ) -> PrefixHit | None:
        """The longest run of ``seq``'s leading blocks that every pool can serve from memory, or from the blocks
        read from the KV store (``stored``, by hash); at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return None
        self.update_block_hashes(seq)
        hashes = seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]
        global_pools = [pool for group, pool in zip(self.groups, self.pools) if not group.window]
        num = 0
        while num < len(hashes) and (
            hashes[num] in stored or all(p.cached_block(hashes[num]) is not None for p in global_pools)
        ):
            num += 1  # an upper bound: the global layers read every block before the next token
        while num and (missing := self._last_missing_in_windows(hashes, num, stored)) is not None:
            num = missing  # a longer prefix's next token reads that block too
        if not num:
            return None
        tables = []
        for group, pool in zip(self.groups, self.pools):
            skipped = self._first_read_block(num, group.window)
            tables.append((skipped, [pool.cached_block(h) for h in hashes[skipped:num]]))
        return PrefixHit(num, tables, stored)

    def _first_read_block(self, num_blocks: int, window: int) -> int:
        """The first block that the token after ``num_blocks`` blocks reads, in a group with this window."""
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size if window else 0

    def _last_missing_in_windows(self, hashes: list[bytes], num: int, stored: Mapping[bytes, object]) -> int | None:
        """The last of the blocks that the token after ``num`` blocks reads which a sliding pool no longer holds
        (and the store did not give)."""
        missing = None
        for group, pool in zip(self.groups, self.pools):
            if group.window:
                for i in range(num - 1, self._first_read_block(num, group.window) - 1, -1):
                    if pool.cached_block(hashes[i]) is None and hashes[i] not in stored:
                        missing = i if missing is None else max(missing, i)
                        break
        return missing

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish the full, computed blocks of ``seq`` for reuse by later requests."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for pool, table in zip(self.pools, seq.block_tables):
            pool.cache_full_blocks(table, seq.block_hashes, num_full)

    # --- allocation ----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give ``seq`` blocks in every pool for ``num_new_tokens`` more tokens (after a prefix hit).

        Returns False, changing nothing, when a pool's free blocks do not suffice.
        """
        if not seq.block_tables:
            seq.block_tables = [BlockTable() for _ in self.pools]
        if hit is not None:
            assert not seq.block_tables[0].blocks and seq.num_computed_tokens == 0
        num_computed = seq.num_computed_tokens + (hit.num_blocks * self.block_size if hit else 0)
        plans = hit.tables if hit else [(0, [])] * len(self.pools)
        num_tokens = num_computed + num_new_tokens
        if any(
            pool.missing(table, num_tokens, hits, skipped) > 0
            for pool, table, (skipped, hits) in zip(self.pools, seq.block_tables, plans)
        ):
            return False
        for index, (pool, table, (skipped, hits)) in enumerate(zip(self.pools, seq.block_tables, plans)):
            pool.allocate(table, num_tokens, hits, skipped)
            if hit is not None:
                hit.fills += [
                    (index, table.blocks[i], i) for i in range(skipped, hit.num_blocks) if hits[i - skipped] is None
                ]
        if hit is not None:
            self.num_stored_hit_blocks += hit.num_stored
            self.num_prefix_hit_blocks += hit.num_blocks - hit.num_stored
            if seq.first_scheduled_time is None:  # as vLLM counts them: a readmission finds its own blocks
                seq.num_cached_tokens = hit.num_blocks * self.block_size
        seq.num_computed_tokens = num_computed
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``, in every pool."""
        for pool, table in zip(self.pools, seq.block_tables):
            pool.free(table)
        seq.num_computed_tokens = 0

    def release_behind(self, seq: Sequence) -> None:
        """In each pool of sliding layers: give back the blocks before the next token's window."""
        for group, pool, table in zip(self.groups, self.pools, seq.block_tables):
            if group.window:
                pool.release_before(table, seq.num_computed_tokens - group.window + 1)


def plan_kv_groups(
    layer_windows: list[int],
    layer_block_bytes: int,
    budget: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_blocks: int | None = None,
) -> list[KVGroup]:
    """The layers' groups and their pools, from each layer's window (0: global) and the bytes of one layer's block.

    Layers alike share one pool of ``num_blocks`` or of what the budget holds. Global and sliding layers get a pool
    each. The sliding pool holds what every running sequence may read at once (its window, a partial block and a
    block of new tokens, and a step's tokens) but never more blocks than one pool for all layers would have, so it
    never runs short before the global pool does; the global pool gets the rest of the budget, so it holds at
    least as many blocks as one pool would.
    """
    kinds = sorted(set(layer_windows))
    members = {w: tuple(i for i, x in enumerate(layer_windows) if x == w) for w in kinds}
    one_pool = num_blocks or budget // (layer_block_bytes * len(layer_windows))
    if not one_pool:  # one block was allocated past the budget (2 GiB for a block of 100,000 tokens)
        block_mib = layer_block_bytes * len(layer_windows) / 2**20
        raise SettingError(
            f"the KV cache's {budget / 2**20:.0f} MiB hold no block of {block_size} tokens ({block_mib:.0f} MiB): "
            "a smaller block_size, or a larger KV cache (WSGI_INFER_BLOCK_SIZE, WSGI_INFER_KV_CACHE_MEMORY_MB)"
        )
    if len(kinds) == 1:
        return [KVGroup(members[kinds[0]], kinds[0], one_pool)]
    if len(kinds) > 2 or kinds[0] != 0:
        raise ValueError(f"layers of several sliding windows ({kinds}): one window and global layers only")
    window = kinds[1]
    if num_blocks:
        return [KVGroup(members[0], 0, num_blocks), KVGroup(members[window], window, num_blocks)]
    reads = max_num_seqs * (-(-window // block_size) + 2) + -(-max_num_batched_tokens // block_size)
    sliding = min(reads, one_pool)
    rest = (budget - sliding * layer_block_bytes * len(members[window])) // (layer_block_bytes * len(members[0]))
    return [KVGroup(members[0], 0, max(one_pool, rest)), KVGroup(members[window], window, sliding)]
