"""Server settings, read from ``WSGI_INFER_*`` environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..engine.config import EngineConfig


class ServerSettings(BaseSettings):
    """Every field is an environment variable: ``max_num_seqs`` is ``WSGI_INFER_MAX_NUM_SEQS``."""

    model_config = SettingsConfigDict(env_prefix="WSGI_INFER_", extra="ignore")

    model: str | None = Field(None, description="Hugging Face directory or .gguf file; empty = SmolLM2-135M-Instruct")
    served_model_name: str | None = Field(
        None, description="name clients send as `model`; default: the model's directory or file name"
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16")
    quantization: str = Field(
        "auto",
        description="packed weights for small batches (CPU): auto (a GGUF's 4-bit blocks in bf16), none, int4, int8",
    )
    max_num_seqs: int = Field(64, ge=1, description="sequences per engine step")
    max_num_batched_tokens: int = Field(512, ge=1, description="tokens per engine step (prefills are chunked)")
    max_model_len: int | None = Field(None, ge=2, description="context window; default: the model's")
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    kv_cache_memory_mb: int | None = Field(
        None, ge=1, description="KV cache budget; default 256 on CPU, 90% of free memory on CUDA"
    )
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of identical prompt prefixes")
    seed: int = Field(0, description="seed for requests that give none")
    max_waiting_requests: int = Field(256, ge=0, description="requests queued beyond max_num_seqs before 429")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body (413 above)")
    body_timeout_seconds: float = Field(
        30.0, gt=0, description="a request body must arrive whole within this time (408 otherwise; slow clients)"
    )
    heartbeat_seconds: float = Field(5.0, gt=0, description="SSE comment interval while a stream has nothing to send")
    resume_keep_seconds: float = Field(
        60.0, ge=0, description="how long a finished stream stays resumable (GET /v1/streams/<id>)"
    )
    stream_backlog_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="a stream whose client is this far behind (or stopped reading) is aborted with an error event",
    )
    redis_url: str | None = Field(
        None,
        description="also copy resumable streams to this Redis (redis://host:port/db): any worker or host resumes them",
    )
    stall_seconds: float = Field(
        60.0, gt=0, description="requests open but no output from the engine for this long: /health says 503"
    )
    load_wait_seconds: float = Field(
        30.0, ge=0, description="how long a request waits for a worker that is still loading its model"
    )
    drain_seconds: float | None = Field(
        None,
        gt=0,
        description="on SIGTERM, how long open requests may finish; default graceful_timeout - keepalive - 2",
    )

    api_key: str | None = Field(
        None, description="one key, or several separated by commas; API routes then need `Authorization: Bearer <key>`"
    )
    protect_ops: bool = Field(False, description="with api_key: /health and /metrics need the key too")
    cors_origins: str = Field(
        "", description="origins allowed to call the API from a browser, separated by commas (`*` for any)"
    )

    test_fault_at_step: int = Field(0, ge=0, description="tests only: the engine's step N raises, as a bug would")

    @property
    def api_keys(self) -> list[str]:
        return [key.strip() for key in (self.api_key or "").split(",") if key.strip()]

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model or None,
            device=self.device,
            dtype=self.dtype,
            quantization=self.quantization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_mb << 20 if self.kv_cache_memory_mb else None,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
        )
