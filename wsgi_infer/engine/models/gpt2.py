"""GPT-2: learned positions, pre-LayerNorm, fused QKV (HF Conv1D layout), GELU (tanh) MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import AttentionMetadata, paged_attention
from ..runtime.step_interrupt import StepInterrupt

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim**-0.5
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1
        inner = config.n_inner or 4 * hidden
        self.ln_1 = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.c_fc = nn.Linear(hidden, inner)
        self.mlp_proj = nn.Linear(inner, hidden)
        self.act = _ACTIVATIONS[config.activation_function]

    def forward(self, x, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.c_attn(self.ln_1(x)).view(-1, 3 * self.num_heads, self.head_dim)  # query, key, value heads
        q, kv = qkv[:, : self.num_heads], qkv[:, self.num_heads :]
        x = x + self.c_proj(paged_attention(q, kv, kv_cache, meta, self.scale))
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        if config.activation_function not in _ACTIVATIONS:
            raise ValueError(f"unsupported GPT-2 activation_function {config.activation_function!r}")
        if config.reorder_and_upcast_attn:
            raise ValueError("GPT-2 with reorder_and_upcast_attn is not supported")
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.n_positions, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # GPT-2 always ties its LM head to the embedding
        self.max_positions = min(max_positions, config.n_positions)
        self.interrupt = StepInterrupt()  # see LLMEngine.interrupt

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            self.interrupt.check()
            x = block(x, kv_cache, meta)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_names(self, linear: str) -> list[str]:
        """None: GPT-2's checkpoints store its projections transposed (Conv1D), so no 4-bit rows map."""
        return []

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers ``GPT2LMHeadModel`` (Conv1D weights are [in, out])."""
        for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
            self.get_parameter(name).copy_(state[f"transformer.{name}"])
        ours_to_hf = {"c_attn": "attn.c_attn", "c_proj": "attn.c_proj", "c_fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}
        for i, block in enumerate(self.h):
            p = f"transformer.h.{i}."
            for ours, hf in ours_to_hf.items():
                linear = getattr(block, ours)
                linear.weight.copy_(state[f"{p}{hf}.weight"].t())
                linear.bias.copy_(state[f"{p}{hf}.bias"])
            for norm in ("ln_1", "ln_2"):
                getattr(block, norm).weight.copy_(state[f"{p}{norm}.weight"])
                getattr(block, norm).bias.copy_(state[f"{p}{norm}.bias"])
