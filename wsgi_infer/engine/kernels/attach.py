"""The CPU kernels handed to a model's layers: those with a fused path take them where their shapes allow."""

from __future__ import annotations

from torch import nn

from .cpu import CpuKernels


def attention_fits(head_dim: int) -> bool:
    """Attention reads heads 16 values at a time: a head size that is no multiple of 16 keeps torch's ops."""
    return head_dim % 16 == 0


def attach_kernels(model: nn.Module, kernels: CpuKernels | None) -> None:
    """Hand the kernels to every layer of ``model`` that has a fused path (a ``kernels`` attribute); those
    that attend (a ``head_dim``) only where ``attention_fits``."""
    for module in model.modules():
        if hasattr(type(module), "kernels"):
            module.kernels = kernels if attention_fits(getattr(module, "head_dim", 16)) else None
