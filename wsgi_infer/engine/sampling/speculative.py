"""Speculative decoding's proposer: which tokens a sequence's next step verifies beside its own.

Prompt lookup (n-gram, vLLM's ``ngram``): the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, for the longest n in [``prompt_lookup_min``, ``prompt_lookup_max``] that occurred, in the prompt or
the output. A draft model would be another proposer with the same ``propose``: the scheduler and the verification
only see a sequence's ``draft``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..config import EngineConfig
from ..sampling_params import SamplingParams
from ..scheduling.sequence import Sequence
from .sampler import sample_token

if TYPE_CHECKING:
    from ..kernels.cpu import CpuKernels


DEFAULT_DRAFT_TOKENS = 4  # without the CPU kernels (a GPU, torch's ops)


def proposer_for(config: EngineConfig, kernels: CpuKernels | None) -> NgramProposer | None:
    """The configured proposer. By default a draft fills at most the rows that the kernels' packed multiplies compute
    in one pass over the weights, less the step's own token: one more row reads the weights again (AVX-512 VNNI, one
    stream, engine alone: 7 tokens 15% faster than 4 on the repeating workload). Within it a sequence's drafts
    grow and shrink with their acceptance (``NgramIndex.verified``)."""
    if config.speculative == "none":
        return None
    rows = kernels.rows_per_pass if kernels else None
    tokens = config.num_speculative_tokens or (rows - 1 if rows else DEFAULT_DRAFT_TOKENS)
    return NgramProposer(tokens, config.prompt_lookup_min, config.prompt_lookup_max, rows)


def speculates(seq: Sequence) -> bool:
    """Requests decoding on the model's own distribution (greedy or sampled); those with penalties, biases, banned
    tokens, grammars or logprobs, or short of their min_tokens, are not speculated, so they behave exactly as
    without it."""
    p = seq.params
    plain = not p.shapes_logits and p.logprobs is None and seq.num_output_tokens >= p.min_tokens
    return plain and seq.matcher is None and seq.num_computed_tokens == seq.num_tokens - 1


def verify_sampled(
    logits: torch.Tensor, draft: list[int], params: SamplingParams, seed: int, position: int
) -> list[int]:
    """Each row sampled as the sampler samples (the draw of the request's seed at the row's position), the draft
    accepted while it agrees: the tokens are exactly those sampling without a draft gives, whatever the draft or
    the batch, and a draft token is accepted with its probability, as in speculative sampling. ``logits``: row i
    predicts draft token i, at ``position`` + i; the last row the one after the draft."""
    tokens = []
    for row in range(len(draft) + 1):
        tokens.append(sample_token(logits[row], params, seed, position + row))
        if row == len(draft) or tokens[-1] != draft[row]:
            return tokens
    return tokens


@dataclass
class SpecCounters:
    """Cumulative, as vLLM's spec_decode_* metrics: drafts verified, their tokens, those accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1


MAX_BACKOFF = 16  # steps a sequence whose drafts keep failing goes without one, at most


@dataclass
class NgramIndex:
    """Per sequence: where each n-gram ended last (the position of the token that followed it), and how long to
    wait before the next draft after drafts that were all rejected (text that only seems to repeat)."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in ``ends``
    backoff: int = 0  # steps to skip after the next rejection
    skip: int = 0  # steps left without a draft
    length: int = 0  # the next draft's most tokens (0: as many as allowed)

    def verified(self, proposed: int, accepted: int) -> None:
        """A draft of ``proposed`` tokens was checked: any accepted token resets the backoff, none doubles it. The
        next draft may be twice as long after one accepted whole (text that repeats itself), and half as long, but
        not shorter than its accepted part and one more, after one cut short: each verified row costs arithmetic
        (16 rows take 2.2 times one row's multiplies on the shipped model, 2.6 times on a 1B, Zen 4), paid back
        only by the rows accepted."""
        if accepted:
            self.backoff = 0
        else:
            self.backoff = min(MAX_BACKOFF, max(1, 2 * self.backoff))
            self.skip = self.backoff
        self.length = 2 * proposed if accepted == proposed else max(accepted + 1, self.length // 2)


class NgramProposer:
    def __init__(self, num_tokens: int, n_min: int, n_max: int, rows_per_pass: int | None = None) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"prompt_lookup_min ({n_min}) must be at least 1 and at most prompt_lookup_max ({n_max})")
        self.num_tokens, self.n_min, self.n_max = num_tokens, n_min, n_max
        self.rows_per_pass = rows_per_pass  # the CPU kernels' (None: no such bound, as on a GPU)

    def draft_share(self, sequences: int) -> int:
        """Draft tokens each of ``sequences`` running sequences may propose this step. On the CPU kernels the
        step's decode and draft rows stay within one pass over the weights: there a verified row costs little more
        than reading them, and beyond it each row costs a whole row's arithmetic, which a batch of decodes already
        keeps busy (16 streams with 7-token drafts: 15% slower than without, AVX-512 VNNI)."""
        if self.rows_per_pass is None:
            return self.num_tokens
        return min(self.num_tokens, max(0, self.rows_per_pass - sequences) // max(1, sequences))

    @staticmethod
    def verified(seq: Sequence, proposed: int, accepted: int) -> None:
        seq.lookup.verified(proposed, accepted)

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``min(num_tokens, limit)`` tokens to verify after ``seq``'s last one, fewer as its drafts fare
        (``NgramIndex.verified``); [] when nothing matches."""
        index = seq.lookup if isinstance(seq.lookup, NgramIndex) else NgramIndex()
        seq.lookup, tokens, last = index, seq.token_ids, seq.num_tokens
        index.length = min(self.num_tokens, index.length or self.num_tokens)
        limit = min(limit, index.length)
        if limit <= 0:
            return []
        if index.skip:
            index.skip -= 1
            return []
        # Index the n-grams that have a following token: each ends before the last position.
        for end in range(max(index.indexed, self.n_min), last):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                index.ends[tuple(tokens[end - n : end])] = end
        index.indexed = max(index.indexed, last)
        for n in range(min(self.n_max, last), self.n_min - 1, -1):
            end = index.ends.get(tuple(tokens[last - n : last]))
            if end is not None:
                return tokens[end : end + limit]
        return []
