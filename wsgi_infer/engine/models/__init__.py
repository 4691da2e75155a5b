"""Model definitions, looked up by the checkpoint's ``model_type``."""

from __future__ import annotations

from torch import nn

from .gemma3 import Gemma3ForCausalLM
from .gpt2 import GPT2LMHeadModel
from .llama import LlamaForCausalLM
from .phi3 import Phi3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "smollm3": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "phi3": Phi3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}
