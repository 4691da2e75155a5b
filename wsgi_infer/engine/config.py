"""Engine configuration: one dataclass, validated on construction.

Its fields that carry a ``help`` text are also the server's settings
(``WSGI_INFER_<NAME>``, generated in ``server/settings.py``), with the same
defaults and bounds: declared here once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

QUANTIZATION_METHODS = ("auto", "none", "int4", "int8")  # see layers.quantization
ACTIVATIONS = ("int16", "int8")  # see kernels/c/activations.h
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")  # and auto: see runtime/device.py
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
CPU_KV_CACHE_BYTES = 256 << 20  # the least KV cache a model gets on a CPU where none is set
CPU_KV_CACHE_TOKENS = 8192  # ... and room for this many tokens, where that takes more


def default_cpu_kv_bytes(token_bytes: int) -> int:
    """A model's KV cache on a CPU where none is set: 256 MiB, or room for 8,192 tokens where a token takes more
    than 32 KB (a Llama 3.2 3B's 112 KiB: 896 MiB). 256 MiB alone held 2,290 of the 3B's tokens: 16 streams of
    165 preempted each other, and its context was clamped below a 4k prompt. The cache is mapped, not written: its
    pages become resident as sequences fill them."""
    return max(CPU_KV_CACHE_BYTES, CPU_KV_CACHE_TOKENS * token_bytes)


def option(default: Any, help: str, ge: int | None = None) -> Any:
    """A field that is also a server setting: its help text, and its least value where it has one."""
    return field(default=default, metadata={"help": help, **({"ge": ge} if ge is not None else {})})


class SettingError(ValueError):
    """A setting this machine or model cannot take (CUDA asked for where there is none, a block larger than the KV
    cache): its message says all, and a failed load logs no traceback for it."""


@dataclass
class EngineConfig:
    """Everything the engine needs to know besides the requests themselves.

    The KV cache is sized by ``num_kv_blocks`` when given, else by
    ``kv_cache_memory_bytes`` (default: ``default_cpu_kv_bytes`` on CPU, 90% of free memory on CUDA).
    """

    model: str | None = option(None, "Hugging Face directory or .gguf file; empty = SmolLM2-135M-Instruct")
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto, float32, bfloat16 or float16")
    quantization: str = option(
        "auto",
        "packed weights on the CPU: auto (a GGUF's own blocks where they map, else 8-bit groups), none, int4, int8",
    )
    activations: str = option(
        "int8",
        "rows times packed weights on the CPU kernels: int8, as llama.cpp takes them (each input within 1/254 of its "
        "block's largest: 32 inputs, 256 before K-quants), or int16, the exact path (within 2^-16: slower batches and "
        "prefill)",
    )
    block_size: int = option(16, "tokens per KV block", ge=1)
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None  # a setting in MB (kv_cache_memory_mb)
    max_num_seqs: int = option(64, "sequences per engine step", ge=1)
    max_num_batched_tokens: int = option(512, "tokens per engine step (prefills are chunked)", ge=1)
    fair_share: bool = option(True, "share admission and each step between API keys, by weight (weighted fair queuing)")
    shared_step_ms: int = option(
        100,
        "while another key's or another model's streams decode, prefill chunks are sized so that a step takes this "
        "long",
        ge=1,
    )
    min_prefill_chunk: int = option(
        64,
        "beside the streams of its own key (of every request, without keys), a prompt's chunks are paced as beside "
        "another key's but take at least this many tokens a step; max_num_batched_tokens or more: whole chunks",
        ge=1,
    )
    max_model_len: int | None = option(
        None, "context window; default: the model's, clamped at start to what the KV cache holds", ge=2
    )
    enable_prefix_caching: bool = option(True, "reuse KV blocks of identical prompt prefixes")
    kv_store_dir: str | None = option(
        None,
        "a directory where full KV blocks of prompts are kept, for every worker and the next start (the prefix "
        "cache's second tier; see the README); empty: none",
    )
    kv_store_mb: int = option(4096, "the KV store's size limit, over every model in it", ge=1)
    kv_store_url: str | None = option(
        None,
        "a Redis (redis://host:port/db) where full KV blocks of prompts are kept for every host that reaches it, "
        "instead of a directory; its maxmemory and allkeys-lru bound it; empty: none",
    )
    seed: int | None = option(
        None,
        "seed of the sequence that seeds requests giving none; empty: the OS's entropy, each engine its own (every "
        "worker and every load samples afresh)",
    )
    speculative: str = option("ngram", "speculative decoding: ngram (prompt lookup), or none")
    num_speculative_tokens: int | None = option(
        None,
        "tokens a speculative step proposes to verify; default: one less than the CPU kernels' rows per pass over "
        "the weights (15 with AVX-512, 7 with AVX2, 3 with AVX-VNNI or portable C), else 4",
        ge=1,
    )
    prompt_lookup_min: int = option(3, "ngram speculation: the shortest n-gram looked up", ge=1)
    prompt_lookup_max: int = option(4, "ngram speculation: the longest n-gram looked up", ge=1)

    def __post_init__(self) -> None:
        for f in fields(self):
            value, least = getattr(self, f.name), f.metadata.get("ge")
            if least is not None and value is not None and value < least:
                raise ValueError(f"{f.name} must be at least {least}, got {value}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.kv_store_dir and self.kv_store_url:
            raise ValueError("kv_store_dir and kv_store_url: the KV store is one or the other")
        if self.speculative not in ("none", "ngram"):
            raise ValueError(f"speculative must be none or ngram, got {self.speculative!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be at most prompt_lookup_max")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:  # checked without torch: in the server's master
            raise ValueError(f"dtype must be auto or one of {DTYPES}, got {self.dtype!r}")
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


SETTINGS = tuple(f for f in fields(EngineConfig) if "help" in f.metadata)  # the fields that are server settings
