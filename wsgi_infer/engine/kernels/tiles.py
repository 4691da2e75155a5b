"""A weight's block fields (``block_fields``) laid out as the CPU kernels read them: tiles of 16 rows.

A tile's block puts its 16 rows' blocks side by side, field by field, so that one vector load covers the tile's
rows and each lane is one output row (``c/quant_simd.h``, ``c/legacy_quants.h`` and ``c/k_quants.h`` say what
each field's bytes are). The codes keep the file's bits: 4-bit codes two to a byte as the file pairs them
(input t with t + 16 of each 32), fifth and sixth bits in words of their own, 8-bit codes as bytes. Rows past the
weight's last, up to a whole tile, are zeros (a zero scale: their outputs are never written).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from .block_fields import FORMATS, BlockFields

TILE = 16
_FIFTH = {Q.Q5_0, Q.Q5_1, Q.Q5_K}


def tile_layout(fields: BlockFields) -> torch.Tensor:
    """uint8 [tiles, blocks, bytes a tile's block] (``FORMATS``)."""
    pad = -fields.rows % TILE
    inputs, block_bytes, bits = FORMATS[fields.format]
    codes = F.pad(fields.codes, (0, 0, 0, pad))
    tiles, k = codes.shape[0] // TILE, codes.shape[1]
    blocks = k // inputs
    # the codes by tile, row, block, sub-block of 32 and input
    by_sub = codes.view(tiles, TILE, blocks, inputs // 32, 32)
    parts = [_per_row(F.pad(fields.d, (0, 0, 0, pad)).view(torch.uint8).view(tiles * TILE, blocks, 2), tiles)]
    if fields.low is not None:
        parts.append(_per_row(F.pad(fields.low, (0, 0, 0, pad)).view(torch.uint8).view(tiles * TILE, blocks, 2), tiles))
    if fields.scales is not None:
        padded = F.pad(fields.scales.view(torch.uint8), (0, 0, 0, 0, 0, pad)).view(tiles, TILE, blocks, -1)
        if fields.format == Q.Q6_K:  # a byte per row and half sub-block: [half][row]
            parts.append(padded.permute(0, 2, 3, 1).reshape(tiles, blocks, -1))
        else:  # the file's 12 bytes a row, as 3 words: [word][row]
            parts.append(padded.view(tiles, TILE, blocks, 3, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, -1))
    if fields.format in _FIFTH:
        parts.append(_fifth_bit_words(by_sub))
    elif fields.format == Q.Q6_K:
        parts.append(_high_pair_words(by_sub))
    parts.append(_byte_quads(by_sub) if bits == 8 else _nibble_units(by_sub))
    layout = torch.cat([p.reshape(tiles, blocks, -1) for p in parts], dim=-1)
    assert layout.shape[-1] == block_bytes, (fields.format, layout.shape)
    return layout


def _per_row(values: torch.Tensor, tiles: int) -> torch.Tensor:
    """A field of a few bytes per row and block [rows, blocks, size] -> [tiles, blocks, 16 rows * size]."""
    size = values.shape[-1]
    return values.view(tiles, TILE, -1, size).transpose(1, 2).reshape(tiles, -1, TILE * size)


def _units(per_input_bytes: torch.Tensor) -> torch.Tensor:
    """Bytes [tiles, 16 rows, blocks, subs, units * 4] -> [tiles, blocks, subs, unit, row, 4]: a unit of every row
    in one run of 64 bytes."""
    t, rows, blocks, subs, width = per_input_bytes.shape
    return per_input_bytes.view(t, rows, blocks, subs, width // 4, 4).permute(0, 2, 3, 4, 1, 5)


def _nibble_units(by_sub: torch.Tensor) -> torch.Tensor:
    """Input t's code in the low nibble of byte t, t + 16's in its high one, as GGUF's 4-bit blocks pair them."""
    low4 = by_sub & 15
    return _units(low4[..., :16] | (low4[..., 16:] << 4))


def _byte_quads(by_sub: torch.Tensor) -> torch.Tensor:
    return _units(by_sub)


def _fifth_bit_words(by_sub: torch.Tensor) -> torch.Tensor:
    """A 32-bit word per row and sub-block: byte b's bit u is input 4u + b's fifth bit, bit 4 + u input 16 + 4u + b's
    (c/legacy_quants.h: a shift and a mask put each in place)."""
    fifth = ((by_sub >> 4) & 1).view(*by_sub.shape[:-1], 2, 4, 4)  # [half, u, b]
    weights = (torch.arange(4, dtype=torch.uint8)[:, None] + torch.tensor([0, 4], dtype=torch.uint8)).T  # [half, u]
    word = (fifth << weights[..., None]).sum(dim=(-3, -2), dtype=torch.uint8)  # [b]
    return _units(word)


def _high_pair_words(by_sub: torch.Tensor) -> torch.Tensor:
    """Q6_K's two high bits: per row and sub-block, two words (units 0-1, units 2-3); byte b of a word holds the
    first unit's input 4u + b in bits 0-1, the second's in 2-3, their inputs 16 + 4u + b in 4-5 and 6-7."""
    high = ((by_sub >> 4) & 3).view(*by_sub.shape[:-1], 2, 2, 2, 4)  # [half, word, unit of the pair, b]
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8)  # [half, unit of the pair]
    words = (high << shifts[:, None, :, None]).sum(dim=(-4, -2), dtype=torch.uint8)  # [word, b]
    return _units(words.flatten(-2))
