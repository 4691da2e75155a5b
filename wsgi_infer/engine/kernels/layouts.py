"""The packed formats' groups (``kernels.weight_groups``) laid out as the CPU kernels read them.

Both formats are tiles of 16 outputs: a tile's group of 32 inputs is one contiguous run of codes, with its 16
scales and lows beside in float16 (a GGUF stores its blocks' ``d`` and ``m`` in float16, so half precision holds
them exactly, in 20 bytes per 32 int4 weights where float32 took 24: one row over 30 layers, 13-14% less time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .weight_groups import Int4Groups, Int8Groups, WeightGroups


@dataclass
class KernelWeight:
    """A weight [n, k] as the kernels multiply it: ``bits`` 4 or 8; codes; float16 scale and low
    [n / 16, k / 32, 16] (low None: an int8 weight without offsets)."""

    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None

    @property
    def k(self) -> int:
        """The inputs: the groups of 32 the scales hold."""
        return self.scale.shape[1] * 32


def kernel_weight(groups: WeightGroups) -> KernelWeight:
    if isinstance(groups, Int4Groups):
        return KernelWeight(4, *int4_kernel_layout(groups.codes, groups.scale, groups.low))
    return KernelWeight(8, *int8_kernel_layout(groups))


def _by_tile(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Per-group values [n, k / 32] as [n / 16, k / 32, 16] float16, n padded to whole tiles."""
    t = F.pad(t.float(), (0, 0, 0, pad))
    return t.view(t.shape[0] // 16, 16, -1).transpose(1, 2).contiguous().half()


def int4_kernel_layout(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Int4 groups (``Int4Groups``: GGUF's block bytes [n, k / 2], ``w = q * scale + low``) as
    ``int4_mm`` reads them (n padded to a multiple of 16): codes [n / 16, k / 32, 8, 32], chunk c's byte j holding
    output j // 2's codes for inputs 2c + j % 2 (low nibble) and 2(c + 8) + j % 2 (high), which is that output's
    block byte 2c + j % 2; float16 scale and low (``w = q * scale + low``). So the codes are the blocks' byte
    pairs, transposed: no nibble moves."""
    pad = -codes.shape[0] % 16
    padded = F.pad(codes, (0, 0, 0, pad)) if pad else codes.contiguous()
    tiles, groups = padded.shape[0] // 16, padded.shape[1] // 16
    pairs = padded.view(torch.int16).view(tiles, 16, groups, 8).permute(0, 2, 3, 1)  # [tiles, groups, chunk, out]
    kernel_codes = pairs.contiguous().view(torch.uint8).view(tiles, groups, 8, 32)
    return kernel_codes, _by_tile(scale, pad), _by_tile(low, pad)


def int8_kernel_layout(groups: Int8Groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Int8 groups as ``int8_mm`` reads them, 16 outputs at a time and inputs in pairs (n padded to a multiple of
    16 with zeros): codes [n / 16, k / 2, 16, 2], each pair of inputs' 16 outputs in one run of 32 bytes, as
    vpmaddwd pairs them; float16 scale and low (or None)."""
    pad = -groups.codes.shape[0] % 16
    codes = F.pad(groups.codes, (0, 0, 0, pad)) if pad else groups.codes.contiguous()  # a pad of nothing copies
    # Each tile's [16, k / 2] input pairs transposed, as 16-bit elements: 2-3 times faster than moving byte pairs
    # (a 1B model's weights took 1.6 s so at every start).
    pairs = codes.view(torch.int16).view(-1, 16, codes.shape[1] // 2).transpose(1, 2).contiguous()
    codes = pairs.view(torch.int8).view(-1, codes.shape[1] // 2, 16, 2)
    low = None if groups.low is None else _by_tile(groups.low, pad)
    return codes, _by_tile(groups.scale, pad), low
