"""Gated activations of the fused gate-up projection's output: SwiGLU's silu(gate) * up, GeGLU's gelu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import CpuKernels


class SiluAndMul(nn.Module):
    kernels: CpuKernels | None = None  # see kernels.cpu.attach_kernels

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up (Gemma's MLP)."""

    kernels: CpuKernels | None = None  # see kernels.cpu.attach_kernels

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.gelu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}  # by the config's activation
