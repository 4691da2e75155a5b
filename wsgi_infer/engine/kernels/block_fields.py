"""A weight's quantized blocks, field by field: what a GGUF file's blocks hold, or what we make from float values.

The CPU kernels read GGUF's own formats (``c/legacy_quants.h``, ``c/k_quants.h``). ``BlockFields`` holds a weight
in one of them as plain tensors, one row of the weight per row: each input's unsigned code, and each block's
(sub-block's) scales. ``tiles.py`` lays these out for the kernels. A file's blocks are read here bit for bit; float
weights (a Hugging Face checkpoint, an F16 or BF16 GGUF, a type the kernels do not read) become our own Q8_M, or
Q4_1 where 4 bits are asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

Q8_M = 200  # our own format's id, beside ggml's: Q8_0 with a minimum per block (c/legacy_quants.h)

# format -> (inputs a block, bytes a tile's block, bits a code): the kernels' own figures (packed_block_bytes)
FORMATS = {
    Q.Q4_0: (32, 288, 4),
    Q.Q4_1: (32, 320, 4),
    Q.Q5_0: (32, 352, 5),
    Q.Q5_1: (32, 384, 5),
    Q.Q8_0: (32, 544, 8),
    Q8_M: (32, 576, 8),
    Q.Q4_K: (256, 2304, 4),
    Q.Q5_K: (256, 2816, 5),
    Q.Q6_K: (256, 3360, 6),
}
FILE_TYPES = frozenset(f for f in FORMATS if f != Q8_M)  # GGUF's types the kernels read as the file holds them
FILE_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q8_0: 34, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}


def format_name(fmt: int) -> str:
    return "Q8_M" if fmt == Q8_M else Q(fmt).name


def file_bits_per_weight(fmt: int) -> float:
    """What the file's blocks of a type hold a weight in (Q8_M: what ours would, 9)."""
    return 9.0 if fmt == Q8_M else FILE_BLOCK_BYTES[fmt] * 8 / FORMATS[fmt][0]


@dataclass
class BlockFields:
    """A weight [rows, k] in a format: codes uint8 [rows, k] (unsigned: Q8_0's shifted by 128); d float16
    [rows, blocks]; low float16 [rows, blocks], the minimum (Q4_1, Q5_1, Q8_M) or dmin (Q4_K, Q5_K), else None;
    scales uint8 [rows, blocks, 12], the file's 6-bit scales and mins as it packs them (Q4_K, Q5_K), or int8
    [rows, blocks, 16] (Q6_K), else None."""

    format: int
    codes: torch.Tensor
    d: torch.Tensor
    low: torch.Tensor | None = None
    scales: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.codes.shape[0]


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Each block's float16 at byte ``at``: [rows, blocks]."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes a block -> 32 codes: byte t's low nibble is input t, its high one input t + 16 (ggml's layout)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(words: torch.Tensor, count: int) -> torch.Tensor:
    """Little-endian bytes [..., count / 8] -> their bits [..., count], bit i of the word first."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((words[..., :, None] >> shifts) & 1).reshape(*words.shape[:-1], count)


def from_file_blocks(raw: torch.Tensor, ggml_type: int) -> BlockFields:
    """A 2-D tensor's blocks as the file holds them (uint8 [rows, row bytes]) -> their fields, bit for bit."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, FILE_BLOCK_BYTES[ggml_type])
    d = _half(blocks, 0)
    if ggml_type in (Q.Q4_0, Q.Q4_1):
        low = _half(blocks, 2) if ggml_type == Q.Q4_1 else None
        codes = _nibbles(blocks[..., 4 if low is not None else 2 :])
        return BlockFields(ggml_type, codes.reshape(rows, -1), d, low)
    if ggml_type in (Q.Q5_0, Q.Q5_1):
        at = 4 if ggml_type == Q.Q5_1 else 2
        fifth = _bits(blocks[..., at : at + 4], 32)
        codes = _nibbles(blocks[..., at + 4 :]) | (fifth << 4)
        return BlockFields(ggml_type, codes.reshape(rows, -1), d, _half(blocks, 2) if at == 4 else None)
    if ggml_type == Q.Q8_0:
        return BlockFields(ggml_type, (blocks[..., 2:] ^ 0x80).reshape(rows, -1), d)
    if ggml_type == Q.Q6_K:
        return _q6_k(blocks)
    return _q4_k_or_q5_k(blocks, ggml_type)


def _q4_k_or_q5_k(blocks: torch.Tensor, ggml_type: int) -> BlockFields:
    """Q4_K: d, dmin, 12 bytes of scales, 128 of codes (each 32 bytes two sub-blocks: low nibbles the first, high
    the second); Q5_K has 32 bytes of fifth bits before its codes (byte t's bit j: sub-block j's input t)."""
    rows, count = blocks.shape[:2]
    qs = blocks[..., 16:144] if ggml_type == Q.Q4_K else blocks[..., 48:176]
    codes = (qs.reshape(rows, count, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 15
    codes = codes.reshape(rows, count, 8, 32)
    if ggml_type == Q.Q5_K:
        codes = codes | ((blocks[..., 16:48, None] >> torch.arange(8, dtype=torch.uint8)) & 1).transpose(-1, -2) << 4
    return BlockFields(ggml_type, codes.reshape(rows, -1), _half(blocks, 0), _half(blocks, 2), blocks[..., 4:16])


def _q6_k(blocks: torch.Tensor) -> BlockFields:
    """128 bytes of low nibbles (each 64 bytes: inputs t and 64 + t of a half of 128), 64 of high bit pairs (each
    32 bytes: pair i of byte t is input 32i + t of a half), 16 signed scales (one per 16 inputs), float16 d."""
    rows, count = blocks.shape[:2]
    low = (blocks[..., :128].reshape(rows, count, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 15
    high = blocks[..., 128:192].reshape(rows, count, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    codes = low.reshape(rows, count, 256) | ((high & 3).reshape(rows, count, 256) << 4)
    scales = blocks[..., 192:208].contiguous().view(torch.int8)
    return BlockFields(Q.Q6_K, codes.reshape(rows, -1), _half(blocks, 208), scales=scales)


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
