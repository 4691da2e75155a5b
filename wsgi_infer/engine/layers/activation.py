"""Gated activations of the fused gate-up projection's output: act(gate) * up, with SiLU (SwiGLU) or GELU's tanh
approximation (Gemma's GeGLU), each as one kernel call where the CPU kernels serve."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import CpuKernels

# By the config's hidden_act (or hidden_activation): the torch function, and the kernel's name.
_GATED = {"silu": (F.silu, "silu_mul"), "gelu_pytorch_tanh": (partial(F.gelu, approximate="tanh"), "gelu_mul")}


class GatedActivation(nn.Module):
    kernels: CpuKernels | None = None  # see kernels.cpu.attach_kernels

    def __init__(self, activation: str) -> None:
        super().__init__()
        self._act, self._kernel = _GATED[activation]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return getattr(self.kernels, self._kernel)(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._act(gate) * up
