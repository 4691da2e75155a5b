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
    with torch.device(device), _Allocating(dtype):  # both modes hold for this thread alone
        return model_cls(hf_config, hf_config.max_position_embeddings)


class _Allocating(TorchFunctionMode):
    """Makes new parameters in ``dtype`` and leaves them as allocated: the checkpoint fills every one
    (``model_builder._load_weights``).

    A float tensor made without a dtype is made in ``dtype``, as ``torch.set_default_dtype`` would make it, but in
    this thread alone: that setting is the process's, and a model built on a loader thread beside a serving one
    made the engine thread's own tensors bfloat16, which its kernels overran (a worker killed by heap corruption).
    Random initialisation would cost 1.2 s for the default model, and building on the meta device instead imports
    dynamo (1 s, 60 MB), which runs the meta device's init functions.
    """

    FACTORIES = frozenset((torch.empty, torch.zeros, torch.ones))  # what modules' constructors allocate with

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self._dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        if func in self.FACTORIES and kwargs.get("dtype") is None:
            kwargs["dtype"] = self._dtype
        return func(*args, **kwargs)
