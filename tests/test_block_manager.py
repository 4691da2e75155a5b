"""Block manager: reference counts, prefix hashing, LRU eviction of cached free blocks."""

from __future__ import annotations

from wsgi_infer.engine.block_manager import BlockManager
from wsgi_infer.engine.sampling_params import SamplingParams
from wsgi_infer.engine.scheduler import Scheduler
from wsgi_infer.engine.sequence import Sequence


def make_seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, SamplingParams(), max_tokens=16)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    assert bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)


def test_allocate_and_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(10)))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert not bm.allocate(make_seq("b", list(range(30))), 30)  # needs 8, only 5 free: no change
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_shared_prefix_is_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq("a", list(range(9)))
    compute_all(bm, first)  # blocks: [0-3] [4-7] full and cached, [8] partial
    second = make_seq("b", list(range(8)) + [99, 98])
    hits = bm.find_cached_prefix(second)
    assert hits == first.block_table[:2]
    assert bm.allocate(second, 2, hits)
    assert second.num_computed_tokens == 8
    assert bm.num_free_blocks == 8 - 3 - 1
    bm.free(first)
    assert bm.num_free_blocks == 8 - 3  # the shared blocks are still held by the second
    bm.free(second)
    assert bm.num_free_blocks == 8
    assert bm.num_cached_blocks == 2  # still reusable after being freed


def test_whole_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute_all(bm, make_seq("a", list(range(8))))
    again = make_seq("b", list(range(8)))
    assert len(bm.find_cached_prefix(again)) == 1  # the last block is recomputed to get logits


def test_least_recently_freed_cached_block_is_evicted_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = make_seq("old", [1, 2]), make_seq("new", [3, 4])
    compute_all(bm, old)
    bm.free(old)
    compute_all(bm, new)
    bm.free(new)
    assert bm.num_cached_blocks == 2
    filler = make_seq("filler", [7, 8, 9, 10, 11, 12])  # takes 3 of the 4 free blocks
    assert bm.allocate(filler, 6)
    assert bm.find_cached_prefix(make_seq("x", [1, 2, 0])) == []  # old one evicted
    assert bm.find_cached_prefix(make_seq("y", [3, 4, 0])) != []  # newer one survived


def test_hash_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=2)
    compute_all(bm, make_seq("a", [1, 2, 3, 4, 5]))
    # Same second block [3, 4] after a different first block must not hit.
    assert bm.find_cached_prefix(make_seq("b", [9, 9, 3, 4, 5])) == []


def test_a_lone_prompt_whose_cached_prefix_and_chunk_overflow_the_cache_starts_over():
    """Where every layer slides, a prompt may be longer than the cache: its whole cached prefix and its next chunk
    may not fit. Alone, it is scheduled from its first token (its blocks go back as its window moves on) rather
    than waiting for ever."""
    bm = BlockManager(num_blocks=4, block_size=4)
    compute_all(bm, first := make_seq("a", list(range(16))))
    bm.free(first)  # its four blocks stay cached
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add(again := make_seq("b", list(range(16)) + [7] * 8))
    assert len(bm.find_cached_prefix(again)) == 4  # and 8 more tokens need 2 blocks more: 6 of 4
    [item] = scheduler.schedule()
    assert item.seq is again and item.num_new_tokens == 8 and again.num_computed_tokens == 0
