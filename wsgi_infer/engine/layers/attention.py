"""Paged attention in plain torch.

The KV cache of one layer is a flat tensor of slots ``[num_blocks * block_size,
2 * num_kv_heads, head_dim]``, each slot a token's key heads then its value heads,
so one op writes a step's keys and values and one copies a context's out; a
sequence's token at position p lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

With the CPU kernels, every token of a step (a decode's, or each of a prefill
chunk's) reads its sequence's blocks in place, in one call per layer. In torch,
one step mixes single-token sequences (one query token each: decodes, and
prefill chunks of one token; batched into a single attention call over their
gathered blocks, padded to the longest) and prefill chunks (several query
tokens each, attended one sequence at a time with a causal mask offset by the
cached prefix). The flat token order of a step is: all single tokens, then
each prefill chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels.cpu import CacheRows, CpuKernels


@dataclass
class PrefillChunk:
    num_tokens: int
    context_slots: torch.Tensor  # [context_len] slots of every token up to the chunk's end
    causal_mask: torch.Tensor  # [num_tokens, context_len] added to scores: 0 = may attend, -inf not
    window_mask: torch.Tensor | None = None  # the same for the model's sliding-window layers


@dataclass
class AttentionMetadata:
    """Per-step slot bookkeeping, built once and shared by every layer."""

    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_single_token_seqs: int
    cache_rows: CacheRows | None = None  # with the CPU kernels: every token's blocks, read in place
    # In torch: the single-token sequences' blocks and mask, and the prefill chunks.
    single_token_blocks: torch.Tensor | None = None  # [num_single_token_seqs * max_blocks] block ids, padded
    # [num_single_token_seqs, 1, 1, max_blocks * block_size], added to scores like causal_mask
    single_token_mask: torch.Tensor | None = None
    single_token_window_mask: torch.Tensor | None = None  # the same for the model's sliding-window layers
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Where sliding-window layers keep their own blocks beside global ones (kv_cache_manager): theirs.
    window_group: AttentionMetadata | None = None


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels: CpuKernels | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Write this step's keys and values into the cache, then attend over each sequence's context (with
    ``window``, a sliding-window layer's: each token's last ``window`` tokens, itself included).

    q: [tokens, heads, head_dim]; kv: [tokens, 2 * kv_heads, head_dim], keys then values.
    Returns [tokens, heads * head_dim]. With CPU kernels, every token reads the cache in place.
    """
    if window and meta.window_group is not None:
        meta = meta.window_group
    kv_cache.index_copy_(0, meta.slot_mapping, kv.to(kv_cache.dtype))  # a float16 cache for float32 rows: rounded
    if kernels is not None:
        return kernels.paged_attention(q, kv_cache, meta.cache_rows, scale, window)
    num_kv_heads = kv_cache.shape[1] // 2
    outputs = []
    num_single = meta.num_single_token_seqs
    if num_single:
        context = _gather_blocks(kv_cache, meta, num_single).to(q.dtype)
        keys, values = context[:, :, :num_kv_heads].transpose(1, 2), context[:, :, num_kv_heads:].transpose(1, 2)
        # Grouped-query attention without repeating K/V: the query heads sharing a
        # KV head become that head's query rows ([B, kv_heads, group, D]).
        grouped_q = q[:num_single].view(num_single, num_kv_heads, -1, q.shape[-1])
        mask = meta.single_token_window_mask if window else meta.single_token_mask
        out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
        outputs.append(out.flatten(1))
    start = num_single
    for chunk in meta.prefills:
        end = start + chunk.num_tokens
        context = kv_cache[chunk.context_slots].to(q.dtype)
        keys, values = context[:, :num_kv_heads].transpose(0, 1), context[:, num_kv_heads:].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            keys,
            values,
            attn_mask=chunk.window_mask if window else chunk.causal_mask,
            scale=scale,
            enable_gqa=True,
        )
        outputs.append(out.transpose(0, 1).flatten(1))
        start = end
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _gather_blocks(cache: torch.Tensor, meta: AttentionMetadata, batch: int) -> torch.Tensor:
    """[slots, 2 * kv_heads, D] cache -> [batch, padded_context, 2 * kv_heads, D].

    Copies whole blocks (contiguous rows of block_size * 2 * kv_heads * D) with one
    index_select, which is several times faster than gathering slot by slot.
    """
    heads, head_dim = cache.shape[1:]
    blocks = cache.view(-1, meta.block_size * heads * head_dim).index_select(0, meta.single_token_blocks)
    return blocks.view(batch, -1, heads, head_dim)
