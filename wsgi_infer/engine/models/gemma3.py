"""Gemma 3's text decoder (``gemma3_text``): the Llama layer with Gemma's differences.

- RMSNorm scales by ``1 + w``: the checkpoint's ``w`` is loaded as ``1 + w`` (in float32, as transformers adds
  it), so the norms, and their kernels, stay Llama's.
- Four norms per layer: after attention and after the MLP too, before each residual add.
- GeGLU (GELU, tanh approximation) instead of SwiGLU; queries scaled by ``query_pre_attn_scalar``.
- Embeddings scaled by the square root of the hidden size; the LM head tied to them.
- Per-head RMSNorm of queries and keys (as Qwen3), then RoPE with a base per kind of layer: sliding-window
  layers (5 of every 6) and global ones.

On the CPU kernels, steps run every layer in the fused decoder (its Gemma flags).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fused_decoder import DecoderWeights
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

SLIDING, GLOBAL = "sliding_attention", "full_attention"


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, index)
        self.mlp = LlamaMLP(config)
        names = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        for name in names:
            setattr(self, name, RMSNorm(config.hidden_size, eps=config.rms_norm_eps))
        self.kind = SLIDING if self.self_attn.window else GLOBAL

    def forward(self, x, residual, ropes, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer's: x is what the layer before added, residual the sum before it."""
        h, residual = self.input_layernorm(x, residual)
        attended = self.post_attention_layernorm(self.self_attn(h, ropes[self.kind], kv_cache, meta))[0]
        h, residual = self.pre_feedforward_layernorm(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual


class _RopePerKind(nn.Module):
    """Both kinds' cos and sin tables, looked up once per step: {kind: (cos, sin)}."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        kinds = set(config.layer_types)
        self.tables = {kind: RotaryEmbedding(config, max_positions, layer_type=kind) for kind in kinds}

    def forward(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: table(positions) for kind, table in self.tables.items()}


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config, max_positions: int) -> None:
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("gemma3_text: attention logit soft-capping is not supported")
        super().__init__(config, max_positions)
        self.embed_scale = config.hidden_size**0.5
        self.logit_cap = getattr(config, "final_logit_softcapping", None)

    @staticmethod
    def _rotary(config, max_positions: int) -> nn.Module:
        return _RopePerKind(config, max_positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)  # an nn.Embedding, or rows of the packed LM head
        return embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)

    @staticmethod
    def fused_tables(rope: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The global layers' tables, then the sliding-window layers' (``local_rope``)."""
        return [rope.get(GLOBAL, rope.get(SLIDING)), rope.get(SLIDING, rope.get(GLOBAL))]

    @staticmethod
    def _decoder_weights(layer: nn.Module) -> DecoderWeights:
        """The fused decoder's Llama slots, and Gemma's own: the MLP's input norm sits where Llama's second norm
        does; the norms of the attention's and the MLP's outputs, GeGLU and the RoPE per kind are flags."""
        attn, mlp = layer.self_attn, layer.mlp
        return DecoderWeights(
            layer.input_layernorm.weight,
            layer.pre_feedforward_layernorm.weight,
            *(attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj),
            q_norm=attn.q_norm.weight,
            k_norm=attn.k_norm.weight,
            window=attn.window,
            local_rope=layer.kind == SLIDING,
            gelu=True,
            attention_out_norm=layer.post_attention_layernorm.weight,
            mlp_out_norm=layer.post_feedforward_layernorm.weight,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.logit_cap:
            logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
        return logits

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_hf_state_dict(state)
        for i, layer in enumerate(self.layers):
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                getattr(layer, name).weight.copy_(state[f"model.layers.{i}.{name}.weight"])
        for norm in self.modules():
            if isinstance(norm, RMSNorm):  # Gemma scales by 1 + w
                norm.weight.copy_(1.0 + norm.weight.float())
