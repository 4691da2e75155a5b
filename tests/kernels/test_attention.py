"""Paged attention on the compiled CPU kernels: what SDPA computes over the same blocks, for every group of queries a
key-value head serves, and the same bits alone and in any batch (every installed variant this CPU runs and clang's
build)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wsgi_infer.engine.kernels.cpu import CacheRows

from ..support.kernel_libraries import randn

F32_CLOSE = dict(rtol=1e-5, atol=1e-6)  # float32 sums in another order


# groups of 1-5 heads: a decode's group, and a 5-row run's 5 to 25 heads (the queries past the kernels' whole tiles,
# of 6 with AVX2 and 16 with AVX-512, each count a tile of its own: the next test takes every one)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("head_dim", [64, 80, 256])  # 80: 5 blocks of 16; 256: more sums than registers hold
def test_paged_attention_reads_scattered_blocks_as_sdpa_does(kernels, head_dim, group):
    """Three sequences over blocks out of order, grouped-query heads (group over each of 3): two decode a token
    each, the third runs a prefill chunk of 5 tokens, each of which sees its sequence up to itself (the chunk's rows
    attend as one run). Float32 queries over a float16 cache: on AVX2 without AVX-512, in 8-lane registers;
    elsewhere, in 16-lane vectors."""
    torch.manual_seed(0)
    block_size, kv_heads, heads, scale = 4, 3, 3 * group, head_dim**-0.5
    # a score is one chain of multiply-adds over the dimensions (its bits the same in any batch), where SDPA sums
    # in blocks: its error grows with the head (256: up to 1.1e-6 from float64's, SDPA's 4e-7)
    close = dict(rtol=1e-5, atol=max(1, head_dim / 128) * 1e-6)
    cache = randn(40 * block_size, 2 * kv_heads, head_dim).half()
    tables = [torch.randperm(40)[: -(-n // block_size)] for n in (1, 13, 30)]
    padded = torch.stack([F.pad(t, (0, 8 - len(t))) for t in tables])
    row_seqs, lens = torch.tensor([0, 1, 2, 2, 2, 2, 2]), torch.tensor([1, 13, 26, 27, 28, 29, 30])
    q = randn(7, heads + 2 * kv_heads, head_dim)[:, :heads]  # strided rows, as in the projection's output
    got = kernels.paged_attention(q, cache, CacheRows(block_size, padded, row_seqs, lens), scale)
    for row, (seq, n) in enumerate(zip(row_seqs.tolist(), lens.tolist())):
        slots = (tables[seq][:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        keys, values = cache[slots, :kv_heads].float(), cache[slots, kv_heads:].float()
        query = q[row].float().view(kv_heads, group, head_dim)
        expected = F.scaled_dot_product_attention(query, keys.transpose(0, 1), values.transpose(0, 1), scale=scale)
        torch.testing.assert_close(got[row], expected.flatten(), **close)
    # Each row alone, as a decode over the same context, gives what it gave in the batch, where the chunk's rows
    # attended as one run (each key read once for them all).
    for row, seq in enumerate(row_seqs.tolist()):
        rows = CacheRows(block_size, padded[seq : seq + 1], torch.zeros(1, dtype=torch.long), lens[row : row + 1])
        assert torch.equal(kernels.paged_attention(q[row : row + 1], cache, rows, scale), got[row : row + 1])
    # And each head what it gives with a key-value head of its own: a group shares reads, not arithmetic.
    keys, values = cache[:, :kv_heads], cache[:, kv_heads:]
    own_heads = torch.cat([keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)], 1)
    assert torch.equal(kernels.paged_attention(q, own_heads, CacheRows(block_size, padded, row_seqs, lens), scale), got)
    # A sliding window of 10 tokens: each row sees its last 10 (or fewer) only.
    windowed = kernels.paged_attention(q, cache, CacheRows(block_size, padded, row_seqs, lens), scale, window=10)
    for row, (seq, n) in enumerate(zip(row_seqs.tolist(), lens.tolist())):
        slots = (tables[seq][:, None] * block_size + torch.arange(block_size)).flatten()[max(0, n - 10) : n]
        keys, values = cache[slots, :kv_heads].float(), cache[slots, kv_heads:].float()
        query = q[row].float().view(kv_heads, group, head_dim)
        expected = F.scaled_dot_product_attention(query, keys.transpose(0, 1), values.transpose(0, 1), scale=scale)
        torch.testing.assert_close(windowed[row], expected.flatten(), **close)


def test_every_count_of_queries_a_key_value_head_serves_attends_as_sdpa_does(kernels):
    """A decode whose one key-value head serves 1 to 33 query heads: every count past the whole score tiles (of 6
    with AVX2, 16 with AVX-512), and whole tiles beside them."""
    torch.manual_seed(0)
    block_size, head_dim, n = 4, 64, 13
    cache = randn(8 * block_size, 2, head_dim).half()
    rows = CacheRows(block_size, torch.arange(8)[None], torch.zeros(1, dtype=torch.long), torch.tensor([n]))
    keys, values = cache[:n, :1].float().transpose(0, 1), cache[:n, 1:].float().transpose(0, 1)
    for heads in range(1, 34):
        q = randn(1, heads, head_dim)
        expected = F.scaled_dot_product_attention(q[0].float()[None], keys, values, scale=head_dim**-0.5)
        got = kernels.paged_attention(q, cache, rows, head_dim**-0.5)
        torch.testing.assert_close(got[0], expected.flatten(), **F32_CLOSE, msg=f"{heads} heads")


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("head_dim", [64, 128, 256])  # Llama 3.2 1B's, 3B's and Qwen3's, Gemma 3's
def test_long_contexts_attend_in_parts_alike_alone_and_in_a_batch(kernels, window, head_dim):
    """Contexts past 256 tokens (ATTEND_PART) are attended in parts, each with its own peak, folded in order. A row
    alone (a decode: its three tasks' parts spread over the threads) gets what it gets in a batch of many tasks
    (each folding its own parts), or in a prefill chunk's run, or in a batch of decodes alone (their parts spread
    over the threads, a part's heads together); each close to SDPA. With a sliding window the parts count from the
    window's first token. (With AVX2, value sums of heads of 128 and 256 once ran past a head's
    dimensions: garbage and a different result each time, past a sliding window's first cut.)"""
    torch.manual_seed(0)
    block_size, kv_heads, heads, scale = 16, 3, 9, head_dim**-0.5
    cache = randn(200 * block_size, 2 * kv_heads, head_dim).half()
    tables = [torch.randperm(200)[:60], torch.randperm(200)[:20]]
    padded = torch.stack([F.pad(t, (0, 60 - len(t))) for t in tables])
    # a prefill chunk of 6 rows of the long sequence, then decodes of both sequences
    row_seqs = torch.tensor([0] * 6 + [1, 0, 1, 1])
    lens = torch.tensor([700, 701, 702, 703, 704, 705, 300, 900, 257, 256])
    q = randn(len(lens), heads + 2 * kv_heads, head_dim)[:, :heads]
    got = kernels.paged_attention(q, cache, CacheRows(block_size, padded, row_seqs, lens), scale, window=window)
    for row, (seq, n) in enumerate(zip(row_seqs.tolist(), lens.tolist())):
        alone = CacheRows(block_size, padded[seq : seq + 1], torch.zeros(1, dtype=torch.long), lens[row : row + 1])
        assert torch.equal(
            kernels.paged_attention(q[row : row + 1], cache, alone, scale, window=window), got[row : row + 1]
        )
        slots = (tables[seq][:, None] * block_size + torch.arange(block_size)).flatten()[
            max(0, n - window) if window else 0 : n
        ]
        keys, values = cache[slots, :kv_heads].float(), cache[slots, kv_heads:].float()
        query = q[row].float().view(kv_heads, 3, head_dim)
        expected = F.scaled_dot_product_attention(query, keys.transpose(0, 1), values.transpose(0, 1), scale=scale)
        torch.testing.assert_close(got[row], expected.flatten(), **F32_CLOSE)
    decodes = torch.tensor([6, 7, 8])  # no two of one sequence side by side: a run each
    rows = CacheRows(block_size, padded, row_seqs[decodes], lens[decodes])
    assert torch.equal(kernels.paged_attention(q[decodes], cache, rows, scale, window=window), got[decodes])
