"""A GGUF tensor's blocks as the packed formats' groups of 32 (``kernels.weight_groups``), where they map.

gguf-py dequantizes every block type; this module reads each block's scales, and takes the codes from gguf-py's
values (``(value - low) / scale`` is an integer, exactly) wherever they are packed in bits, so those layouts are
gguf-py's alone; where a block's codes are whole bytes, it takes the bytes. Per type:
- Q4_0, Q4_1: int4 groups, byte for byte, ``w = q * d + m`` (Q4_0's m is -8d); Q8_0: int8 groups,
  byte for byte (checking its codes against the values took 0.45 s of the default model's conversion). These
  need no values, and their groups give gguf-py's values bit for bit (``BYTE_TYPES``);
- Q4_K: int4 groups, the codes from its bits; each 32-weight sub-block's 6-bit scale and min under the
  super-block's ``d`` and ``dmin`` give ``scale = d * sc`` and ``low = -dmin * m``, rounded to float16 (2^-11 of
  each, relative, at most);
- Q5_0 (codes -16..15), Q5_1 (0..31 and an offset), IQ4_NL (codes from its table of 16 levels): int8 groups,
  exactly; Q5_K and IQ4_XS (``d * (ls - 32)``): int8 groups, scales rounded to float16 as for Q4_K;
- every other type (F32, F16, BF16, Q6_K's 16-weight sub-blocks, Q2_K, Q3_K, ...): None, and the conversion makes
  8-bit groups from its values (``gguf_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as Q

from ..kernels.weight_groups import GROUP_SIZE, Int4Groups, Int8Groups, WeightGroups, as_half_values, group_tensors

_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34, Q.Q5_0: 22, Q.Q5_1: 24, Q.IQ4_NL: 18, Q.Q4_K: 144, Q.Q5_K: 176}
_BLOCK_BYTES[Q.IQ4_XS] = 136
_SUB_BLOCKS = 8  # groups of 32 in a K-quant's super-block of 256
MAPPED_TYPES = frozenset(_BLOCK_BYTES)
BYTE_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q8_0})  # codes are the blocks' own bytes: gguf-py's values exactly
ROUNDED_TYPES = frozenset({Q.Q4_K, Q.Q5_K, Q.IQ4_XS})  # scales rounded to float16: never the values bit for bit
CHUNK_ROWS = 8192


def groups_from_blocks(raw: torch.Tensor, ggml_type: Q, values: Callable[[], torch.Tensor]) -> WeightGroups | None:
    """The groups of a 2-D tensor's blocks (uint8 [rows, bytes]), given a way to gguf-py's values of them (float32
    [rows, in]), called only for types outside ``BYTE_TYPES``; None where its type does not map. ValueError where
    the values are not what the scales say."""
    if ggml_type not in MAPPED_TYPES:
        return None
    blocks = _blocks(raw, ggml_type)
    if ggml_type in (Q.Q4_0, Q.Q4_1):
        d, m = _q4_scale_and_min(blocks, ggml_type)
        return Int4Groups(blocks[..., 4 if ggml_type == Q.Q4_1 else 2 :].reshape(raw.shape[0], -1), d, m)
    if ggml_type == Q.Q8_0:  # the codes are the block's 32 signed bytes after its scale
        return Int8Groups(blocks[..., 2:].reshape(raw.shape[0], -1).view(torch.int8), _half(blocks, 0))
    scale, low = _scales(blocks, ggml_type)
    codes = _q4_k_codes(blocks) if ggml_type == Q.Q4_K else _codes(values(), scale, low)
    scale, low = as_half_values(scale), None if low is None else as_half_values(low)
    if not (scale.isfinite().all() and (low is None or low.isfinite().all())):
        return None  # a scale beyond float16's range: quantized from the values instead
    if ggml_type == Q.Q4_K:
        return Int4Groups.from_codes(codes.to(torch.uint8), scale, low)
    return Int8Groups(codes.to(torch.int8), scale, low)


def dequantize_to(groups: WeightGroups, values: torch.Tensor) -> bool:
    """Whether ``groups`` dequantize to ``values`` [rows, in] bit for bit, compared ``CHUNK_ROWS`` rows at a time (an
    embedding's float temporaries would otherwise match the table's size)."""
    for start in range(0, values.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        chunk = type(groups)(*(None if t is None else t[rows] for t in group_tensors(groups)))
        if not torch.equal(chunk.dequantize(), values[rows]):
            return False
    return True


def _blocks(raw: torch.Tensor, ggml_type: Q) -> torch.Tensor:
    return raw.reshape(raw.shape[0], -1, _BLOCK_BYTES[ggml_type])


def _q4_scale_and_min(blocks: torch.Tensor, ggml_type: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0 or Q4_1 block's ``d`` and minimum (Q4_0's codes are centred: ``-8d``), as float32 [rows, blocks]."""
    d = _half(blocks, 0)
    return d, _half(blocks, 2) if ggml_type == Q.Q4_1 else -8 * d


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Each block's float16 field at byte ``at``, as float32 [rows, blocks]."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()


