"""wsgi-infer: an LLM inference server with a paged-KV continuous-batching engine.

Names are imported lazily, so the gunicorn master can import the package's
hooks without importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": ".llm",
    "LLMEngine": ".llm_engine",
    "EngineConfig": ".config",
    "SamplingParams": ".sampling_params",
    "CompletionOutput": ".outputs",
    "RequestDelta": ".outputs",
    "TokenLogprob": ".outputs",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .config import EngineConfig
    from .llm import LLM
    from .llm_engine import LLMEngine
    from .outputs import CompletionOutput, RequestDelta, TokenLogprob
    from .sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
