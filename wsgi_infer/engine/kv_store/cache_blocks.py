"""One block position of the KV cache, every layer of it, as a flat tensor on the CPU: what a store keeps.

The cache holds one tensor per group of layers (``kv_cache_manager``), ``(layers, slots, 2 * kv heads, head
size)``; a sequence's block has an id in each group's pool. A payload is each group's block in group order, so a
pool that reads only part of a sequence (sliding layers, their last window) takes its own part of it.
"""

from __future__ import annotations

import math

import torch


class CacheBlocks:
    def __init__(self, group_caches: list[torch.Tensor], block_size: int) -> None:
        self.group_caches = group_caches
        self.block_size = block_size
        self.dtype = group_caches[0].dtype
        sizes = [math.prod(c[:, :block_size].shape) for c in group_caches]
        self._offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.payload_nbytes = self._offsets[-1] * self.dtype.itemsize

    def read(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the block that has, in each group's pool, these ids."""
        bs = self.block_size
        parts = [cache[:, b * bs : (b + 1) * bs].reshape(-1) for cache, b in zip(self.group_caches, block_ids)]
        return torch.cat(parts).cpu()

    def write(self, group: int, block_id: int, payload: torch.Tensor) -> None:
        """Fill block ``block_id`` of the group's pool with that group's part of ``payload``."""
        cache, bs = self.group_caches[group], self.block_size
        target = cache[:, block_id * bs : (block_id + 1) * bs]
        part = payload[self._offsets[group] : self._offsets[group + 1]]
        target.copy_(part.view(target.shape))

    def payload_of(self, data: memoryview) -> torch.Tensor:
        """A stored payload's bytes as a tensor, without a copy."""
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype)
