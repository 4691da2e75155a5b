"""Model definitions, looked up by the checkpoint's ``model_type``, and allocated for a checkpoint to fill."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

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


def model_class(model_type: str) -> type[nn.Module]:
    """Our module for a checkpoint's ``model_type``; a ValueError naming the ones we serve for any other."""
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        served = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported architecture {model_type!r} (expected one of: {served})") from None


def allocate_model(hf_config, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Our module for the architecture, in the target dtype, its parameters allocated but not written."""
    model_cls = model_class(hf_config.model_type)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: no float32 copy of the weights
    try:
        with torch.device(device), _SkipParameterInit():
            return model_cls(hf_config, hf_config.max_position_embeddings)
    finally:
        torch.set_default_dtype(default_dtype)


class _SkipParameterInit(TorchFunctionMode):
    """Leaves new parameters as allocated: the checkpoint fills every one (``model_builder._load_weights``).

    Random initialisation would cost 1.2 s for the default model, and building on the meta device
    instead imports dynamo (1 s, 60 MB), which runs the meta device's init functions.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))
