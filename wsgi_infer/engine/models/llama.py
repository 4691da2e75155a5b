"""The Llama family (Llama 2 and 3.x, SmolLM 1-3, Qwen2 and 3, Mistral): RMSNorm, RoPE, GQA, SwiGLU.

Projections are fused (QKV, gate-up) so a layer runs four matrix multiplies. What the members add: Qwen2's
QKV biases, Qwen3's per-head RMSNorm of queries and keys before RoPE, SmolLM3's layers without RoPE
(``no_rope_layers``), Llama 3's RoPE frequency scaling (``rotary``, from transformers' registry).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.cpu import CpuKernels
from ..kernels.fused_decoder import DecoderDims, DecoderWeights, FusedDecoder
from ..layers.activation import GatedActivation
from ..layers.attention import AttentionMetadata, paged_attention
from ..layers.norm import RMSNorm, rms_norm
from ..layers.quantization import PackedLinear
from ..layers.rotary import RotaryEmbedding, apply_rotary_
from ..runtime.step_interrupt import StepInterrupt

HEAD_NORM_TYPES = {"qwen3", "gemma3_text"}  # architectures that RMSNorm each query and key head before RoPE


def layer_window(config, index: int) -> int:
    """Layer ``index``'s sliding window (tokens), or 0: it attends to the whole context. Without ``layer_types``
    (Mistral, Phi-3), a ``sliding_window`` is every layer's, as transformers reads it."""
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        sliding = getattr(config, "use_sliding_window", True)
    else:
        sliding = kinds[index] == "sliding_attention"
    return (getattr(config, "sliding_window", None) or 0) if sliding else 0


