"""A weight as the CPU kernels multiply it: parts of its rows (a fused projection stacks several checkpoint weights),
each its format's blocks in tiles of 16 rows (``c/tiles.c`` lays them out), and the C structure that hands it to
them (``c/packed_mm.h``)."""

from __future__ import annotations

import ctypes
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime.huge_pages import HugePageArena
from .block_fields import FILE_BLOCK_BYTES, FORMATS, file_bits_per_weight, format_name

MAX_PARTS = 4  # c/packed_mm.h
TILE = 16  # rows of a tile: one register's lanes, each an output
_P, _I = ctypes.c_void_p, ctypes.c_int64


class CPackedPart(ctypes.Structure):
    _fields_ = [("type", _I), ("tiles", _P), ("n", _I)]


class CPackedWeight(ctypes.Structure):
    _fields_ = [("parts", CPackedPart * MAX_PARTS), ("count", _I), ("n", _I), ("k", _I), ("bias", _P)]


@dataclass
class PackedPart:
    format: int
    tiles: torch.Tensor  # uint8 [tiles, blocks, bytes a tile's block]
    n: int  # its rows

    @property
    def weights(self) -> int:
        return self.n * self.tiles.shape[1] * FORMATS[self.format]


@dataclass
class PackedWeight:
    """A weight [n, k]. ``file_values``: every part holds a file's blocks as they are, so that its rows dequantized
    are the file's values exactly (gguf-py's); not for weights quantized here from float values."""

    parts: list[PackedPart]
    k: int
    file_values: bool

    @property
    def n(self) -> int:
        return sum(part.n for part in self.parts)

    def struct(self, bias: torch.Tensor | None = None) -> CPackedWeight:
        """The C structure; valid while this weight (and the bias) live."""
        parts = [CPackedPart(part.format, part.tiles.data_ptr(), part.n) for part in self.parts]
        address = None if bias is None else bias.data_ptr()
        return CPackedWeight((CPackedPart * MAX_PARTS)(*parts), len(parts), self.n, self.k, address)

    @property
    def nbytes(self) -> int:
        return sum(part.tiles.nbytes for part in self.parts)


ROWS_AT_ONCE = 256 * TILE  # a part is laid out so many rows at a time: a file's pages can go as it is read


def packed_part(
    fmt: int,
    rows: int,
    blocks_of: Callable[[int, int], torch.Tensor | np.ndarray],
    memory: HugePageArena,
    tile_blocks: Callable[[int, torch.Tensor | np.ndarray, torch.Tensor], None],
) -> PackedPart:
    """A part of ``rows`` rows in format ``fmt``, whose rows [a, b) are the blocks ``blocks_of(a, b)`` as a file holds
    them (uint8 [b - a, bytes a row]): laid out by ``tile_blocks`` (the kernels': ``CpuKernels.tile_blocks``) in the
    huge pages of ``memory``, ``ROWS_AT_ONCE`` rows at a time."""
    tiles = None
    for start in range(0, rows, ROWS_AT_ONCE):
        blocks = blocks_of(start, min(rows, start + ROWS_AT_ONCE))
        if tiles is None:
            shape = (-(-rows // TILE), blocks.shape[1] // FILE_BLOCK_BYTES[fmt], TILE * FILE_BLOCK_BYTES[fmt])
            tiles = memory.take(math.prod(shape)).view(shape)
        tile_blocks(fmt, blocks, tiles[start // TILE : -(-(start + len(blocks)) // TILE)])
    return PackedPart(fmt, tiles, rows)


def packed_weight(parts: list[PackedPart], file_values: bool) -> PackedWeight:
    """A weight of parts stacked in order, all with the same inputs."""
    inputs = {part.tiles.shape[1] * FORMATS[part.format] for part in parts}
    if not 0 < len(parts) <= MAX_PARTS or len(inputs) != 1:
        raise ValueError(f"a packed weight has 1 to {MAX_PARTS} parts of the same inputs, not {len(parts)} of {inputs}")
    return PackedWeight(parts, inputs.pop(), file_values)


def bits_per_weight(weights: list[PackedWeight]) -> dict[str, str]:
    """Per format, what the packed weights hold a weight in beside the file's blocks of that type (the load's log)."""
    held, counted = defaultdict(int), defaultdict(int)
    for weight in weights:
        for part in weight.parts:
            held[part.format] += part.tiles.nbytes
            counted[part.format] += part.weights
    return {
        format_name(fmt): f"{8 * held[fmt] / counted[fmt]:.3f} bits (file {file_bits_per_weight(fmt):.3f})"
        for fmt in sorted(held)
    }
