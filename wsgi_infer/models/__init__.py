"""Model definitions, looked up by the checkpoint's ``model_type``."""
from __future__ import annotations

from torch import nn

from .gpt2 import GPT2LMHeadModel
from .llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
}


def model_class_for(model_type: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
