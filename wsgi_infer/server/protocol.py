"""Request schemas of the OpenAI-compatible and native APIs (pydantic).

Unknown fields are ignored, as OpenAI's server does; known fields with bad
values give a 400 naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..engine.sampling_params import MAX_LOGPROBS, InvalidParameter, SamplingParams
from .errors import APIError

MAX_CHOICES = 16


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> list[SamplingParams]:
        """One SamplingParams per choice; choice j of a seeded request uses seed + j so choices differ."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return [
                SamplingParams(
                    temperature=1.0 if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p,
                    top_k=max(0, self.top_k or 0),
                    min_p=self.min_p or 0.0,
                    seed=None if self.seed is None else self.seed + j,
                    presence_penalty=self.presence_penalty or 0.0,
                    frequency_penalty=self.frequency_penalty or 0.0,
                    repetition_penalty=self.repetition_penalty or 1.0,
                    stop=stop,
                    ignore_eos=self.ignore_eos,
                    max_tokens=max_tokens,
                    logprobs=logprobs,
                )
                for j in range(self.n)
            ]
        except InvalidParameter as exc:
            raise APIError(str(exc), param=exc.param) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, token ids, or a list of either."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def as_template_message(self) -> dict[str, str]:
        """Flatten content parts to text (text parts only; other modalities are refused)."""
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError("only text content parts are supported", param="messages")
                texts.append(part["text"])
            return {"role": self.role, "content": "".join(texts)}
        return {"role": self.role, "content": self.content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(_Request):
    """The native API: a prompt and a few sampling knobs."""

    prompt: str = Field(min_length=1)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, max_tokens=self.max_new_tokens
        )


def parse(schema: type[_Request], body: object) -> _Request:
    """Validate a JSON body; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
