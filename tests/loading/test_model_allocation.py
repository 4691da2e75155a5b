"""A model is built on a loader thread while the engine thread serves others: what building it sets must hold for
its own thread alone. torch's default dtype is the process's; set to bfloat16 while a GGUF's names were read, it
made the engine thread's own tensors bfloat16, which its kernels overran (a worker killed by heap corruption, or
hung, in 1 of 4 first loads of Gemma 3 beside a stream: the loading probe)."""

from __future__ import annotations

import threading

import torch
from torch import nn

from wsgi_infer.engine import models
from wsgi_infer.engine.models import allocate_model

from ..conftest import _tiny_config


class _Seen(nn.Module):
    """A model whose construction looks at the default dtype from another thread, as the engine thread would."""

    seen: list[torch.dtype] = []

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        other = threading.Thread(target=lambda: self.seen.append(torch.get_default_dtype()))
        other.start()
        other.join()


def test_building_a_model_leaves_other_threads_default_dtype_alone(monkeypatch):
    config = _tiny_config("llama", 64)
    monkeypatch.setitem(models.MODEL_REGISTRY, "llama", _Seen)
    built = allocate_model(config, torch.device("cpu"), torch.bfloat16)
    assert built.proj.weight.dtype == torch.bfloat16 and _Seen.seen == [torch.float32]


def test_a_real_models_parameters_are_allocated_in_the_target_dtype():
    config = _tiny_config("gemma3", 64)
    for dtype in (torch.bfloat16, torch.float16):
        built = allocate_model(config, torch.device("cpu"), dtype)
        assert {p.dtype for p in built.parameters()} == {dtype}
    assert torch.get_default_dtype() == torch.float32
