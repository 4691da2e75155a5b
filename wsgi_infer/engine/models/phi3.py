"""Phi-3 and Phi-4-mini (``phi3``): Llama's layer over checkpoints that fuse QKV and gate-up themselves, with a
partial rotary and LongRoPE (both in ``layers.rotary``; the kernels' rotate takes the rotated width)."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    fused_projections: dict[str, tuple[str, ...]] = {}  # the checkpoint's names are ours
