"""wsgi-infer: an LLM inference server with a paged-KV continuous-batching engine.

``engine/`` is the model-facing side (no gevent, Flask or gunicorn), ``server/``
the HTTP side; ``LLM`` (offline generation) and the ``wsgi-infer`` command sit
here. Names are imported lazily, so the gunicorn master can import the
server's hooks without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": ".llm",
    "LLMEngine": ".engine.llm_engine",
    "EngineConfig": ".engine.config",
    "SamplingParams": ".engine.sampling_params",
    "CompletionOutput": ".engine.outputs",
    "RequestDelta": ".engine.outputs",
    "TokenLogprob": ".engine.outputs",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .engine.config import EngineConfig as EngineConfig
    from .engine.llm_engine import LLMEngine as LLMEngine
    from .engine.outputs import CompletionOutput as CompletionOutput
    from .engine.outputs import RequestDelta as RequestDelta
    from .engine.outputs import TokenLogprob as TokenLogprob
    from .engine.sampling_params import SamplingParams as SamplingParams
    from .llm import LLM as LLM


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
