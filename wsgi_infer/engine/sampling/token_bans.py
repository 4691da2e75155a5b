"""vLLM's ``allowed_token_ids`` and ``bad_words``: tokens a request may not sample.

``allowed_token_ids`` keeps only the listed tokens. ``bad_words`` are strings, each tokenized as it would start
the text and as it would follow a space: a spelling's last token is barred wherever the output so far ends with
the tokens before it (a one-token spelling always). vLLM bars the spelling after a space only where it has as
many tokens as the other; here it is barred however many it has (" Paris" one token, "Paris" two: the word
never comes, either way). Both act on the logits sampled from, not on the logprobs returned, which are the
model's own (as vLLM's by default).

The words are tokenized off the engine thread where the server admits a request (``text.bad_words``, on the
front end); a step looks up only the spellings whose next-to-last token the output ends with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import InvalidParameter, SamplingParams
from ..text.bad_words import Spellings, spellings


@dataclass(frozen=True)
class TokenBans:
    """A request's bans, ready for its steps: the allowed tokens' ids, and the bad words' spellings indexed."""

    allowed: torch.Tensor | None
    always: torch.Tensor | None  # one-token spellings
    after: dict[int, Spellings]  # longer spellings by their next-to-last token

    def apply(self, logits: torch.Tensor, output_ids: list[int]) -> None:
        """In place, on one row: every token but the allowed ones, and the bad words' next tokens, to -inf."""
        if self.allowed is not None:
            kept = logits[self.allowed]
            logits.fill_(float("-inf"))
            logits[self.allowed] = kept
        if self.always is not None:
            logits.index_fill_(0, self.always, float("-inf"))
        barred = self.barred_after(output_ids)
        if barred:
            logits.index_fill_(0, torch.tensor(barred, dtype=torch.long, device=logits.device), float("-inf"))

    def barred_after(self, output_ids: list[int]) -> list[int]:
        """The longer spellings' last tokens that would complete one after these output tokens."""
        if not output_ids:
            return []
        return [
            word[-1]
            for word in self.after.get(output_ids[-1], ())
            if len(word) - 1 <= len(output_ids) and list(word[:-1]) == output_ids[1 - len(word) :]
        ]

    @property
    def could_bar_all(self) -> bool:
        """Whether a step's bans may leave a row no token: bad words beside an allowed few (the allowed tokens alone
        leave some, and so do bad words among the whole vocabulary)."""
        return self.allowed is not None and (self.always is not None or bool(self.after))

    def allowed_only(self, logits: torch.Tensor) -> torch.Tensor:
        """A row with the allowed tokens alone kept. The sampler takes this where the bad words and the barred
        ends would leave no token at all (a bad word is then the only text left)."""
        kept = torch.full_like(logits, float("-inf"))
        kept[self.allowed] = logits[self.allowed]
        return kept


def token_bans(params: SamplingParams, tokenizer, vocab: int, ends: set[int], device: torch.device) -> TokenBans | None:
    """A request's bans (None where it has none), its allowed tokens checked against the vocabulary and its bad
    words tokenized where the front end did not. ``ends``: the tokens that end it (barred before its min_tokens).
    InvalidParameter where they leave it no token to sample."""
    allowed = params.allowed_token_ids
    if allowed is None and not params.bad_words:
        return None
    if allowed is not None and max(allowed) >= vocab:
        raise InvalidParameter("allowed_token_ids", f"allowed_token_ids must be below the vocabulary size {vocab}")
    words = params.bad_word_ids
    if words is None:  # given to the engine itself (``LLM``), not through the server
        words = spellings(tokenizer, params.bad_words) if params.bad_words else ()
    always = tuple(w[0] for w in words if len(w) == 1)
    if allowed is not None and set(allowed) <= {*always, *(ends if params.min_tokens else ())}:
        raise InvalidParameter(
            "allowed_token_ids",
            "allowed_token_ids leaves no token to sample: each is a bad word"
            + (" or ends the request before min_tokens" if params.min_tokens else ""),
        )
    after: dict[int, list[tuple[int, ...]]] = {}
    for word in words:
        if len(word) > 1:
            after.setdefault(word[-2], []).append(word)
    return TokenBans(
        _ids(allowed, device), _ids(always, device), {token: tuple(found) for token, found in after.items()}
    )


def _ids(tokens: list[int] | tuple[int, ...] | None, device: torch.device) -> torch.Tensor | None:
    """Token ids as a tensor to index rows with, once for all the request's steps; None for none."""
    return torch.tensor(sorted(set(tokens)), dtype=torch.long, device=device) if tokens else None
