"""Turns logits into next tokens, each row under its own request's parameters.

A sampled token's one uniform draw is a function of its request's seed and its position in the sequence alone
(``uniform_draw``), not of a generator's history: a seeded request gives the same text whatever else shares its
batch, a draft's rows draw what plain steps would, and a generation continued from its own first tokens (its
stream continued on another host) draws what the uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ..kernels.cpu import CpuKernels
from ..outputs import TokenLogprob
from ..sampling_params import SamplingParams
from ..scheduling.sequence import Sequence
from .filters import in_bits, kept_floor, largest, weights_
from .grammar import apply_grammar_masks
from .token_bans import TokenBans


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> None:
    """In place: repetition penalty over prompt and output (HF/CTRL style),
    presence and frequency penalties over the output (OpenAI style)."""
    params = seq.params
    if params.repetition_penalty != 1.0:
        seen, _ = distinct_tokens(seq.token_ids, logits.device)
        values = logits[seen]
        penalised = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        # Finite: a penalty near 0 (1e-147) divided a logit to inf, and inf - inf drew NaN (past the vocabulary).
        logits[seen] = penalised.clamp_(max=torch.finfo(logits.dtype).max)
    if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
        tokens, counts = distinct_tokens(seq.output_token_ids, logits.device)
        logits[tokens] -= params.frequency_penalty * counts + params.presence_penalty


def distinct_tokens(token_ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct tokens of a list, and how often each comes. Through numpy: ``torch.tensor`` of a Python list
    took 0.1 ms a 600 tokens, every step of a penalised request (and a bincount over the vocabulary 0.1 ms more)."""
    tokens, counts = np.unique(np.asarray(token_ids, dtype=np.int64), return_counts=True)
    return torch.from_numpy(tokens).to(device), torch.from_numpy(counts).to(device)


def apply_logit_bias(logits: torch.Tensor, seq: Sequence) -> None:
    """In place: the request's bias added to each named token's logit."""
    bias = seq.params.logit_bias
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    logits.index_add_(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device))


def ending_tokens(params: SamplingParams, eos_token_ids: Iterable[int]) -> set[int]:
    """The tokens that end a request: its stop tokens, and the end of sequence unless it ignores that."""
    return {*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)}


def stop_reason(seq: Sequence, finish_reason: str | None, eos_token_ids: Iterable[int]) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token that ended a sequence; None where it ends otherwise (its
    end of sequence, its length, a complete grammar) or runs on."""
    if finish_reason != "stop":
        return None
    if seq.detokenizer is not None and seq.detokenizer.matched is not None:
        return seq.detokenizer.matched
    last = seq.token_ids[-1]
    eos = last in eos_token_ids and not seq.params.ignore_eos
    return last if last in seq.params.stop_token_ids and not eos else None


def bar_the_end(logits: torch.Tensor, seq: Sequence, eos_token_ids: frozenset[int]) -> None:
    """In place, before the request's min_tokens: no token that would end it."""
    ends = ending_tokens(seq.params, eos_token_ids)
    ids = torch.tensor([t for t in ends if t < logits.numel()], dtype=torch.long, device=logits.device)
    logits.index_fill_(0, ids, float("-inf"))


def prompt_logprobs(logits: torch.Tensor, targets: list[int], num_top: int) -> list[TokenLogprob]:
    """Each row's logprob of the prompt token that follows it, its rank, and the top alternatives."""
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device).unsqueeze(1))
    ranks = (logprobs > chosen).sum(1).add_(1).tolist()
    top = logprobs.topk(num_top) if num_top else None
    tops = zip(top.indices.tolist(), top.values.tolist()) if top is not None else ([] for _ in targets)
    return [
        TokenLogprob(t, lp, list(zip(*alternatives)), rank)
        for t, lp, rank, alternatives in zip(targets, chosen.squeeze(1).tolist(), ranks, tops)
    ]


_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's step: a bijection of 64-bit integers whose outputs pass BigCrush as a counter's."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uniform_draw(seed: int, position: int) -> float:
    """The draw in [0, 1) of the token at ``position`` (its index in prompt and output) of a request seeded
    ``seed``: a counter-based generator, the position counted within the seed's own stream."""
    return (_splitmix64((_splitmix64(seed & _MASK) + position) & _MASK) >> 11) * 2.0**-53


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """One token drawn from a row's distribution (temperature, then top-k, top-p and min-p) by the uniform draw of
    its request's seed and position, whichever step or draft row computed the logits."""
    bits = in_bits(logits, params.temperature)
    kept = weights_(bits, kept_floor(bits, params.top_k, params.top_p, params.min_p))
    # By the inverse of the distribution function: one uniform draw. torch.multinomial draws one random number
    # per vocabulary entry on the CPU (1 ms a row for 49,152 tokens, a third of a 32-row decode step); this takes
    # about a tenth of that. The weights need no normalising (the draw scales to their sum). In float64, so that a
    # token's share of the cumulated sum is exact to 1e-16; a token filtered out (weight 0) spans no interval.
    cumulative = kept.cumsum(-1, dtype=torch.float64)
    drawn = torch.tensor([uniform_draw(seed, position)], dtype=torch.float64, device=bits.device) * cumulative[-1]
    return int(torch.searchsorted(cumulative, drawn, right=True))


class Sampler:
    def __init__(self, kernels: CpuKernels | None = None, eos_token_ids: Iterable[int] = ()) -> None:
        self._kernels = kernels  # their argmax, for float32 logits on the CPU
        self._eos_token_ids = frozenset(eos_token_ids)

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Each row's most likely token."""
        if self._kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
            return self._kernels.argmax(logits.contiguous()).tolist()
        return logits.argmax(-1).tolist()

    @torch.inference_mode()  # the runner's logits are inference tensors, processed in place
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        """One next token per row; the logprobs the request asked for (model distribution)."""
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
        self._process(logits, seqs)
        greedy = self.greedy(logits)
        tokens: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                tokens.append(greedy[i])
                continue
            tokens.append(sample_token(logits[i], p, seq.seed, seq.num_tokens))
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, seq in enumerate(seqs):
                n = seq.params.logprobs
                if n is None:
                    continue
                values, indices = largest(raw_logprobs[i], n) if n else (torch.empty(0), torch.empty(0))
                logprobs[i] = TokenLogprob(
                    token_id=tokens[i],
                    logprob=float(raw_logprobs[i, tokens[i]]),
                    top=list(zip(indices.tolist(), values.tolist())),
                )
        return tokens, logprobs

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """In place: penalties, then logit bias, then the request's banned tokens and the end barred before
        min_tokens, then grammar masks (the raw logprobs are taken)."""
        for i, seq in enumerate(seqs):  # row views only where asked for: this runs every step
            if seq.params.has_penalties:
                apply_penalties(logits[i], seq)
            if seq.params.logit_bias:
                apply_logit_bias(logits[i], seq)
            bans: TokenBans | None = seq.bans
            before = logits[i].clone() if bans is not None and bans.could_bar_all else None
            if bans is not None:
                bans.apply(logits[i], seq.output_token_ids)
            if seq.num_output_tokens < seq.params.min_tokens:
                bar_the_end(logits[i], seq, self._eos_token_ids)
            if before is not None and not logits[i].isfinite().any():  # nothing left to sample
                logits[i] = bans.allowed_only(before)
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            apply_grammar_masks(logits, constrained, [seqs[i].matcher for i in constrained], self._kernels)
