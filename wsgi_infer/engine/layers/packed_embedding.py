"""Token embeddings read from the tied LM head's packed groups, where those hold them exactly.

A GGUF's tied embedding is usually Q8_0, and its blocks become the LM head's int8 groups as they are (``q * d``
in float32 both ways). Then the float32 table the lookup read is a second copy of the same values: Gemma 3's
262,144 x 640 is 671 MB, a quarter of its server's memory. Each row is one tile lane of the packed codes, scaled.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..kernels.layouts import KernelWeight
from .quantization import PackedLinear

log = logging.getLogger(__name__)

CHECK_ROWS = 4096  # rows compared at a time at load: a few MB of temporaries


def packed_rows(weight: KernelWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an int8 packed weight as float32 [*ids.shape, k]: tile ids // 16, lane ids % 16."""
    flat = ids.reshape(-1)
    tile, lane = flat // 16, flat % 16
    low = None if weight.low is None else weight.low[tile, :, lane]
    values = _scaled(weight.codes[tile, :, lane, :].reshape(len(flat), -1, 32), weight.scale[tile, :, lane], low)
    return values.reshape(*ids.shape, -1)


def _tile_rows(weight: KernelWeight, tiles: slice) -> torch.Tensor:
    """Every row of some tiles of an int8 packed weight, as float32 [16 * tiles, k]: as ``packed_rows`` gives
    them, in 40% of its time for a whole table (no gathered indices)."""
    codes = weight.codes[tiles].transpose(1, 2).reshape(-1, weight.k // 32, 32)  # [rows, groups, 32]
    low = None if weight.low is None else weight.low[tiles].transpose(1, 2).reshape(codes.shape[:2])
    return _scaled(codes, weight.scale[tiles].transpose(1, 2).reshape(codes.shape[:2]), low).flatten(1)


def _scaled(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
    """Int8 codes [rows, groups, 32] times their groups' scales [rows, groups], plus lows: float32."""
    values = codes.float() * scale.float()[..., None]
    return values if low is None else values + low.float()[..., None]


class PackedEmbedding(nn.Module):
    """``nn.Embedding``'s lookup, from a packed int8 weight (the LM head's)."""

    def __init__(self, weight: KernelWeight) -> None:
        super().__init__()
        self.packed = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return packed_rows(self.packed, ids)


def holds_exactly(weight: KernelWeight, table: torch.Tensor) -> bool:
    """Whether every row of the packed weight is, bit for bit, the table's."""
    for start in range(0, table.shape[0], CHECK_ROWS):
        rows = table[start : start + CHECK_ROWS]
        values = _tile_rows(weight, slice(start // 16, (start + len(rows) + 15) // 16))
        if not torch.equal(values[: len(rows)], rows):
            return False
    return True


def share_embedding_with_packed_head(model: nn.Module, known_exact: bool = False) -> bool | None:
    """Where ``model``'s embedding is tied to an LM head packed as int8 groups that hold it exactly, look rows up
    there and let the float32 table go. Whether it does; None where it cannot (not tied, or a head not in int8).
    ``known_exact``: the head is known to hold it (its groups are the table's own), so the table, not read yet, is
    not compared."""
    head, table = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    if not getattr(model, "tied_embeddings", False) or not isinstance(table, nn.Embedding):
        return None
    if not isinstance(head, PackedLinear) or head.bits != 8:
        return None
    if not known_exact and not holds_exactly(head.packed, table.weight):
        return False
    model.embed_tokens = PackedEmbedding(head.packed)
    log.info(
        "embedding rows read from the packed LM head (its groups hold them exactly%s): %d MB not kept",
        ": they are the table's own" if known_exact else "",
        table.weight.numel() * table.weight.element_size() >> 20,
    )
    return True
