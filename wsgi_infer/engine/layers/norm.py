"""RMSNorm with the reference's precision: normalize in float32, scale in the model dtype.

torch's fused ``nn.RMSNorm`` rounds differently in bf16; on the default model
that alone flips near-tied greedy choices away from what transformers produces.
The residual add before each norm happens here too (as in vLLM), so the CPU
kernel can fuse both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import CpuKernels


class RMSNorm(nn.Module):
    kernels: CpuKernels | None = None  # see kernels.cpu.attach_kernels

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of x + residual, x + residual): the running sum the next layer adds to."""
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        return rms_norm(x, self.weight, self.eps), x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension as transformers rounds it: normalized in float32, scaled in x's dtype."""
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)
