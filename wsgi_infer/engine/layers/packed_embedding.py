"""Token embeddings read from the tied LM head's packed weight, where it holds the file's own blocks.

A GGUF's tied embedding (a Q8_0, Q6_K or Q4_K table) is also its LM head, which the kernels keep in the file's
blocks. Dequantized as gguf-py dequantizes them, its rows are the table's values exactly, so no float32 table is
kept beside them (Gemma 3's 262,144 x 640 would be 671 MB, a quarter of its server's memory).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..kernels.cpu import CpuKernels
from ..kernels.packed import PackedWeight
from .quantization import PackedLinear

log = logging.getLogger(__name__)


class PackedEmbedding(nn.Module):
    """``nn.Embedding``'s lookup, from a packed weight's rows (the LM head's)."""

    def __init__(self, weight: PackedWeight, kernels: CpuKernels) -> None:
        super().__init__()
        self.packed, self.kernels = weight, kernels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.packed_rows(self.packed, ids)


def share_embedding_with_packed_head(model: nn.Module) -> bool:
    """Where ``model``'s embedding is tied to an LM head packed in the file's own blocks, look rows up there and never
    read the table (called before the weights load). Whether it does."""
    head, table = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    if not getattr(model, "tied_embeddings", False) or not isinstance(table, nn.Embedding):
        return False
    if not isinstance(head, PackedLinear) or not head.packed.file_values:
        return False
    model.embed_tokens = PackedEmbedding(head.packed, head.kernels)
    log.info(
        "embedding rows read from the packed LM head (the file's blocks): %d MB not kept", table.weight.nbytes >> 20
    )
    return True
