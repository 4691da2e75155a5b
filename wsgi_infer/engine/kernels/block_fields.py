"""The block formats the CPU kernels read, and blocks made from float values.

The kernels read GGUF's own formats (``c/legacy_quants.h``, ``c/k_quants.h``), a file's blocks as they are (laid out
in tiles by ``c/tiles.c``). Float weights (a Hugging Face checkpoint, an F16 or BF16 GGUF, a type the kernels do not
read) become our own Q8_M, or Q4_1 where 4 bits are asked for: ``BlockFields`` holds those as plain tensors, one row
of the weight per row, and ``file_blocks`` writes them as a file's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

Q8_M = 200  # our own format's id, beside ggml's: Q8_0 with a minimum per block (c/legacy_quants.h)

# format -> inputs a block (c/k_quants.h: block_inputs)
FORMATS = {Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q5_1: 32, Q.Q8_0: 32, Q8_M: 32, Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256}
FORMATS |= {Q.IQ4_NL: 32, Q.IQ4_XS: 256}
FILE_TYPES = frozenset(f for f in FORMATS if f != Q8_M)  # GGUF's types the kernels read as the file holds them
# a block's bytes as a file holds it (Q8_M: d, m and 32 codes); a tile's block is 16 of them (c/k_quants.h)
FILE_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q8_0: 34, Q8_M: 36, Q.Q4_K: 144, Q.Q5_K: 176}
FILE_BLOCK_BYTES |= {Q.Q6_K: 210, Q.IQ4_NL: 18, Q.IQ4_XS: 136}


def format_name(fmt: int) -> str:
    return "Q8_M" if fmt == Q8_M else Q(fmt).name


def file_bits_per_weight(fmt: int) -> float:
    """What the file's blocks of a type hold a weight in (Q8_M: ours, 9)."""
    return FILE_BLOCK_BYTES[fmt] * 8 / FORMATS[fmt]


@dataclass
class BlockFields:
    """A weight [rows, k] made from float values, as Q8_M or Q4_1: codes uint8 [rows, k]; the blocks' scale d and
    minimum low, float16 [rows, blocks of 32]: w = d * code + low."""

    format: int
    codes: torch.Tensor
    d: torch.Tensor
    low: torch.Tensor


def file_blocks(fields: BlockFields) -> torch.Tensor:
    """Blocks made here (``from_values``: Q4_1 or Q8_M) as a file holds them, uint8 [rows, bytes a row], for the
    kernels' layout: d and m (float16), then Q4_1's codes two to a byte (input t low, t + 16 high), Q8_M's a byte
    each."""
    rows, blocks = fields.d.shape
    codes = fields.codes.view(rows, blocks, 32)
    if fields.format == Q.Q4_1:
        codes = codes[..., :16] | (codes[..., 16:] << 4)
    halves = torch.stack([fields.d, fields.low], dim=-1).view(torch.uint8)
    return torch.cat([halves, codes], dim=-1).reshape(rows, -1)


def from_values(weight: torch.Tensor, levels: int = 255) -> BlockFields:
    """Float values [rows, k] (k a multiple of 32) as blocks of 32 with a float16 scale and minimum: ``levels`` 255
    makes our Q8_M (8 bits: each weight within half a step of 1/255 of its block's range), 15 GGUF's Q4_1 (as
    llama.cpp makes it: ``int4`` quantization). Each code is rounded against the float16 scale and minimum it will
    be multiplied by."""
    fields = [_from_value_rows(weight[r : r + 2048].float(), levels) for r in range(0, weight.shape[0], 2048)]
    codes, d, low = (torch.cat(parts) for parts in zip(*fields))
    return BlockFields(Q8_M if levels == 255 else Q.Q4_1, codes, d, low)


def _from_value_rows(values: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = values.view(values.shape[0], -1, 32)
    low = groups.amin(-1).half()
    d = ((groups.amax(-1) - low.float()) / levels).half()
    steps = (groups - low.float()[..., None]) / d.float().clamp(min=2**-24)[..., None]  # d 0 (a constant block): any
    codes = steps.round_().clamp_(0, levels).to(torch.uint8)
    return codes.view(values.shape[0], -1), d, low
