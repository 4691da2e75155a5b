"""What the engine hands back: per-step deltas and finished offline results."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The sampled token's logprob and the top alternatives (model distribution)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestDelta:
    """What one step did to one request: new text, new tokens, maybe its end.

    ``finish_reason`` is None while the request runs, then "stop", "length" or
    "abort". ``text`` may be empty while the detokenizer holds back an incomplete
    character or a possible stop-string prefix.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """A finished request, as returned by ``LLM.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
