"""Per-request sampling parameters, validated with errors that name the field."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class Range:
    """The values a numeric field takes: from ``low`` (excluded where ``low_open``) up to ``high`` (or any)."""

    low: float
    high: float | None = None
    low_open: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def bounds(self) -> dict[str, float]:
        """As pydantic's ``Field`` keywords."""
        return {"gt" if self.low_open else "ge": self.low, **({"le": self.high} if self.high is not None else {})}

    def __str__(self) -> str:
        low = _number(self.low)
        if self.high is None:
            return f"above {low}" if self.low_open else f"at least {low}"
        return f"in {'(' if self.low_open else '['}{low}, {_number(self.high)}]"


def _number(value: float) -> str:
    """Whole numbers in full (a priority's bound is 2147483647, not 2.14748e+09)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


# Every numeric field's range, declared here once: SamplingParams checks its values with them, and the API's
# request schemas take their fields' bounds from them (server/api/bodies/schemas.py).
RANGES = {
    "temperature": Range(0.0, 2.0),
    "top_k": Range(-1),  # 0 and -1 disable it
    "top_p": Range(0.0, 1.0, low_open=True),
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.0, 10.0, low_open=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "max_tokens": Range(0),  # 0 only reads the prompt (its logprobs)
    "min_tokens": Range(0),
    "logprobs": Range(0, MAX_LOGPROBS),
    "prompt_logprobs": Range(0, MAX_LOGPROBS),
    "priority": Range(-(2**31), 2**31 - 1),
    "seed": Range(-(2**63), 2**63 - 1),  # vLLM's: a 64-bit integer (beyond, two seeds were one generator's)
    "truncate_prompt_tokens": Range(-1),  # -1: the context window's; 0 refused
    "tenant_weight": Range(0.0, 1e6, low_open=True),
}
INTEGERS = (
    *("top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed", "priority"),
    "truncate_prompt_tokens",
)
# numbers that must be given
NOT_NONE = ("top_k", "min_tokens", "priority", *(name for name in RANGES if name not in INTEGERS))
FLAGS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
# The containers a field takes (any other: an InvalidParameter, not a TypeError in a later step).
CONTAINERS = {
    "stop": (str, list, tuple),
    "stop_token_ids": (list, tuple),
    "logit_bias": (dict,),
    "allowed_token_ids": (list, tuple, type(None)),
    "bad_words": (list, tuple),
}


class InvalidParameter(ValueError):
    """A field with a bad value; ``param`` names it (where it is known), so an API can point at it."""

    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # OpenAI's, where it has one for the case
        self.index: int | None = None  # of the prompt at fault, where a request has several


# Whitespace between JSON tokens is bounded: free whitespace lets a model loop on newlines forever.
JSON_WHITESPACE = r"[ \n]{0,16}"


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a choice's text, compiled by ``engine.sampling.grammar``.

    ``json``: a JSON Schema (dict or JSON text); ``regex``: a regular expression; ``choice``: one of a list of
    strings; ``grammar``: a Lark grammar (GBNF is converted; a Lark grammar may embed a schema with ``%json {...}``).
    """

    kind: Literal["json", "regex", "choice", "grammar"]
    value: object
    # The request field it came from, which its errors name (response_format, tools, ...).
    source: str = field(default="structured_outputs", compare=False)
    # A thinking model's reply: the constraint holds after a free thought in <think>…</think> (if it thinks).
    after_thought: bool = False
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
            raise InvalidParameter(
                self.source, f"{self.source}: the {self.kind} constraint is not valid: {self.value!r}"
            )

    @property
    def schema(self) -> dict:
        """A json constraint's schema as a dict (``true``: anything, ``false``: nothing)."""
        schema = json.loads(self.value) if isinstance(self.value, str) else self.value
        return schema if isinstance(schema, dict) else {} if schema is True else {"not": {}}

    def lark_json(self) -> str:
        """A json constraint as a Lark ``%json`` term, its whitespace bounded as for a whole-JSON constraint."""
        return f"%json {json.dumps({**self.schema, 'x-guidance': {'whitespace_pattern': JSON_WHITESPACE}})}"


