"""Per-request sampling parameters, validated with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


class InvalidParameter(ValueError):
    """A field with a bad value; ``param`` names it, so an API can point at it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a choice's text, compiled by ``engine.grammar``.

    ``json``: a JSON Schema (dict or JSON text); ``regex``: a regular expression;
    ``choice``: one of a list of strings; ``grammar``: a Lark grammar (GBNF is
    converted; a Lark grammar may embed a schema with ``%json {...}``).
    """

    kind: Literal["json", "regex", "choice", "grammar"]
    value: object
    # The compiled grammar, when a caller compiled it ahead (the server does, off the engine thread).
    compiled: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        valid = {
            "json": lambda v: isinstance(v, (dict, str, bool)),
            "regex": lambda v: isinstance(v, str),
            "choice": lambda v: isinstance(v, list) and v and all(isinstance(c, str) and c for c in v),
            "grammar": lambda v: isinstance(v, str) and v.strip(),
        }
        if self.kind not in valid or not valid[self.kind](self.value):
            raise InvalidParameter("structured_outputs", f"structured_outputs.{self.kind} is not valid: {self.value!r}")


@dataclass
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``max_tokens=None`` means "up to the end of the context window"; 0
    only reads the prompt. ``logprobs`` is the number of top alternatives returned
    per token (0 = only the sampled token's logprob, None = no logprobs);
    ``prompt_logprobs`` the same for every prompt token after the first.
    ``logit_bias`` adds to a token's logit before sampling; ``structured_output``
    allows only the tokens that keep the text valid, and ends the choice when it
    is complete.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise InvalidParameter(name, f"{name} {why}, got {getattr(self, name)!r}")

        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", "must be between 0 and 100")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be a non-negative integer (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer")
        if not 0.0 < self.repetition_penalty <= 10.0:
            fail("repetition_penalty", "must be in (0, 10]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be between -2 and 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be between -2 and 2")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            fail("max_tokens", "must be a non-negative integer")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_LOGPROBS:
                fail(name, f"must be between 0 and {MAX_LOGPROBS}")
        if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
            fail("logit_bias", "must map token ids (non-negative integers) to biases")
        if any(not isinstance(b, (int, float)) or abs(b) > MAX_LOGIT_BIAS for b in self.logit_bias.values()):
            fail("logit_bias", f"biases must be numbers between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
