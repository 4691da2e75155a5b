"""Request schemas of the OpenAI-compatible and native APIs (pydantic), read by ``parsing.parse``."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
)

from ....engine.sampling_params import RANGES, SamplingParams
from .constraints import ConstraintFields
from .keep_alive import KeepAlive
from .parsing import Request
from .refused import CHATS_ONLY, SAMPLING, VLLM_COMPLETIONS

MAX_CHOICES = 16
MAX_STOP_SEQUENCES = 64  # vLLM's clients send more than OpenAI's 4 (lm-eval's `until`); each is searched per token

# JSON's true and 1.0 are no token ids, nor "yes" a boolean: pydantic's lax mode would take them as 1 and True.
TokenIds = list[StrictInt]


def _token_id_key(key: Any) -> Any:
    """A JSON object's key naming a token id: its decimal digits, as OpenAI's logit_bias writes them ("+5", "05",
    "5_0" or " 5" would be another spelling pydantic's lax int takes)."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and (key == "0" or not key.startswith("0")):
        return int(key)
    if isinstance(key, str) and key.startswith("-") and key[1:].isascii() and key[1:].isdigit():
        raise ValueError("token ids are at least 0")  # not "a valid integer", which it is
    return key  # a string the strict int refuses


TokenBiases = dict[Annotated[int, BeforeValidator(_token_id_key)], float]


def _one_of_the_forms(value: Any, handler: Any) -> Any:
    """One error naming the forms a prompt takes, where each member of the union reported its own."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError("must be a text, a list of texts, a list of token ids (integers) or a list of those") from None


# one prompt or several, as text or token ids
Prompts = Annotated[str | list[str] | TokenIds | list[TokenIds], WrapValidator(_one_of_the_forms)]


def batch_of(prompts: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """One prompt or several, as a list of prompts (each a text or token ids)."""
    return [prompts] if isinstance(prompts, str) or isinstance(prompts[0], int) else list(prompts)


def _few_enough(value: str | list[str] | None) -> str | list[str] | None:
    if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
    return value


StopStrings = Annotated[str | list[str] | None, AfterValidator(_few_enough)]


def engine_default(name: str) -> Any:
    """SamplingParams' default for a field, which the API's defaults are."""
    return SamplingParams.__dataclass_fields__[name].default


def engine_field(name: str, default: Any = None) -> Any:
    """A request field bounded as the engine bounds it (``RANGES``); None: the engine's default."""
    return Field(default, **RANGES[name].bounds())


class StreamOptions(Request):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's

    @field_validator("continuous_usage_stats")
    @classmethod
    def _not_in_every_chunk(cls, value: bool) -> bool:
        if value:
            raise ValueError("usage in every chunk is not supported; include_usage sends it after the last")
        return value


class SamplingRequest(ConstraintFields):
    refused = SAMPLING
    model: str | None = None
    keep_alive: KeepAlive = None
    temperature: float | None = engine_field("temperature")
    top_p: float | None = engine_field("top_p")
    top_k: int | None = engine_field("top_k")
    min_p: float | None = engine_field("min_p")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: StopStrings = None
    seed: int | None = engine_field("seed")
    presence_penalty: float | None = engine_field("presence_penalty")
    frequency_penalty: float | None = engine_field("frequency_penalty")
    repetition_penalty: float | None = engine_field("repetition_penalty")
    min_tokens: int | None = engine_field("min_tokens")  # vLLM's, as is the next
    truncate_prompt_tokens: int | None = engine_field("truncate_prompt_tokens")
    ignore_eos: StrictBool = False
    priority: StrictInt = 0  # vLLM's: lower runs first
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefixes shared only with the same salt
    stop_token_ids: list[StrictInt] | None = None  # vLLM's, as are the next two
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    user: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = engine_field("prompt_logprobs")  # vLLM's: each prompt token's, and the top n
    logit_bias: TokenBiases | None = None
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's, as are the next three
    bad_words: list[str] | None = None
    return_token_ids: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):  # as OpenAI: they shape a stream's chunks
            raise ValueError("only allowed when stream is true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):  # as vLLM: they come with the whole response
            raise ValueError("prompt_logprobs are not available when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, echo_logprobs: int | None = None
    ) -> list[SamplingParams]:
        """One SamplingParams per choice; choice j of a seeded request uses seed + j so choices differ. Fields
        left out (None) take the engine's defaults; a bad value raises InvalidParameter (errors.py renders it).
        The prompt's logprobs are computed for the larger of vLLM's prompt_logprobs and ``echo_logprobs``."""
        given, constraint = self.given(SAMPLING_FIELDS), self.constraint()
        wanted = [n for n in (self.prompt_logprobs, echo_logprobs) if n is not None]
        return [
            SamplingParams(
                **given,
                seed=None if self.seed is None else (self.seed + j + 2**63) % 2**64 - 2**63,  # within the range
                ignore_eos=self.ignore_eos,
                priority=self.priority,
                cache_salt=self.cache_salt or "",
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=max(wanted, default=None),
                logit_bias=self.logit_bias or {},
                structured_output=constraint,
            )
            for j in range(self.n)
        ]


# The request fields that are SamplingParams fields of the same name and meaning ("" a stop string, refused as [""]).
SAMPLING_FIELDS = (
    "stop",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "truncate_prompt_tokens",
    *("stop_token_ids", "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words"),
)


class CompletionRequest(SamplingRequest):
    refused = {**SAMPLING, **VLLM_COMPLETIONS, **CHATS_ONLY}
    prompt: Prompts
    max_tokens: int | None = engine_field("max_tokens", engine_default("max_tokens"))  # 0 with echo: score the prompt
    logprobs: int | None = engine_field("logprobs")
    echo: StrictBool = False

    @property
    def echo_logprobs(self) -> int | None:
        """With echo, the prompt's tokens get logprobs too (lm-eval-harness's loglikelihood)."""
        return self.logprobs if self.echo else None

    @field_validator("echo")
    @classmethod
    def _whole_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("truncate_prompt_tokens") is not None:  # the echo would not be what was read
            raise ValueError("echo cannot be combined with truncate_prompt_tokens")
        return value

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        return batch_of(self.prompt)


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class GenerateRequest(Request):
    """The native API: a prompt and a few sampling knobs. Its fields are ours: another is a 400, not ignored
    (``max_tokens`` here would have been, and 16 tokens generated)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    keep_alive: KeepAlive = None
    prompt: str = Field(min_length=1)
    max_new_tokens: int = engine_field("max_tokens", engine_default("max_tokens"))
    temperature: float | None = engine_field("temperature")
    top_k: int | None = engine_field("top_k")
    top_p: float | None = engine_field("top_p")
    seed: int | None = engine_field("seed")
    stop: StopStrings = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False

    def sampling_params(self) -> SamplingParams:
        given = self.given(("temperature", "top_k", "top_p", "seed", "stop"))
        return SamplingParams(**given, ignore_eos=self.ignore_eos, max_tokens=self.max_new_tokens)
