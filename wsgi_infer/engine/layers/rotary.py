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
    """cos and sin tables, grown as positions need them (doubling, up to ``max_positions``): a 131,072-position
    window's tables would hold 134 MB that a context clamped to the KV cache never reads."""

    FIRST_POSITIONS = 4096

    def __init__(self, config, max_positions: int, layer_type: str | None = None) -> None:
        """``layer_type``: the kind of layer whose parameters to take, where a config has one set per kind
        (Gemma 3: ``rope_parameters["sliding_attention"]`` and ``["full_attention"]``)."""
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        params = params[layer_type] if layer_type else params
        rope_type = params.get("rope_type", "default")
        kind = {"layer_type": layer_type} if layer_type else {}
        device = torch.get_default_device()
        # (first position, inverse frequencies, scaling) for each stretch of positions
        if rope_type == "default":
            self._stretches = [(0, *_default_inv_freq(config, params))]
        elif rope_type == "longrope":  # short factors within the original context, long ones past it (as vLLM)
            init, original = ROPE_INIT_FUNCTIONS[rope_type], params["original_max_position_embeddings"]
            self._stretches = [
                (0, *init(config, device, **kind)),
                (original, *init(config, device, original + 1, **kind)),
            ]
        elif rope_type in ROPE_INIT_FUNCTIONS and rope_type != "dynamic":
            self._stretches = [(0, *ROPE_INIT_FUNCTIONS[rope_type](config, device, **kind))]
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        self.max_positions = max_positions
        self._build(min(max_positions, self.FIRST_POSITIONS))

    def _build(self, count: int) -> None:
        """Tables for positions 0 .. count - 1, over the rotated part of the head (all of it, or its first
        partial_rotary_factor), with rotate-half's sign folded into sin (see apply_rotary_). Plain attributes, not
        buffers, so casting the model to bf16 leaves them in float32, where exactness at long positions is kept."""
        ends = [start for start, _, _ in self._stretches[1:]] + [count]
        parts = [
            _tables(torch.arange(start, max(start, min(end, count)), dtype=torch.float32), inv_freq, scaling)
            for (start, inv_freq, scaling), end in zip(self._stretches, ends)
        ]
        cos, sin = (torch.cat(pair) for pair in zip(*parts))
        self.cos = torch.cat((cos, cos), dim=-1)
        self.sin = torch.cat((-sin, sin), dim=-1)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for these positions, [T, 1, D]: looked up once per step, used by every layer."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > len(self.cos):
            self._build(min(self.max_positions, max(needed, 2 * len(self.cos))))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: CpuKernels | None = None) -> None:
    """Rotate x [T, heads, D] (half-split layout, as transformers) in place, computing in float32.

    ``x * cos + rotate_half(x) * sin`` with rotate_half's negation in the table: rolling the halves
    is one op, and each product rounds as transformers' does (negation is exact), in 5 ops, not 9.
    In place, so the rotated keys stay beside the values in the projection's output.
    """
    if kernels is not None:
        return kernels.rotate_(x, cos, sin)
    part = x[..., : cos.shape[-1]]  # partial rotary (Phi-3/4): the rest of the head passes unrotated
    rotated = part.float()
    part.copy_(rotated * cos + rotated.roll(part.shape[-1] // 2, dims=-1) * sin)


def _tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(positions, inv_freq.float())
    return freqs.cos() * scaling, freqs.sin() * scaling


def _default_inv_freq(config, params: dict) -> tuple[torch.Tensor, float]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
