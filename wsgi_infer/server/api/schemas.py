"""Request schemas of the OpenAI-compatible and native APIs (pydantic).

Unknown fields are ignored, as OpenAI's server does; known fields with bad
values give a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ...engine.sampling_params import InvalidParameter, SamplingParams, StructuredOutput
from ..errors import APIError

MAX_CHOICES = 16


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


# Known OpenAI fields that would change the output and that we do not implement: a 400, never ignored.
# Fields that change nothing here (metadata, store, user, service_tier, ...) are accepted and ignored.
UNSUPPORTED = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "functions": "functions is deprecated and not supported; use tools",
    "function_call": "function_call is deprecated and not supported; use tool_choice",
    "web_search_options": "web search is not supported",
    "suffix": "suffix (fill in the middle) is not supported",
    "best_of": "best_of is not supported; use n",
}
NEUTRAL_VALUES = {"modalities": (["text"],), "best_of": (1,), "suffix": ("",)}


def refuse_unsupported(body: dict) -> None:
    for name, reason in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in NEUTRAL_VALUES.get(name, ()):
            raise APIError(reason, param=name)


class StreamOptions(Request):
    include_usage: bool = False


class JsonSchemaFormat(Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json", {"type": "object"})
        if self.json_schema is None:
            raise APIError("response_format.json_schema is required for type json_schema", param="response_format")
        # No schema: any JSON object, as OpenAI does.
        return StructuredOutput("json", self.json_schema.schema_ or {"type": "object"})


class StructuredOutputs(Request):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> StructuredOutput:
        given = {
            kind: value
            for kind, value in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        }
        if self.json_object:
            given["json"] = {"type": "object"}
        if len(given) != 1:
            raise APIError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                param="structured_outputs",
            )
        [(kind, value)] = given.items()
        return StructuredOutput(kind, value)


class SamplingRequest(Request):
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
    logit_bias: dict[int, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def constraint_field(self) -> str:
        """The field a constraint came from, for errors."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def constraint(self) -> StructuredOutput | None:
        if self.structured_outputs is not None and self.response_format is not None:
            raise APIError("give response_format or structured_outputs, not both", param="structured_outputs")
        source = self.structured_outputs or self.response_format
        try:
            return source.constraint() if source is not None else None
        except InvalidParameter as exc:
            raise APIError(str(exc), param=self.constraint_field) from None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> list[SamplingParams]:
        """One SamplingParams per choice; choice j of a seeded request uses seed + j so choices differ."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        constraint = self.constraint()
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
                    prompt_logprobs=prompt_logprobs,
                    logit_bias=self.logit_bias or {},
                    structured_output=constraint,
                )
                for j in range(self.n)
            ]
        except InvalidParameter as exc:
            raise APIError(str(exc), param=exc.param) from None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 with echo: score the prompt only
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @property
    def prompt_logprobs(self) -> int | None:
        """With echo, the prompt's tokens get logprobs too (lm-eval-harness's loglikelihood)."""
        return self.logprobs if self.echo else None

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


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class GenerateRequest(Request):
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


def parse(schema: type[Request], body: object) -> Request:
    """Validate a JSON body; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    try:  # JSON escapes can spell lone surrogates, which no tokenizer takes
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError("request body has invalid unicode (a lone surrogate escape)") from None
    refuse_unsupported(body)
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
