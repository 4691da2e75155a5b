"""RMSNorm with the reference's precision: normalize in float32, scale in the model dtype.

torch's fused ``nn.RMSNorm`` rounds differently in bf16; on the default model
that alone flips near-tied greedy choices away from what transformers produces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype)
