"""What the engine hands back: per-step deltas, finished offline results, counters."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class TokenLogprob:
    """The sampled token's logprob and the top alternatives (model distribution); a prompt token's also its rank
    there (1: the most likely), as vLLM's prompt_logprobs give it."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


# vLLM's finish reason "error": the output's constraint (a schema, a grammar, tools) could not be completed, no token
# able to follow the text; the APIs without such a reason end the request with an error instead.
CONSTRAINT_FAILED = "error"
CONSTRAINT_FAILED_MESSAGE = "the output cannot be completed within its constraint: no token may follow it"


@dataclass
class RequestDelta:
    """What one step did to one request: new text, new tokens, maybe its end.

    ``finish_reason`` is None while the request runs, then "stop", "length",
    "abort" or ``CONSTRAINT_FAILED``. ``text`` may be empty while the detokenizer holds back an incomplete
    character or a possible stop-string prefix.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token (an id) that ended it; None where "stop" came by EOS or a grammar
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    queue_seconds: float | None = None  # on the first delta: from add_request to the first step
    # On a request's first delta, when it asked for prompt logprobs (of tokens 1..):
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    embedding: list[float] | None = None  # an embedding model's, with the input's one delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: RequestDelta) -> RequestDelta:
        """This delta followed by a later one of the same request, as one delta.

        The one way deltas are merged: offline results, slow stream readers and
        non-streamed responses all use it. Neither input is changed.
        """
        logprobs = self.logprobs if later.logprobs is None else (self.logprobs or []) + later.logprobs
        return replace(
            self,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
            # the first delta's, where it has them: a one-token prompt's logprobs are [] (none after its first
            # token), and `or` took the later delta's None for them, which dropped the prompt from an echo
            prompt_token_ids=_first(self.prompt_token_ids, later.prompt_token_ids),
            prompt_logprobs=_first(self.prompt_logprobs, later.prompt_logprobs),
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            embedding=_first(self.embedding, later.embedding),
            num_output_tokens=later.num_output_tokens,
        )


def _first(value, later):
    return value if value is not None else later


@dataclass
class CompletionOutput:
    """A finished request, as returned by ``LLM.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1..
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token that ended it


@dataclass
class EngineCounters:
    """What the engine holds now: when idle, nothing runs or waits and every block is free."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_cached_blocks: int
    num_total_blocks: int
    # Cumulative since the engine started:
    num_prefix_query_tokens: int  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int  # prompt tokens taken from the prefix cache
    num_preemptions: int
    num_store_query_tokens: int = 0  # prompt tokens looked up in the KV store (``kv_store``)
    num_store_hit_tokens: int = 0  # prompt tokens taken from it
    store: dict[str, int] = field(default_factory=dict)  # its ``StoreCounters``, cumulative
    store_degraded: bool = False
    num_spec_drafts: int = 0  # speculative steps of a sequence that verified a draft
    num_spec_draft_tokens: int = 0  # draft tokens verified
    num_spec_accepted_tokens: int = 0  # draft tokens accepted
    num_spec_accepted_per_position: tuple[int, ...] = ()  # of them, those at draft position 0, 1, ...
