"""KV-cache blocks: reference counts, prefix hashing, LRU eviction of cached free blocks, and the pools of models
that mix sliding-window layers with global ones."""

from __future__ import annotations

import pytest

from wsgi_infer.engine.sampling_params import SamplingParams
from wsgi_infer.engine.scheduling.kv_cache_manager import KVCacheManager, KVGroup, plan_kv_groups
from wsgi_infer.engine.scheduling.scheduler import Scheduler
from wsgi_infer.engine.scheduling.sequence import Sequence


def make_seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, SamplingParams(), max_tokens=16)


def one_pool(num_blocks: int, block_size: int) -> KVCacheManager:
    return KVCacheManager([KVGroup((0,), 0, num_blocks)], block_size)


def two_pools(num_blocks: int, window_blocks: int, block_size: int, window: int) -> KVCacheManager:
    """Layer 0 global, layer 1 sliding."""
    return KVCacheManager([KVGroup((0,), 0, num_blocks), KVGroup((1,), window, window_blocks)], block_size)


def compute_all(kv: KVCacheManager, seq: Sequence, chunk: int = 1 << 20) -> None:
    """Compute ``seq``'s remaining tokens, ``chunk`` at a time, as the engine does: cache, then release."""
    while seq.num_computed_tokens < seq.num_tokens:
        num_new = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert kv.allocate(seq, num_new)
        seq.num_computed_tokens += num_new
        kv.cache_computed_blocks(seq)
        kv.release_behind(seq)


def test_allocate_and_free_round_trip():
    kv = one_pool(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(10)))
    assert kv.allocate(seq, 10)
    assert len(seq.block_tables[0].blocks) == 3 and kv.num_free_blocks == 5
    assert not kv.allocate(make_seq("b", list(range(30))), 30)  # needs 8, only 5 free: no change
    assert kv.num_free_blocks == 5
    kv.free(seq)
    assert kv.num_free_blocks == 8 and seq.block_tables[0].blocks == []


def test_a_readmission_after_a_preemption_counts_no_cached_tokens():
    """Preempted in its prefill, a prompt readmitted finds its own blocks: the usage's cached_tokens counted them
    (96 of a 495-token prompt no other shared, the memory-pressure probe); vLLM counts the first admission's."""
    kv = one_pool(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(9)))
    assert kv.find_cached_prefix(seq) is None and kv.allocate(seq, 8)
    seq.first_scheduled_time = 1.0  # admitted (the scheduler's _admit)
    seq.num_computed_tokens = 8
    kv.cache_computed_blocks(seq)
    kv.free(seq)  # preempted before its last token
    hit = kv.find_cached_prefix(seq)
    assert hit.num_blocks == 2 and kv.allocate(seq, 1, hit)
    assert seq.num_computed_tokens == 8 and seq.num_cached_tokens == 0


def test_shared_prefix_is_reference_counted():
    kv = one_pool(num_blocks=8, block_size=4)
    first = make_seq("a", list(range(9)))
    compute_all(kv, first)  # blocks: [0-3] [4-7] full and cached, [8] partial
    second = make_seq("b", list(range(8)) + [99, 98])
    hit = kv.find_cached_prefix(second)
    assert hit.num_blocks == 2 and hit.tables == [(0, first.block_tables[0].blocks[:2])]
    assert kv.allocate(second, 2, hit)
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert kv.num_free_blocks == 8 - 3 - 1
    kv.free(first)
    assert kv.num_free_blocks == 8 - 3  # the shared blocks are still held by the second
    kv.free(second)
    assert kv.num_free_blocks == 8
    assert kv.num_cached_blocks == 2  # still reusable after being freed


def test_whole_prompt_hit_leaves_one_token_to_compute():
    kv = one_pool(num_blocks=8, block_size=4)
    compute_all(kv, make_seq("a", list(range(8))))
    assert kv.find_cached_prefix(make_seq("b", list(range(8)))).num_blocks == 1  # the last block gives logits


def test_least_recently_freed_cached_block_is_evicted_first():
    kv = one_pool(num_blocks=4, block_size=2)
    old, new = make_seq("old", [1, 2]), make_seq("new", [3, 4])
    compute_all(kv, old)
    kv.free(old)
    compute_all(kv, new)
    kv.free(new)
    assert kv.num_cached_blocks == 2
    filler = make_seq("filler", [7, 8, 9, 10, 11, 12])  # takes 3 of the 4 free blocks
    assert kv.allocate(filler, 6)
    assert kv.find_cached_prefix(make_seq("x", [1, 2, 0])) is None  # old one evicted
    assert kv.find_cached_prefix(make_seq("y", [3, 4, 0])) is not None  # newer one survived


def test_hash_depends_on_the_whole_prefix():
    kv = one_pool(num_blocks=8, block_size=2)
    compute_all(kv, make_seq("a", [1, 2, 3, 4, 5]))
    # Same second block [3, 4] after a different first block must not hit.
    assert kv.find_cached_prefix(make_seq("b", [9, 9, 3, 4, 5])) is None
    # Nor as a first block: its hash chains the block before it (the lookup above stops at [9, 9] either way).
    assert kv.find_cached_prefix(make_seq("c", [3, 4, 5])) is None
    assert kv.find_cached_prefix(make_seq("d", [1, 2, 3, 4, 5])).num_blocks == 2


