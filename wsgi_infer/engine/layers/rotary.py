"""Rotary position embeddings, with frequencies from transformers' RoPE registry.

Using ``ROPE_INIT_FUNCTIONS`` keeps every static RoPE variant transformers knows
(default, linear, llama3, yarn, longrope...) correct without re-deriving them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..kernels.cpu import CpuKernels


class RotaryEmbedding(nn.Module):
    def __init__(self, config, max_positions: int, layer_type: str | None = None) -> None:
        """``layer_type``: the kind of layer whose parameters to take, where a config has one set per kind
        (Gemma 3: ``rope_parameters["sliding_attention"]`` and ``["full_attention"]``)."""
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        params = params[layer_type] if layer_type else params
        rope_type = params.get("rope_type", "default")
        kind = {"layer_type": layer_type} if layer_type else {}
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(config, params["rope_theta"])
        elif rope_type in ROPE_INIT_FUNCTIONS and rope_type != "dynamic":
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.get_default_device(), **kind)
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        # Over the whole head, with rotate-half's sign folded into sin (see apply_rotary_).
        # Plain attributes, not buffers, so casting the model to bf16 leaves these
        # small tables in float32, where exactness at long positions is kept.
        self.cos = torch.cat((cos, cos), dim=-1)
        self.sin = torch.cat((-sin, sin), dim=-1)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for these positions, [T, 1, D]: looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: CpuKernels | None = None) -> None:
    """Rotate x [T, heads, D] (half-split layout, as transformers) in place, computing in float32.

    ``x * cos + rotate_half(x) * sin`` with rotate_half's negation in the table: rolling the halves
    is one op, and each product rounds as transformers' does (negation is exact), in 5 ops, not 9.
    In place, so the rotated keys stay beside the values in the projection's output.
    """
    if kernels is not None:
        return kernels.rotate_(x, cos, sin)
    rotated = x.float()
    x.copy_(rotated * cos + rotated.roll(x.shape[-1] // 2, dims=-1) * sin)


def _default_inv_freq(config, base: float) -> tuple[torch.Tensor, float]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