@dataclass
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1 and ``top_p == 1`` disable
    those filters. Ranges: ``RANGES``. ``max_tokens=None`` means "up to the end of the context window"; 0
    only reads the prompt. ``logprobs`` is the number of top alternatives returned
    per token (0 = only the sampled token's logprob, None = no logprobs);
    ``prompt_logprobs`` the same for every prompt token after the first.
    ``logit_bias`` adds to a token's logit before sampling; ``allowed_token_ids`` and
    ``bad_words`` bar tokens (``sampling.token_bans``); ``structured_output``
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
    include_stop_str_in_output: bool = False  # a matched stop string ends the text (vLLM's), else it is cut
    ignore_eos: bool = False
    max_tokens: int | None = 16
    # vLLM's: the first min_tokens tokens can be no end of sequence and no stop token, and a stop string counts
    # only where it starts after their text.
    min_tokens: int = 0
    # vLLM's: a longer prompt keeps its last this many tokens (-1: as many as the context window holds), a text
    # its tokenizer's special tokens too (``text.truncation``)
    truncate_prompt_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # vLLM's: never sampled as a whole
    # the bad words' spellings as token ids, where the server tokenized them ahead, off the engine thread
    bad_word_ids: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False, repr=False)
    structured_output: StructuredOutput | None = None
    # Where the request waits, as vLLM's priority: lower runs first (equal ones first come, first served), and
    # under KV pressure the highest is preempted first. Not a sampling setting; it rides with them to the engine.
    priority: int = 0
    # Whose request it is (an API key's id; "" for none) and that tenant's weight: when several tenants have work,
    # each gets a share of the engine in proportion to its weight (``scheduling.fair_share``). Not sampling either.
    tenant: str = ""
    tenant_weight: float = 1.0
    # vLLM's cache_salt: with the tenant, what the request's cached prefixes are hashed with, so that one key
    # cannot learn what another sent from cached_tokens or its first token's time. Requests share prefixes only
    # with requests of the same tenant and salt.
    cache_salt: str = ""
    # An embedding of the prompt instead of text (with max_tokens 0): the mean of its final hidden states, or the
    # last one's, L2-normalized.
    pooling: Literal["mean", "last"] | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias)
        self.allowed_token_ids = None if self.allowed_token_ids is None else list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words)
        self._validate()
        self.top_k = max(self.top_k, 0)  # -1 disables it as 0 does

    def _fail(self, name: str, why: str) -> None:
        raise InvalidParameter(name, f"{name} {why}, got {getattr(self, name)!r}")

    def _check_types(self) -> None:
        """What the ranges cannot say: a None, a bool for a number, a string for a flag or a constraint (each
        crashed a later step, with the batch it was in, or was taken as something else)."""
        for name in NOT_NONE:
            value = getattr(self, name)
            if value is None or isinstance(value, bool) or not isinstance(value, int | float):
                self._fail(name, "must be a number")
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "must be true or false")
        for name, kinds in CONTAINERS.items():
            if not isinstance(getattr(self, name), kinds):
                self._fail(name, f"must be a {' or '.join(k.__name__ for k in kinds)}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            self._fail("structured_output", "must be a StructuredOutput")

    def _validate(self) -> None:
        fail = self._fail
        for name in INTEGERS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                fail(name, "must be an integer")
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is not None and not allowed.holds(value):
                fail(name, f"must be {allowed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
            fail("logit_bias", "must map token ids (non-negative integers) to biases")
        # "not <=": a NaN bias fails every comparison (as "> MAX" it passed, and its step killed the engine)
        if any(not isinstance(b, (int, float)) or not abs(b) <= MAX_LOGIT_BIAS for b in self.logit_bias.values()):
            fail("logit_bias", f"biases must be numbers between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}")
        allowed = self.allowed_token_ids
        if allowed is not None and (not allowed or any(not isinstance(t, int) or t < 0 for t in allowed)):
            fail("allowed_token_ids", "must be a non-empty list of token ids (non-negative integers)")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            fail("bad_words", "must be words (strings with more than whitespace)")
        if (allowed is not None or self.bad_words) and self.structured_output is not None:
            name = "allowed_token_ids" if allowed is not None else "bad_words"
            fail(name, "cannot be combined with a constraint (structured outputs, tools)")
        if self.truncate_prompt_tokens == 0:
            fail("truncate_prompt_tokens", "must be -1 (as many as the context window holds) or at least 1")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        if self.min_tokens and self.structured_output is not None:  # a complete constraint allows the end alone
            fail("min_tokens", "cannot be combined with a constraint (structured outputs, tools)")
        if self.pooling not in (None, "mean", "last") or self.pooling and self.max_tokens != 0:
            fail("pooling", "must be mean or last, with max_tokens 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits sampled from are other than the model's (penalties, biases, banned tokens)."""
        return self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)


def max_tokens_within(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    """``params.max_tokens``, or (None) all the room the context window leaves; InvalidParameter where they do not
    fit, or where min_tokens does not."""
    max_tokens, room = params.max_tokens, max_model_len - prompt_len
    resolved = max_tokens if max_tokens is not None else room
    if room < 0 or resolved > room or (room == 0 and max_tokens is None):
        fault = f"+ max_tokens ({max_tokens}) exceeds" if max_tokens is not None else "leaves no room to generate in"
        raise InvalidParameter(
            "max_tokens" if max_tokens is not None and room >= 0 else "prompt",
            f"prompt ({prompt_len} tokens) {fault} the context window of {max_model_len} tokens",
            code="context_length_exceeded",
        )
    if params.min_tokens > resolved:
        raise InvalidParameter(
            "min_tokens",
            f"prompt ({prompt_len} tokens) leaves room for {resolved} tokens, "
            f"fewer than min_tokens ({params.min_tokens})",
        )
    return resolved


def tokens_to_keep(params: SamplingParams, max_model_len: int) -> int | None:
    """How many tokens a prompt keeps at most (-1: the context window's), or None for all of them;
    InvalidParameter where more are asked for than the context window holds."""
    keep = params.truncate_prompt_tokens
    if keep is not None and keep > max_model_len:
        raise InvalidParameter(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens ({keep}) is more than the context window of {max_model_len} tokens",
        )
    return max_model_len if keep == -1 else keep