class LlamaAttention(nn.Module):
    kernels: CpuKernels | None = None  # see kernels.cpu.attach_kernels

    def __init__(self, config, index: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.q_norm = self.k_norm = None
        if config.model_type in HEAD_NORM_TYPES:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rope = bool((getattr(config, "no_rope_layers", None) or [1] * (index + 1))[index])
        self.window = layer_window(config, index)

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(x.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            self._norm_heads(qkv)
        # Queries and keys are rotated together, in place: one set of elementwise ops per layer,
        # and the keys and values stay side by side for the cache.
        if self.rope:
            apply_rotary_(qkv[:, : self.num_heads + self.num_kv_heads], *rope, self.kernels)
        q, kv = qkv[:, : self.num_heads], qkv[:, self.num_heads :]
        return self.o_proj(paged_attention(q, kv, kv_cache, meta, self.scale, self.kernels, self.window))

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """Each query and key head through its RMSNorm, in place, before RoPE (Qwen3)."""
        heads, kv_heads, eps = self.num_heads, self.num_kv_heads, self.q_norm.eps
        if self.kernels is not None:
            return self.kernels.head_norm_(qkv, heads, kv_heads, self.q_norm.weight, self.k_norm.weight, eps)
        for norm, part in ((self.q_norm, qkv[:, :heads]), (self.k_norm, qkv[:, heads : heads + kv_heads])):
            part.copy_(rms_norm(part, norm.weight, eps))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = GatedActivation(getattr(config, "hidden_activation", None) or config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, index)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, residual, rope, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: what the layer before added (at the first layer, the embeddings), residual: the sum before it
        (None at the first). Returns this layer's output and the sum before it, which the next norm adds."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta), residual)
        return self.mlp(h), residual


# Our fused projections, and the checkpoint's weights stacked into each, in row order.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class LlamaForCausalLM(nn.Module):
    layer_class: type[nn.Module] = LlamaDecoderLayer
    fused_projections = FUSED_PROJECTIONS  # the checkpoint's weights in each of ours (Phi-3 fuses them itself)
    runs_on_kernels = True  # its layers have the CPU kernels' paths (see kernels.cpu.attach_kernels)
    _kernels: CpuKernels | None = None
    fused_decoder: FusedDecoder | None = None  # with the kernels, when every projection is packed on them too

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied_embeddings = config.tie_word_embeddings
        if self.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = self._rotary(config, max_positions)
        self.head_dim = self.layers[0].self_attn.head_dim  # attach_kernels reads it
        self.layer_windows = [layer.self_attn.window for layer in self.layers]  # the KV cache's groups
        self.sliding_window = max(self.layer_windows)  # the runner's masks
        self.max_positions = max_positions
        self.interrupt = StepInterrupt()  # see LLMEngine.interrupt

    @property
    def kernels(self) -> CpuKernels | None:  # see kernels.cpu.attach_kernels
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: CpuKernels | None) -> None:
        self._kernels = kernels
        self.fused_decoder = self._fuse(kernels) if kernels is not None else None

    @staticmethod
    def _rotary(config, max_positions: int) -> nn.Module:
        return RotaryEmbedding(config, max_positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        rope = self.rotary(positions)
        if self.fused_decoder is not None and meta.cache_rows is not None:
            x = self.fused_decoder(x, self.fused_tables(rope), kv_caches, meta, self.interrupt.address)
            self.interrupt.check()
            return x
        for layer, kv_cache in zip(self.layers, kv_caches):
            self.interrupt.check()
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.norm(x, residual)[0]

    @staticmethod
    def fused_tables(rope) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's RoPE tables as the fused decoder takes them: one pair here."""
        return [rope]

    def _fuse(self, kernels: CpuKernels) -> FusedDecoder | None:
        """The kernels' decoder: the layers' loop in one call, where every projection is packed on the kernels."""
        weights = [self._decoder_weights(layer) for layer in self.layers]
        projections = [p for w in weights for p in (w.qkv, w.o, w.gate_up, w.down)]
        if not all(isinstance(p, PackedLinear) for p in projections):
            return None
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        dims = DecoderDims(
            hidden=self.norm.weight.shape[0],
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate=mlp.down_proj.in_features,
            eps=self.norm.eps,
            scale=attn.scale,
        )
        return kernels.fused_decoder(weights, dims, self.norm.weight)

    @staticmethod
    def _decoder_weights(layer: nn.Module) -> DecoderWeights:
        """A layer as the fused decoder reads it."""
        attn, mlp = layer.self_attn, layer.mlp
        head_norms = (attn.q_norm and attn.q_norm.weight, attn.k_norm and attn.k_norm.weight)
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return DecoderWeights(*norms, *projections, *head_norms, attn.rope, attn.window)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_names(self, linear: str) -> list[str]:
        """The checkpoint weights our linear layer ``linear`` (a module name) stacks, in row order."""
        if linear == "lm_head":
            return ["model.embed_tokens.weight" if self.tied_embeddings else "lm_head.weight"]
        parent, _, name = linear.rpartition(".")
        return [f"model.{parent}.{part}.weight" for part in self.fused_projections.get(name, (name,))]

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers ``*ForCausalLM`` state dict, fusing projections."""
        if isinstance(self.embed_tokens, nn.Embedding):  # else rows of the packed LM head, not read at all
            self.embed_tokens.weight.copy_(state["model.embed_tokens.weight"])
        self.norm.weight.copy_(state["model.norm.weight"])
        if not self.tied_embeddings and self.lm_head.weight is not None:  # None: packed from the checkpoint
            self.lm_head.weight.copy_(state["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for ours in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                parent, _, name = ours.rpartition(".")
                for suffix in ("weight", "bias"):
                    # None: no bias, or a weight packed from the checkpoint's 4-bit blocks (not read at all)
                    target = getattr(layer.get_submodule(ours), suffix)
                    parts = [f"{p}{parent}.{part}.{suffix}" for part in self.fused_projections.get(name, (name,))]
                    if target is not None and parts[0] in state:
                        target.copy_(torch.cat([state[part] for part in parts]))
            layer.input_layernorm.weight.copy_(state[f"{p}input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(state[f"{p}post_attention_layernorm.weight"])
            for name in ("q_norm", "k_norm"):
                if getattr(layer.self_attn, name) is not None:
                    getattr(layer.self_attn, name).weight.copy_(state[f"{p}self_attn.{name}.weight"])
