"""Admission with the KV store, in plain Python: blocks read from the store count as a prefix hit where memory
has none (memory first), fill fresh blocks of every pool that reads them, and a read still going never holds up
the running sequences."""

from __future__ import annotations

from collections.abc import Mapping

from wsgi_infer.engine.sampling_params import SamplingParams
from wsgi_infer.engine.scheduling.kv_cache_manager import KVCacheManager, KVGroup, PrefixHit
from wsgi_infer.engine.scheduling.scheduler import Scheduler
from wsgi_infer.engine.scheduling.sequence import Sequence

from ..support.scheduling import step

BS = 4


def _seq(name: str, n: int, first: int = 0) -> Sequence:
    return Sequence(name, list(range(first, first + n)), SamplingParams(), max_tokens=4)


def _computed(kv: KVCacheManager, seq: Sequence) -> None:
    assert kv.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)


def test_stored_blocks_extend_the_memory_hit_and_are_filled_in_every_pool():
    kv = KVCacheManager([KVGroup((0,), 0, 64), KVGroup((1,), 8, 64)], BS)  # a global pool and a sliding one
    first = _seq("a", 12)
    _computed(kv, first)
    kv.free(first)  # blocks 0-2 cached in memory
    seq = _seq("b", 33)  # the same 12 tokens, then 21 more
    kv.update_block_hashes(seq)
    stored = {h: f"payload {i}" for i, h in enumerate(seq.block_hashes) if i >= 1}  # the store has blocks 1..
    hit = kv.find_cached_prefix(seq, stored)
    assert hit.num_blocks == 8  # every full block but the one holding the last token
    global_hits, sliding = hit.tables
    assert global_hits[0] == 0 and global_hits[1][:3] == [kv.pools[0].cached_block(h) for h in seq.block_hashes[:3]]
    assert global_hits[1][3:] == [None] * 5  # memory first, then the store
    assert sliding[0] == 6 and sliding[1] == [None, None]  # the last window's blocks only (8 tokens: 2 blocks)
    assert hit.num_stored == 5
    assert kv.allocate(seq, 1, hit)
    filled = {(pool, index) for pool, _, index in hit.fills}
    assert filled == {(0, i) for i in range(3, 8)} | {(1, 6), (1, 7)}
    assert all(seq.block_tables[pool].blocks[index] == block for pool, block, index in hit.fills)
    assert kv.num_stored_hit_blocks == 5 and kv.num_prefix_hit_blocks == 3
    assert seq.num_computed_tokens == seq.num_cached_tokens == 32


def test_a_gap_in_the_stored_blocks_ends_the_hit():
    kv = KVCacheManager([KVGroup((0,), 0, 64)], BS)
    seq = _seq("a", 30)
    kv.update_block_hashes(seq)
    stored = {h: i for i, h in enumerate(seq.block_hashes) if i != 2}
    assert kv.find_cached_prefix(seq, stored).num_blocks == 2
    assert kv.find_cached_prefix(seq, {}) is None


class _Reads:
    """A store whose reads end when the test says."""

    def __init__(self) -> None:
        self.over: set[str] = set()
        self.loaded: list[tuple[str, PrefixHit | None]] = []

    def read_done(self, seq: Sequence) -> bool:
        return seq.request_id in self.over

    def blocks_read(self, seq: Sequence) -> Mapping[bytes, object]:
        self.over.add(seq.request_id)  # waits for it
        return {}

    def load(self, seq: Sequence, hit: PrefixHit | None) -> None:
        self.loaded.append((seq.request_id, hit))


def test_a_read_still_going_waits_only_where_nothing_else_runs():
    reads = _Reads()
    kv = KVCacheManager([KVGroup((0,), 0, 64)], BS)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, store=reads)
    scheduler.add(_seq("alone", 10))
    assert step(scheduler) == ["alone"]  # nothing else runs: it waited for its read
    scheduler.add(_seq("later", 10, first=100))
    assert step(scheduler) == ["alone"]  # its read is not over: the running sequence does not wait for it
    assert step(scheduler) == ["alone"]
    reads.over.add("later")
    assert step(scheduler) == ["alone", "later"]
    assert [name for name, _ in reads.loaded] == ["alone", "later"]
    assert scheduler.num_store_query_tokens == 20
