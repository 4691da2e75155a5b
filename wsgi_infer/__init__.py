"""wsgi-infer: an LLM inference server with a paged-KV continuous-batching engine."""
from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestDelta, TokenLogprob
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "CompletionOutput", "RequestDelta", "TokenLogprob"]
