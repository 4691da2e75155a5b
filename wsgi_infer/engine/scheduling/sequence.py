"""One request's state inside the engine: plain data, no torch."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from ..outputs import TokenLogprob
    from ..text.detokenizer import IncrementalDetokenizer
    from ..text.llguidance_c import Matcher
    from .block_manager import BlockTable


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens, KV blocks and progress of one request.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the tokens
    after it are what the next steps must compute. A token is sampled only when
    a step computes up to the last token. The engine attaches the request's
    detokenizer, seed, grammar matcher and banned tokens; scheduling and block
    management never use them.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        detokenizer: IncrementalDetokenizer | None = None,
        seed: int = 0,
        matcher: Matcher | None = None,
        bans: object = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.tenant = params.tenant  # the engine clears it where fair share is off
        self.max_tokens = max_tokens
        self.detokenizer = detokenizer
        self.seed = seed  # its sampled tokens' draws (``sampler.uniform_draw``)
        self.matcher = matcher
        self.bans = bans  # its allowed tokens and bad words, the sampler's (``sampling.token_bans.TokenBans``)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_tables: list[BlockTable] = []  # one per pool of the KV cache (``kv_cache_manager``)
        self.block_hashes: list[bytes] = []  # chained content hashes of full blocks
        self.num_cached_tokens = 0  # prompt tokens the prefix cache supplied at admission (either tier)
        # The KV store (``kv_store``): its read of this prompt's blocks, and the leading blocks it needs no more.
        self.stored_read: object = None
        self.num_stored_blocks = 0
        self.stored_at_ns = 0  # its first blocks' noting: its blocks are dated from it, each earlier than the last
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.prompt_logprobs: list[TokenLogprob] = []  # of prompt tokens 1.., when asked for
        # With params.pooling: the final hidden states of positions < num_pooled, summed (mean) or the last one.
        self.pooled: torch.Tensor | None = None
        self.num_pooled = 0
        # Speculative decoding: the tokens this step verifies after the last one, and the proposer's own state.
        self.draft: list[int] = []
        self.lookup: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def computes_every_position(self) -> bool:
        """Prompt logprobs and mean pooling need every prompt position computed: no cached prefix for them."""
        return self.params.prompt_logprobs is not None or self.params.pooling == "mean"

    @property
    def prefills(self) -> bool:
        """More than its next token (and draft) to compute: a prompt, or a preempted sequence's recomputation."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