def _scales(blocks: torch.Tensor, ggml_type: Q) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each group's scale and low (None: none), float32 [rows, groups], exact: where a super-block's ``d``
    multiplies a sub-block's scale, the product of an 11-bit and a 6-bit significand."""
    rows = blocks.shape[0]
    d = _half(blocks, 0)
    if ggml_type in (Q.Q5_0, Q.IQ4_NL):
        return d, None
    if ggml_type == Q.Q5_1:
        return d, _half(blocks, 2)
    if ggml_type == Q.IQ4_XS:
        high = blocks[..., 2:4].contiguous().view(torch.int16)[..., 0].to(torch.int32) & 0xFFFF
        low_bits = blocks[..., 4:8].to(torch.int32).repeat_interleave(2, dim=-1)  # sub-block i: byte i // 2
        nibble = torch.arange(_SUB_BLOCKS) % 2 * 4
        ls = (low_bits >> nibble) & 0xF | ((high[..., None] >> (2 * torch.arange(_SUB_BLOCKS))) & 3) << 4
        return (d[..., None] * (ls - 32)).view(rows, -1), None
    sc, m = _k_scales(blocks[..., 4:16])  # Q4_K, Q5_K
    return (d[..., None] * sc).view(rows, -1), (-_half(blocks, 2)[..., None] * m).view(rows, -1)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 sub-blocks' 6-bit scales and mins from a K-quant's 12 bytes (ggml's ``get_scale_min_k4``)."""
    p = packed.to(torch.int32)
    sc = torch.cat([p[..., :4] & 63, (p[..., 8:12] & 0xF) | ((p[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)], dim=-1)
    return sc.float(), m.float()


def _q4_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """A Q4_K tensor's codes one per input (uint8 [rows, in]), from its blocks' bits: each 32 bytes of a super-block's
    ``qs`` hold two sub-blocks, the first in their low nibbles, the second in their high ones (ggml's and gguf-py's
    layout). Taken from the values instead, as the other types' are, they cost a 1B model's conversion 20 s."""
    qs = blocks[..., 16:].reshape(blocks.shape[0], blocks.shape[1], _SUB_BLOCKS // 2, 1, GROUP_SIZE)
    return (qs >> torch.tensor([0, 4], dtype=torch.uint8)[:, None] & 15).reshape(blocks.shape[0], -1)


def _codes(values: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
    """The integer codes (int16) of values [rows, in] under each group's exact scale and low, ``CHUNK_ROWS`` rows
    at a time: an embedding's float temporaries (Gemma 3's 262,144 rows: 671 MB each) took 2.9 GB at once."""
    smallest, largest = torch.aminmax(values)
    atol = 1e-6 * max(-smallest.item(), largest.item())
    codes = torch.empty(values.shape, dtype=torch.int16)
    for start in range(0, values.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        groups = values[rows].view(-1, values.shape[1] // GROUP_SIZE, GROUP_SIZE)
        s, lo = scale[rows, :, None], None if low is None else low[rows, :, None]
        chunk = torch.where(s == 0, 0, (groups if lo is None else groups - lo) / s).round()
        rebuilt = chunk * s + (0 if lo is None else lo)
        if not torch.allclose(rebuilt, groups, rtol=2**-20, atol=atol):
            raise ValueError("its blocks' values do not match their scales")
        codes[rows] = chunk.view(-1, values.shape[1])
    return codes
