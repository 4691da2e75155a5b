"""Request schemas of the OpenAI-compatible and native APIs (pydantic).

Unknown fields are ignored, as OpenAI's server does; known fields with bad
values give a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    WrapValidator,
    field_validator,
)

from ...engine.sampling_params import RANGES, SamplingParams, StructuredOutput
from ..errors import APIError
from .keep_alive import KeepAlive

MAX_CHOICES = 16
MAX_STOP_SEQUENCES = 4

# JSON's true and 1.0 are no token ids, nor "yes" a boolean: pydantic's lax mode would take them as 1 and True.
TokenIds = list[StrictInt]


def _one_of_the_forms(value: Any, handler: Any) -> Any:
    """One error naming the forms a prompt takes, where each member of the union reported its own."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError("must be a text, a list of texts, a list of token ids (integers) or a list of those") from None


# one prompt or several, as text or token ids
Prompts = Annotated[str | list[str] | TokenIds | list[TokenIds], WrapValidator(_one_of_the_forms)]


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def given(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The named fields the client gave a value (not None)."""
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def engine_default(name: str) -> Any:
    """SamplingParams' default for a field, which the API's defaults are."""
    return SamplingParams.__dataclass_fields__[name].default


def engine_field(name: str, default: Any = None) -> Any:
    """A request field bounded as the engine bounds it (``RANGES``); None: the engine's default."""
    return Field(default, **RANGES[name].bounds())


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
    # json_object with a schema: the form llama-server and several hosted APIs honour (instructor sends it)
    schema_: dict | None = Field(None, alias="schema")

    def constraint(self) -> StructuredOutput | None:
        if self.type == "text":
            if self.schema_ is not None:
                raise APIError("response_format.schema needs type json_object or json_schema", param="response_format")
            return None
        if self.type == "json_object":
            return StructuredOutput("json", {"type": "object", **(self.schema_ or {})}, source="response_format")
        if self.json_schema is None:
            raise APIError("response_format.json_schema is required for type json_schema", param="response_format")
        # No schema: any JSON object, as OpenAI does.
        return StructuredOutput("json", self.json_schema.schema_ or {"type": "object"}, source="response_format")


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
    keep_alive: KeepAlive = None
    temperature: float | None = engine_field("temperature")
    top_p: float | None = engine_field("top_p")
    top_k: int | None = engine_field("top_k")
    min_p: float | None = engine_field("min_p")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = engine_field("presence_penalty")
    frequency_penalty: float | None = engine_field("frequency_penalty")
    repetition_penalty: float | None = engine_field("repetition_penalty")
    ignore_eos: StrictBool = False
    priority: StrictInt = 0  # vLLM's: lower runs first
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefixes shared only with the same salt
    stop_token_ids: list[StrictInt] | None = None  # vLLM's, as are the next two
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    user: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[int, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def constraint(self) -> StructuredOutput | None:
        if self.structured_outputs is not None and self.response_format is not None:
            raise APIError("give response_format or structured_outputs, not both", param="structured_outputs")
        source = self.structured_outputs or self.response_format
        return source.constraint() if source is not None else None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> list[SamplingParams]:
        """One SamplingParams per choice; choice j of a seeded request uses seed + j so choices differ. Fields
        left out (None) take the engine's defaults; a bad value raises InvalidParameter (errors.py renders it)."""
        given, constraint = self.given(SAMPLING_FIELDS), self.constraint()
        return [
            SamplingParams(
                **given,
                seed=None if self.seed is None else self.seed + j,
                stop=[] if self.stop is None else self.stop,  # "" is refused as [""] is
                ignore_eos=self.ignore_eos,
                priority=self.priority,
                cache_salt=self.cache_salt or "",
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=self.logit_bias or {},
                structured_output=constraint,
            )
            for j in range(self.n)
        ]


# The request fields that are SamplingParams fields of the same name and meaning.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    *("stop_token_ids", "skip_special_tokens", "include_stop_str_in_output"),
)


class CompletionRequest(SamplingRequest):
    prompt: Prompts
    max_tokens: int | None = engine_field("max_tokens", engine_default("max_tokens"))  # 0 with echo: score the prompt
    logprobs: int | None = engine_field("logprobs")
    echo: StrictBool = False

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

    model: str | None = None
    keep_alive: KeepAlive = None
    prompt: str = Field(min_length=1)
    max_new_tokens: int = engine_field("max_tokens", engine_default("max_tokens"))
    temperature: float | None = engine_field("temperature")
    top_k: int | None = engine_field("top_k")
    top_p: float | None = engine_field("top_p")
    stream: StrictBool = False

    def sampling_params(self) -> SamplingParams:
        given = {
            name: getattr(self, name) for name in ("temperature", "top_k", "top_p") if getattr(self, name) is not None
        }
        return SamplingParams(**given, max_tokens=self.max_new_tokens)


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