def test_a_prefix_is_found_only_by_requests_of_its_tenant_and_salt():
    kv = one_pool(num_blocks=16, block_size=2)

    def seq(name: str, tenant: str = "", salt: str = "") -> Sequence:
        return Sequence(name, [1, 2, 3, 4, 5], SamplingParams(tenant=tenant, cache_salt=salt), max_tokens=16)

    compute_all(kv, seq("a", tenant="alice"))
    assert kv.find_cached_prefix(seq("b", tenant="alice")).num_blocks == 2
    assert kv.find_cached_prefix(seq("c", tenant="mallory")) is None  # cached_tokens would tell mallory
    assert kv.find_cached_prefix(seq("d")) is None
    assert kv.find_cached_prefix(seq("e", tenant="alice", salt="s")) is None
    compute_all(kv, seq("f", salt="s"))
    assert kv.find_cached_prefix(seq("g", salt="s")).num_blocks == 2
    assert kv.find_cached_prefix(seq("h", tenant="s")) is None  # the pair, not its concatenation


def test_a_lone_prompt_whose_cached_prefix_and_chunk_overflow_the_cache_starts_over():
    """Where every layer slides, a prompt may be longer than the cache: its whole cached prefix and its next chunk
    may not fit. Alone, it is scheduled from its first token (its blocks go back as its window moves on) rather
    than waiting for ever."""
    kv = one_pool(num_blocks=4, block_size=4)
    compute_all(kv, first := make_seq("a", list(range(16))))
    kv.free(first)  # its four blocks stay cached
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add(again := make_seq("b", list(range(16)) + [7] * 8))
    assert kv.find_cached_prefix(again).num_blocks == 4  # and 8 more tokens need 2 blocks more: 6 of 4
    [item] = scheduler.schedule()
    assert item.seq is again and item.num_new_tokens == 8 and again.num_computed_tokens == 0


def test_the_sliding_pool_holds_a_window_and_the_global_pool_everything():
    """Window 8, blocks of 4, 40 tokens in chunks of 4: the sliding layer's table keeps the blocks of the next
    token's window (33..40: blocks 8 and 9), the global one all ten; freeing returns both."""
    kv = two_pools(num_blocks=16, window_blocks=16, block_size=4, window=8)
    seq = make_seq("a", list(range(40)))
    compute_all(kv, seq, chunk=4)
    global_table, window_table = seq.block_tables
    assert len(global_table.blocks) == len(window_table.blocks) == 10
    assert global_table.num_released == 0 and window_table.num_released == 8
    assert [pool.num_free_blocks for pool in kv.pools] == [16 - 10, 16 - 2]
    kv.free(seq)
    assert kv.num_free_blocks == kv.num_blocks == 32


def test_a_prefix_hit_needs_only_the_windows_blocks_in_the_sliding_pool():
    """The sliding pool (4 blocks) evicts the early blocks of a 40-token prompt as it moves on; the prompt is still
    a hit for 10 blocks, whose sliding table skips the 8 behind the window. Once those two are gone, it is no
    hit at all: the sliding pool holds no earlier window either."""
    kv = two_pools(num_blocks=16, window_blocks=4, block_size=4, window=8)
    compute_all(kv, first := make_seq("a", list(range(40))), chunk=4)
    kv.free(first)
    again = make_seq("b", list(range(40)) + [99] * 5)
    hit = kv.find_cached_prefix(again)
    assert hit.num_blocks == 10
    assert hit.tables[0][0] == 0 and len(hit.tables[0][1]) == 10
    assert hit.tables[1][0] == 8 and len(hit.tables[1][1]) == 2
    assert kv.allocate(again, 5, hit)
    assert again.num_computed_tokens == 40 and again.block_tables[1].num_released == 8
    assert len(again.block_tables[1].blocks) == len(again.block_tables[0].blocks) == 12
    kv.free(again)
    filler = make_seq("filler", [5] * 16)  # every block of the sliding pool: the two cached ones last
    assert kv.allocate(filler, 16)
    assert kv.find_cached_prefix(make_seq("c", list(range(40)) + [99])) is None


def test_plan_gives_the_sliding_layers_their_windows_and_the_global_layers_the_rest():
    layer = 1000  # bytes of one layer's block
    windows = [8, 8, 0, 8, 8, 0]
    assert plan_kv_groups([0] * 6, layer, 60_000, 4, 2, 8) == [KVGroup(tuple(range(6)), 0, 10)]
    assert plan_kv_groups([8] * 6, layer, 60_000, 4, 2, 8) == [KVGroup(tuple(range(6)), 8, 10)]
    # A large budget: the sliding pool holds 2 sequences' windows (2 + 2 blocks each) and a step (2 blocks).
    big = plan_kv_groups(windows, layer, 600_000, 4, 2, 8)
    assert big == [KVGroup((2, 5), 0, (600_000 - 10 * 4 * layer) // (2 * layer)), KVGroup((0, 1, 3, 4), 8, 10)]
    # Where the windows would take more than one pool's blocks: both pools get one pool's (as before).
    assert [g.num_blocks for g in plan_kv_groups(windows, layer, 60_000, 4, 2, 8)] == [10, 10]
    assert [g.num_blocks for g in plan_kv_groups(windows, layer, 60_000, 4, 2, 8, num_blocks=3)] == [3, 3]
    with pytest.raises(ValueError, match="hold no block of 4 tokens"):  # one was allocated past the budget
        plan_kv_groups([0] * 6, layer, 5_999, 4, 2, 8)
