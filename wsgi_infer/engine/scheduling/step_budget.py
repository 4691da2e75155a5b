"""What one engine step computes (``ScheduledSequence``) and what it may still compute while the scheduler fills it
(``StepBudget``)."""

from __future__ import annotations

from dataclasses import dataclass

from .sequence import Sequence


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last token (and maybe its draft), so it samples a new one."""
        return self.seq.num_computed_tokens + self.num_new_tokens >= self.seq.num_tokens

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens this step verifies after the sequence's last one."""
        return max(0, self.seq.num_computed_tokens + self.num_new_tokens - self.seq.num_tokens)


@dataclass
class StepBudget:
    """What one step may still compute: tokens (a token kept for each running decode not yet scheduled, so that
    no prefill ahead of it in the batch takes its turn), and the paced prefill tokens each tenant may still take
    (none: unpaced)."""

    tokens: int
    decodes: int
    prefill_left: dict[str, int]
    paced: int = 0  # paced prefill tokens taken

    def __post_init__(self) -> None:
        self.allowed = dict(self.prefill_left)

    def used_up(self) -> int:
        """The largest paced allowance a tenant took in full this step (0: none)."""
        return max((self.allowed[tenant] for tenant, left in self.prefill_left.items() if left <= 0), default=0)

    def fit(self, seq: Sequence, wanted: int, paced: bool = True) -> int:
        """``paced``: False for a tenant's first chunk when it has nothing running (its turn to be served)."""
        if not seq.prefills:
            self.decodes = max(0, self.decodes - 1)
            return min(wanted, self.tokens)
        num_new = min(wanted, self.tokens - self.decodes)
        return min(num_new, self.prefill_left[seq.tenant]) if paced and seq.tenant in self.prefill_left else num_new

    def take(self, seq: Sequence, num_new: int, paced: bool = True) -> None:
        self.tokens -= num_new
        if paced and seq.tenant in self.prefill_left and seq.prefills:
            self.prefill_left[seq.tenant] -= num_new
            self.paced += num_new
