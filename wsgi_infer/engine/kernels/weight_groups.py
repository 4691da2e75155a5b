"""Weights in groups of 32 inputs, each group with its own scale (and offset): the packed formats.

Two formats cover every GGUF block type (``gguf_blocks``) and quantize float weights:
- ``Int4Groups``: 4-bit codes, the layout of GGUF's Q4_0/Q4_1 blocks (Q4_K maps onto it);
- ``Int8Groups``: 8-bit codes, GGUF's Q8_0 with an optional offset per group (Q5_0, Q5_1, Q5_K, IQ4_NL and
  IQ4_XS map onto it exactly or to a float16 rounding of their scales; other types, and 16- and 32-bit weights,
  are quantized from their values, with offsets).
A group's scale and offset are float16 values (a GGUF's blocks store theirs in float16), which the CPU kernels
read in half precision.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

GROUP_SIZE = 32  # GGUF's block size, and one of the group sizes of torch's int4 kernel


def as_half_values(t: torch.Tensor) -> torch.Tensor:
    """float32 values that float16 holds exactly (rounded to nearest)."""
    return t.half().float()


@dataclass
class Int4Groups:
    """A weight as 4-bit codes: ``w = q * scale + low`` per group of 32 inputs.

    codes: uint8 [out, in // 2], as GGUF's 4-bit blocks hold them: byte i of a group has input i's code
    in its low nibble and input i + 16's in its high one; scale, low: float32 [out, in // 32] holding float16
    values, as a GGUF's blocks store them (so a converted copy keeps them in float16, losing nothing).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int4Groups:
        """Asymmetric min/max codes per group, as GGUF's Q4_1 makes them: scale and minimum in float16."""
        q, scale, low = _by_rows(weight, _int4_rows)
        return cls.from_codes(q, scale, low)

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> Int4Groups:
        """From codes one per input (uint8 [out, in], 0..15) and ``w = q * scale + low`` per group."""
        halves = q.view(q.shape[0], -1, GROUP_SIZE)
        codes = halves[..., : GROUP_SIZE // 2] | (halves[..., GROUP_SIZE // 2 :] << 4)
        return cls(codes.reshape(q.shape[0], -1), scale, low)

    @classmethod
    def cat(cls, parts: list[Int4Groups]) -> Int4Groups:
        """Groups of a fused weight (rows stacked), from its parts'."""
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "low")))

    @property
    def zero(self) -> torch.Tensor:
        """torch's convention, ``w = (q - 8) * scale + zero``."""
        return self.low + 8 * self.scale

    @property
    def q(self) -> torch.Tensor:
        """The codes one per input: uint8 [out, in], 0..15."""
        halves = self.codes.view(self.codes.shape[0], -1, GROUP_SIZE // 2)
        return torch.cat([halves & 15, halves >> 4], dim=-1).view(self.codes.shape[0], -1)

    def dequantize(self) -> torch.Tensor:
        scale, low = (t.repeat_interleave(GROUP_SIZE, dim=1) for t in (self.scale, self.low))
        return self.q.float() * scale + low  # gguf-py's Q4_1 arithmetic (d * q + m); Q4_0's d * (q - 8) exactly

    def as_int8(self) -> Int8Groups:
        """The same values as 8-bit groups (codes 0..15, the same scales and lows): exact."""
        return Int8Groups(self.q.to(torch.int8), self.scale, self.low)


@dataclass
class Int8Groups:
    """A weight as 8-bit codes: ``w = q * scale + low`` per group of 32 inputs (``low`` None: no offset).

    codes: int8 [out, in]; scale, low: float32 [out, in // 32] holding float16 values.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int8Groups:
        """Codes -127..127 about the middle of each group's range, as Q8_0 makes them about zero: the float16 offset
        (2 more bytes per 32 weights) halves the error where a group's values are not centred on zero (top-1
        agreement of a 135M model: 97.3% symmetric, 99.0% with offsets). The scale spans the range about the
        offset as rounded, so no code is clipped; each code is rounded against the float16 scale and offset it
        will be multiplied by."""
        return cls(*_by_rows(weight, _int8_rows))

    @classmethod
    def cat(cls, parts: list[Int8Groups]) -> Int8Groups:
        """Groups of a fused weight (rows stacked), from its parts'; an offset where any part has one."""
        lows = None
        if any(p.low is not None for p in parts):
            lows = torch.cat([p.low if p.low is not None else torch.zeros_like(p.scale) for p in parts])
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), lows)

    def dequantize(self) -> torch.Tensor:
        w = self.codes.float() * self.scale.repeat_interleave(GROUP_SIZE, dim=1)
        return w if self.low is None else w + self.low.repeat_interleave(GROUP_SIZE, dim=1)


WeightGroups = Int4Groups | Int8Groups


def group_tensors(groups: WeightGroups) -> tuple[torch.Tensor | None, ...]:
    """The groups' tensors in field order, as they are (``dataclasses.astuple`` deep-copies every tensor: 60 ms of
    a 135M model's load, and a copy of each weight while a GGUF converts)."""
    return tuple(getattr(groups, f.name) for f in fields(groups))


ROWS_AT_ONCE = 2048  # a chunk's float32 temporaries stay a few MB (a 49152-row LM head's took 350 MB at once)


def _by_rows(weight: torch.Tensor, make) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make`` (float32 groups [rows, in // 32, 32] -> codes [rows, in], scale, low) over chunks of rows."""
    parts = [
        make(weight[start : start + ROWS_AT_ONCE].float().view(-1, weight.shape[1] // GROUP_SIZE, GROUP_SIZE))
        for start in range(0, weight.shape[0], ROWS_AT_ONCE)
    ]
    return tuple(torch.cat(fields) for fields in zip(*parts))


def _int4_rows(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    low = as_half_values(groups.amin(-1))
    scale = as_half_values((groups.amax(-1) - low) / 15)
    steps = (groups - low[..., None]) / scale.clamp(min=2**-24)[..., None]  # scale 0 (a constant group): any code
    return steps.round_().clamp_(0, 15).to(torch.uint8).view(groups.shape[0], -1), scale, low


def _int8_rows(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lowest, highest = groups.amin(-1), groups.amax(-1)
    low = as_half_values((lowest + highest) / 2)
    scale = as_half_values(torch.maximum(highest - low, low - lowest) / 127)
    steps = (groups - low[..., None]) / scale.clamp(min=2**-24)[..., None]  # scale 0 (a constant group): any code
    return steps.round_().clamp_(-127, 127).to(torch.int8).view(groups.shape[0], -1), scale, low


def cat_groups(parts: list[WeightGroups]) -> WeightGroups:
    """A fused weight's groups from its parts': 4-bit where all parts are, else 8-bit (exactly, for 4-bit parts)."""
    if all(isinstance(p, Int4Groups) for p in parts):
        return Int4Groups.cat(parts)
    return Int8Groups.cat([p.as_int8() if isinstance(p, Int4Groups) else p for p in parts])
