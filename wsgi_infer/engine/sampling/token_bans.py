"""vLLM's ``allowed_token_ids`` and ``bad_words``: tokens a request may not sample.

``allowed_token_ids`` keeps only the listed tokens. ``bad_words`` are strings, each tokenized as it would start
the text and as it would follow a space: a spelling's last token is barred wherever the output so far ends with
the tokens before it (a one-token spelling always). vLLM bars the spelling after a space only where it has as
many tokens as the other; here it is barred however many it has (" Paris" one token, "Paris" two: the word
never comes, either way). Both act on the logits sampled from, not on the logprobs returned, which are the
model's own (as vLLM's by default).
"""

from __future__ import annotations

import torch

from ..sampling_params import InvalidParameter, SamplingParams
from ..scheduling.sequence import Sequence

Spellings = tuple[tuple[int, ...], ...]  # each bad word's spellings as token ids


def bans_tokens(seq: Sequence) -> bool:
    return seq.params.allowed_token_ids is not None or bool(seq.bad_word_ids)


def apply_bans(logits: torch.Tensor, seq: Sequence) -> None:
    """In place, on one row: every token but the allowed ones, and the bad words' next tokens, to -inf."""
    if seq.params.allowed_token_ids is not None:
        ids = torch.tensor(seq.params.allowed_token_ids, dtype=torch.long, device=logits.device)
        kept = logits[ids]
        logits.fill_(float("-inf"))
        logits[ids] = kept
    barred = barred_after(seq.bad_word_ids, seq.output_token_ids)
    if barred:
        logits.index_fill_(0, torch.tensor(barred, dtype=torch.long, device=logits.device), float("-inf"))


def barred_after(words: Spellings, output_ids: list[int]) -> list[int]:
    """The bad words' tokens that would complete one after these output tokens."""
    barred = []
    for word in words:
        before = len(word) - 1
        if before <= len(output_ids) and (not before or list(word[:-1]) == output_ids[-before:]):
            barred.append(word[-1])
    return barred


def could_bar_all(seq: Sequence) -> bool:
    """Whether a step's bans may leave a row no token: bad words beside an allowed few (the allowed tokens alone
    leave some, and so do bad words among the whole vocabulary)."""
    return bool(seq.bad_word_ids) and seq.params.allowed_token_ids is not None


def allowed_only(logits: torch.Tensor, allowed: list[int]) -> torch.Tensor:
    """A row with the allowed tokens alone kept. The sampler takes this where the bad words and the barred ends
    would leave no token at all (a bad word is then the only text left)."""
    kept = torch.full_like(logits, float("-inf"))
    ids = torch.tensor(allowed, dtype=torch.long, device=logits.device)
    kept[ids] = logits[ids]
    return kept


def bad_word_ids(params: SamplingParams, tokenizer, vocab: int, ends: set[int]) -> Spellings:
    """A request's bad words as token ids, its allowed tokens checked against the vocabulary. ``ends``: the tokens
    that end it (barred before its min_tokens). InvalidParameter where they leave it no token to sample."""
    allowed = params.allowed_token_ids
    if allowed is not None and max(allowed) >= vocab:
        raise InvalidParameter("allowed_token_ids", f"allowed_token_ids must be below the vocabulary size {vocab}")
    words = tuple(sorted({spelling for word in params.bad_words for spelling in _spellings(tokenizer, word)}))
    if allowed is not None:
        barred = {w[0] for w in words if len(w) == 1} | (ends if params.min_tokens else set())
        if set(allowed) <= barred:
            raise InvalidParameter(
                "allowed_token_ids",
                "allowed_token_ids leaves no token to sample: each is a bad word"
                + (" or ends the request before min_tokens" if params.min_tokens else ""),
            )
    return words


def _spellings(tokenizer, word: str) -> set[tuple[int, ...]]:
    """A bad word's token ids at the start of the text and after a space."""
    return {tuple(tokenizer.encode(lead + word.lstrip(), add_special_tokens=False)) for lead in ("", " ")}
