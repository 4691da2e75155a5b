"""A step's attention inputs for one group of layers (``kv_cache_manager``): where each new token's key and value
go, and which slots each token reads, as the kernels or torch's attention take them (``layers.attention``)."""

from __future__ import annotations

import torch

from .kernels.cpu import CacheRows
from .layers.attention import AttentionMetadata, PrefillChunk
from .scheduling.step_budget import ScheduledSequence


class AttentionInputs:
    def __init__(self, block_size: int, device: torch.device, dtype: torch.dtype, window: int, on_kernels: bool):
        """``window``: the model's sliding-window layers' (their masks, in torch), or 0; ``on_kernels``: the
        kernels attend, reading the cache in place."""
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.window = window
        self.on_kernels = on_kernels

    def build(self, ordered: list[ScheduledSequence], num_single: int, group: int) -> AttentionMetadata:
        """Where the step's tokens go and what they read, in the blocks of one group of layers."""
        slots = []
        for item in ordered:
            start = item.seq.num_computed_tokens
            slots += self._slots(item.seq.block_tables[group].blocks, start, start + item.num_new_tokens)
        meta = AttentionMetadata(self.block_size, self._longs(slots), num_single)
        if self.on_kernels:
            meta.cache_rows = self._cache_rows(ordered, group)
        else:
            self._prepare_single_token(meta, ordered[:num_single], group)
            self._prepare_prefill(meta, ordered[num_single:], group)
        return meta

    def _cache_rows(self, items: list[ScheduledSequence], group: int) -> CacheRows:
        """For the kernels: each sequence's blocks, and each token's sequence and how far it sees."""
        ends = [s.seq.num_computed_tokens + s.num_new_tokens for s in items]
        padded = self._padded_block_tables(items, ends, group)
        row_seqs, context_lens = [], []
        for index, item in enumerate(items):
            start = item.seq.num_computed_tokens
            row_seqs += [index] * item.num_new_tokens
            context_lens += range(start + 1, start + item.num_new_tokens + 1)
        return CacheRows(self.block_size, *(self._longs(v) for v in (padded, row_seqs, context_lens)))

    def _padded_block_tables(
        self, items: list[ScheduledSequence], context_lens: list[int], group: int
    ) -> list[list[int]]:
        """Block tables padded with block 0 to the longest context: the padding's slots are never attended."""
        max_blocks = -(-max(context_lens) // self.block_size)
        tables = [s.seq.block_tables[group].blocks for s in items]
        return [table[:max_blocks] + [0] * (max_blocks - len(table)) for table in tables]

    def _longs(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _prepare_single_token(self, meta: AttentionMetadata, items: list[ScheduledSequence], group: int) -> None:
        """Block tables padded to the longest context, and the mask of each row's real slots."""
        if not items:
            return
        context_lens = [s.seq.num_computed_tokens + 1 for s in items]
        padded = self._padded_block_tables(items, context_lens, group)
        meta.single_token_blocks = self._longs(padded).flatten()
        padded_len = len(padded[0]) * self.block_size
        slot, lens = torch.arange(padded_len, device=self.device), self._longs(context_lens).unsqueeze(1)
        meta.single_token_mask = self._additive((slot < lens).view(len(items), 1, 1, padded_len))
        if self.window:  # the last window tokens only
            in_window = (slot < lens) & (slot >= lens - self.window)
            meta.single_token_window_mask = self._additive(in_window.view(len(items), 1, 1, padded_len))

    def _prepare_prefill(self, meta: AttentionMetadata, items: list[ScheduledSequence], group: int) -> None:
        """Per chunk: the slots of its whole context, and a causal mask offset by the cached prefix."""
        for item in items:
            end = item.seq.num_computed_tokens + item.num_new_tokens
            query_pos = torch.arange(item.seq.num_computed_tokens, end, device=self.device).unsqueeze(1)
            context_pos = torch.arange(end, device=self.device)
            in_window = (context_pos <= query_pos) & (context_pos > query_pos - self.window)
            meta.prefills.append(
                PrefillChunk(
                    num_tokens=item.num_new_tokens,
                    context_slots=self._longs(self._slots(item.seq.block_tables[group].blocks, 0, end)),
                    causal_mask=self._additive(context_pos <= query_pos),
                    window_mask=self._additive(in_window) if self.window else None,
                )
            )

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean mask as SDPA would turn it into scores to add (0 or -inf), once per step, not per layer."""
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """The cache slots of positions start..end-1. In Python: a decode step asks for one slot per row,
        where torch's ops cost 25 µs a row and this 1."""
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]
