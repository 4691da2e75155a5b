"""Which tokens of which sequences the next step computes.

Continuous batching under a per-step token budget: running sequences go first
(one token each when decoding, a chunk when still prefilling), then waiting
sequences are admitted while budget, sequence slots and KV blocks allow. A long
prompt is cut into chunks, so running decodes wait at most one chunk. When a
running sequence needs a block and none is free, a sequence is preempted: its
blocks are freed and it is recomputed later from its tokens, which keeps its
output unchanged.

Between tenants (API keys; ``fair_share``): admission goes to the least-served
tenant with work waiting, and takes a seat or blocks from the tenant holding the
most seats per weight when none is free; while a tenant has streams decoding or
requests waiting (or had, a moment ago), every other tenant's prefill is paced
(``prefill_pacer``) so that its streams never wait behind a long chunk; a tenant
with nothing running has its first chunk read at once. While another model on the
engine thread serves streams (``beside``), every prefill is paced, first chunks too:
the engine thread steps one model at a time, so another model's tokens wait for
this model's whole step. Beside its own streams alone, a tenant's prefills (a
newcomer's first chunk too) are paced as well, but take at least the pacer's
``min_chunk`` a step: with one tenant, as without keys, a 2,048-token prompt held
every stream for each 512-token chunk. Within a tenant: priority (vLLM's: lower
first), then arrival; preemption takes the lowest priority, of those the most
recently admitted.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Protocol

from .fair_share import FairShare
from .kv_cache_manager import KVCacheManager, PrefixHit
from .prefill_pacer import PrefillPacer
from .sequence import Sequence, SequenceStatus
from .step_budget import ScheduledSequence, StepBudget


class StoreTier(Protocol):
    """The KV store as admission sees it (``kv_store.prefix_store``)."""

    def read_done(self, seq: Sequence) -> bool:
        """Whether the store's read of the prompt (started on its arrival) is over, or none was needed."""

    def blocks_read(self, seq: Sequence) -> Mapping[bytes, object]:
        """The prompt's blocks read from the store (waiting for the read if it is not over)."""

    def load(self, seq: Sequence, hit: PrefixHit | None) -> None:
        """After admission: fill the blocks the hit takes from the store."""


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        store: StoreTier | None = None,
        share: FairShare | None = None,
        pacer: PrefillPacer | None = None,
        beside: Callable[[], bool] = lambda: False,
    ) -> None:
        self.kv_cache = kv_cache
        self.store = store
        self.share = share or FairShare()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pacer = pacer or PrefillPacer(0.1, 64, max_num_batched_tokens)
        self._last_pacing = (False, 0)  # whether the last step carried paced prefill, and the allowance used up
        self.beside = beside  # whether another model on the engine thread serves streams, or did a moment ago
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0  # prompt tokens of admissions that looked in the prefix cache
        self.num_store_query_tokens = 0  # and in the KV store

    def add(self, seq: Sequence) -> None:
        self.share.join(seq)
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

    def serving(self) -> bool:
        """Requests waiting or streams decoding: what another model's long chunk would keep waiting."""
        return bool(self.waiting) or any(not seq.prefills for seq in self.running)

    def schedule(self) -> list[ScheduledSequence]:
        beside = self.beside()
        step = StepBudget(
            self.max_num_batched_tokens,
            sum(not seq.prefills for seq in self.running),
            self._paced_prefills(beside),
        )
        scheduled: list[ScheduledSequence] = []
        preempted = self._schedule_running(step, scheduled)
        self._admit_waiting(step, scheduled, preempted, beside)
        for item in scheduled:
            self.share.charge(item.seq.tenant, item.num_new_tokens)
        self._last_pacing = (step.paced > 0, step.used_up())
        return scheduled

    def _schedule_running(self, step: StepBudget, scheduled: list[ScheduledSequence]) -> bool:
        """Each running sequence's tokens, as the budget allows; True if KV pressure preempted any."""
        preempted, i = False, 0
        while i < len(self.running) and step.tokens > 0:
            seq = self.running[i]
            num_new = step.fit(seq, seq.num_tokens - seq.num_computed_tokens + len(seq.draft))
            if num_new <= 0:  # a prefill that waits: for the decodes after it, or for its tenant's paced share
                i += 1
                continue
            seq.draft = seq.draft[: max(0, seq.num_computed_tokens + num_new - seq.num_tokens)]  # what fits
            while not self.kv_cache.allocate(seq, num_new):
                at = self._victim()
                self._preempt_running(at, scheduled, step)
                preempted = True
                if at < i:
                    i -= 1
                elif at == i:
                    break  # ``seq`` itself was preempted: the next one now sits at ``i``
            else:
                scheduled.append(ScheduledSequence(seq, num_new))
                step.take(seq, num_new)
                i += 1
        return preempted

    def _admit_waiting(
        self, step: StepBudget, scheduled: list[ScheduledSequence], preempted: bool, beside: bool
    ) -> None:
        """Admit waiting sequences, the least-served tenant's first, while the step has room (``beside``: another
        model serves streams, so that first chunks are paced too)."""
        made_room_for = None  # the sequence another tenant just gave a seat or blocks to
        full: set[str] = set()  # tenants whose paced share of this step is taken
        while step.tokens > 0:
            seats = Counter(s.tenant for s in self.running)
            seq = self._next_waiting(full, seats)
            if seq is None:
                break
            rival = self.share.seat_victim(seq.tenant, seats)  # who gives it a seat or blocks, if anyone
            if preempted and rival is None and seq is not made_room_for:
                break  # admitting new work right after preempting would only thrash the cache
            if len(self.running) >= self.max_num_seqs:
                if rival is None:
                    break
                self._preempt_running(self._victim(rival), scheduled, step)
                preempted, made_room_for = True, seq
                continue
            wants_all = seq.computes_every_position
            looks_in_store = self.store is not None and not wants_all
            if looks_in_store and self.running and not self.store.read_done(seq):
                break  # running streams do not wait for the store's disk: the read is taken when it is over
            stored = self.store.blocks_read(seq) if looks_in_store else {}
            hit = None if wants_all else self.kv_cache.find_cached_prefix(seq, stored)
            paced = beside or bool(seats[seq.tenant])  # a tenant with nothing running has its first chunk at once
            num_new = step.fit(seq, seq.num_tokens - (hit.num_blocks * self.kv_cache.block_size if hit else 0), paced)
            if num_new <= 0:
                full.add(seq.tenant)
                continue
            if not self.kv_cache.allocate(seq, num_new, hit):
                if rival is not None:
                    self._preempt_running(self._victim(rival), scheduled, step)
                    preempted, made_room_for = True, seq
                    continue
                # Alone, a prompt longer than the cache (its model slides on every layer) may find more of its
                # prefix cached than the cache can hold with its next chunk: it starts over instead of waiting.
                if self.running or hit is None:
                    break
                num_new, hit = min(seq.num_tokens, step.tokens), None
                if not self.kv_cache.allocate(seq, num_new):
                    break
            self._admit(seq, hit, wants_all, looks_in_store)
            scheduled.append(ScheduledSequence(seq, num_new))
            step.take(seq, num_new, paced)

    def step_took(self, seconds: float) -> None:
        """The engine computed the last scheduled step in ``seconds``: the pacer learns from the paced ones."""
        paced, used_up = self._last_pacing
        if paced:
            self.pacer.observe(seconds, used_up)

    def _admit(self, seq: Sequence, hit: PrefixHit | None, wants_all: bool, looks_in_store: bool) -> None:
        self.waiting.remove(seq)
        if not wants_all and self.kv_cache.enable_prefix_caching:
            self.num_prefix_query_tokens += seq.num_tokens
        if looks_in_store:
            self.store.load(seq, hit)
            self.num_store_query_tokens += seq.num_tokens
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _next_waiting(self, full: set[str], seats: Counter[str]) -> Sequence | None:
        """The first waiting sequence (by priority, then arrival) of the least-served tenant with one waiting, of
        those not ``full`` (``seats``: each tenant's running sequences)."""
        firsts: dict[str, Sequence] = {}
        for seq in self.waiting:
            if seq.tenant not in full:
                firsts.setdefault(seq.tenant, seq)
        if not firsts:
            return None
        return firsts[self.share.least_served(firsts, seats)]

    def _paced_prefills(self, beside: bool) -> dict[str, int]:
        """The prefill tokens each paced tenant's prefills may take this step: every tenant with work is paced
        while another one (or another model: ``beside``) has streams decoding or requests waiting, or had until a
        moment ago; a tenant with streams of its own decoding, to the pacer's ``own_tokens`` otherwise."""
        active = {seq.tenant for seq in self.running} | {seq.tenant for seq in self.waiting}
        if beside:
            return dict.fromkeys(active, self.pacer.tokens)
        decoding = {seq.tenant for seq in self.running if not seq.prefills}
        served = decoding | {seq.tenant for seq in self.waiting} | self.share.recently_present()
        paced = {tenant: self.pacer.own_tokens for tenant in active & decoding}
        return paced | {tenant: self.pacer.tokens for tenant in active if served - {tenant}}

    def _victim(self, tenant: str | None = None) -> int:
        """The running sequence to preempt: of ``tenant``'s (default: the tenant holding the most seats per
        weight, with one tenant any), the lowest priority (highest number), of those the latest admitted."""
        if tenant is None:
            seats = Counter(seq.tenant for seq in self.running)
            tenant = max(seats, key=lambda t: (seats[t] / self.share.weight(t), self.share.served(t)))
        candidates = (i for i, seq in enumerate(self.running) if seq.tenant == tenant)
        return max(candidates, key=lambda i: (self.running[i].params.priority, i))

    def _preempt_running(self, at: int, scheduled: list[ScheduledSequence], step: StepBudget) -> None:
        """Preempt ``running[at]``; if it was scheduled earlier in this step, its tokens go back to the budget."""
        victim = self.running.pop(at)
        taken = next((item for item in scheduled if item.seq is victim), None)
        if taken is not None:
            scheduled.remove(taken)
            step.tokens += taken.num_new_tokens
        self._preempt(victim)

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
        if seq.status is not SequenceStatus.FINISHED:
            self.share.leave(seq)
        self.kv_cache.free(seq)
        seq.status = SequenceStatus.FINISHED
