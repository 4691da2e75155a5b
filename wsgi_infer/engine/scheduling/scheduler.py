"""Which tokens of which sequences the next step computes.

Continuous batching under a per-step token budget: running sequences go first
(one token each when decoding, a chunk when still prefilling), then waiting
sequences are admitted while budget, sequence slots and KV blocks allow, in order
of priority (vLLM's: lower first), first come first served among equals. A long
prompt is cut into chunks, so running decodes wait at most one chunk. When a
running sequence needs a block and none is free, the lowest-priority sequence,
of those the most recently admitted, is preempted: its blocks are freed and it is
recomputed later from its tokens, which keeps its output unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from .kv_cache_manager import KVCacheManager, PrefixHit
from .sequence import Sequence, SequenceStatus


class StoreTier(Protocol):
    """The KV store as admission sees it (``kv_store.prefix_store``)."""

    def read_done(self, seq: Sequence) -> bool:
        """Whether the store's read of the prompt (started on its arrival) is over, or none was needed."""

    def blocks_read(self, seq: Sequence) -> Mapping[bytes, object]:
        """The prompt's blocks read from the store (waiting for the read if it is not over)."""

    def load(self, seq: Sequence, hit: PrefixHit | None) -> None:
        """After admission: fill the blocks the hit takes from the store."""


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


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        store: StoreTier | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.store = store
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0  # prompt tokens of admissions that looked in the prefix cache
        self.num_store_query_tokens = 0  # and in the KV store

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq, ahead=False)

    def _enqueue(self, seq: Sequence, ahead: bool) -> None:
        """Into the waiting queue by priority (lower first): behind its equals, or (``ahead``: preempted, it was
        admitted before them) in front of them."""
        priority = seq.params.priority
        at = next(
            (
                i
                for i, s in enumerate(self.waiting)
                if s.params.priority > priority or ahead and s.params.priority == priority
            ),
            len(self.waiting),
        )
        self.waiting.insert(at, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens + len(seq.draft), budget)
            seq.draft = seq.draft[: max(0, seq.num_computed_tokens + num_new - seq.num_tokens)]  # what fits
            while not self.kv_cache.allocate(seq, num_new):
                victim = self.running.pop(self._victim())
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                taken = next((item for item in scheduled if item.seq is victim), None)
                if taken is not None:  # scheduled earlier in this step: its tokens go back to the budget
                    scheduled.remove(taken)
                    budget += taken.num_new_tokens
                    i -= 1
            else:
                scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                i += 1
            # Else ``seq`` itself was preempted (the lowest priority): the next one now sits at ``i``.

        # Admitting new work right after preempting would only thrash the cache.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            wants_all = seq.computes_every_position
            looks_in_store = self.store is not None and not wants_all
            if looks_in_store and self.running and not self.store.read_done(seq):
                break  # running streams do not wait for the store's disk: the read is taken when it is over
            stored = self.store.blocks_read(seq) if looks_in_store else {}
            hit = None if wants_all else self.kv_cache.find_cached_prefix(seq, stored)
            num_new = min(seq.num_tokens - (hit.num_blocks * self.kv_cache.block_size if hit else 0), budget)
            if not self.kv_cache.allocate(seq, num_new, hit):
                # Alone, a prompt longer than the cache (its model slides on every layer) may find more of its
                # prefix cached than the cache can hold with its next chunk: it starts over instead of waiting.
                if self.running or hit is None:
                    break
                num_new, hit = min(seq.num_tokens, budget), None
                if not self.kv_cache.allocate(seq, num_new):
                    break
            self.waiting.popleft()
            if not wants_all and self.kv_cache.enable_prefix_caching:
                self.num_prefix_query_tokens += seq.num_tokens
            if looks_in_store:
                self.store.load(seq, hit)
                self.num_store_query_tokens += seq.num_tokens
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return scheduled

    def _victim(self) -> int:
        """The running sequence to preempt: the lowest priority (highest number), of those the latest admitted."""
        return max(range(len(self.running)), key=lambda i: (self.running[i].params.priority, i))

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache.free(seq)
        seq.draft = []
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, ahead=True)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv_cache.free(seq)
        seq.status = SequenceStatus.FINISHED
