"""Weight-only int8 linear layers for small batches (CPU).

Decoding a few sequences is bound by reading weights: int8 halves the bytes of
bf16, and ``torch._weight_int8pack_mm`` multiplies bf16/float activations by
int8 weights with per-output-channel scales. Measured here on the default model
(ms per decode step, bf16 vs int8): batch 1: 20 vs 12; batch 16: 30 vs 37;
batch 64: 78 vs 118. Large batches are compute-bound, where oneDNN's bf16 GEMM
wins, so each layer keeps both weights and picks by the number of rows.
The default GGUF checkpoint is itself 4-bit, so int8 loses nothing it had.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT8_MAX_ROWS = 8  # steps with at most this many tokens use the int8 weights


class Int8Linear(nn.Module):
    """A linear layer with an extra int8 copy of its weight (symmetric, per output channel)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight_int8", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > INT8_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = torch._weight_int8pack_mm(rows, self.weight_int8, self.scale).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def quantize_linear_layers(model: nn.Module, method: str, device: torch.device) -> None:
    """Wrap every nn.Linear of ``model`` (the LM head included) in place."""
    if device.type != "cpu":
        raise ValueError(f"quantization {method!r} is implemented for the CPU only, not {device.type}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
