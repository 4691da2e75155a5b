"""Limits per API key: requests open and queued, and requests, prompt tokens and generated tokens a minute.

A key's state (its open requests, and a bucket per per-minute limit) is one record that every worker of a server
reads and writes under a lock: in a SQLite file the gunicorn master makes (``local_store``), or in Redis when
``redis_url`` is set, where every server on it shares it (``redis_limits``). Buckets start full and refill evenly
over a minute. A request takes one request and its prompt tokens at arrival; its generated tokens are taken when
it ends, so that bucket may go below zero, and while it is there the key's next request waits. A request is
queued from its arrival to its first token. Open requests of a worker that died are dropped when the state is
next read.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from .keys import KeyPolicy

T = TypeVar("T")
# A per-minute limit: the policy's field, and the word OpenAI's x-ratelimit-* headers use for it.
BUCKETS = {
    "requests_per_minute": "requests",
    "prompt_tokens_per_minute": "tokens",
    "generated_tokens_per_minute": "output-tokens",
}


class LimitStore(Protocol):
    def update(self, key_id: str, change: Callable[[dict], T]) -> T:
        """Run ``change`` on the key's state (a JSON-able dict, {} at first) under the key's lock, and keep what
        it leaves there."""

    def alive(self, owners: set[str]) -> set[str]:
        """Of these workers (``owner`` ids), those still running."""

    @property
    def owner(self) -> str:
        """This worker's id."""


@dataclass
class Decision:
    """A request's admission: its ticket, or which limit refused it (``limit``), why, and when to retry (None:
    never, the request is larger than the limit); the x-ratelimit-* headers either way."""

    ticket: str | None
    headers: dict[str, str] = field(default_factory=dict)
    limit: str | None = None
    message: str = ""
    retry_after: float | None = None


class Ledger:
    def __init__(self, store: LimitStore, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self._clock = clock

    def admit(self, policy: KeyPolicy, prompt_tokens: int) -> Decision:
        return self.store.update(policy.id, lambda state: self._admit(state, policy, prompt_tokens))

    def started(self, policy: KeyPolicy, ticket: str) -> None:
        """The request's first token: it is no longer queued."""

        def change(state: dict) -> None:
            if ticket in state.get("open", {}):
                state["open"][ticket][1] = True

        self.store.update(policy.id, change)

    def finish(self, policy: KeyPolicy, ticket: str, generated_tokens: int) -> None:
        def change(state: dict) -> None:
            state.get("open", {}).pop(ticket, None)
            if policy.generated_tokens_per_minute:
                self._take(state, policy, "generated_tokens_per_minute", generated_tokens)

        self.store.update(policy.id, change)

    def _admit(self, state: dict, policy: KeyPolicy, prompt_tokens: int) -> Decision:
        open_requests = state.setdefault("open", {})
        gone = {owner for owner, _ in open_requests.values()} - {self.store.owner}
        dead = gone - self.store.alive(gone)
        for ticket in [t for t, (owner, _) in open_requests.items() if owner in dead]:
            del open_requests[ticket]
        refusal = self._refusal(state, policy, prompt_tokens)
        if refusal is not None:
            refusal.headers = self._headers(state, policy)
            return refusal
        self._take(state, policy, "requests_per_minute", 1)
        self._take(state, policy, "prompt_tokens_per_minute", prompt_tokens)
        ticket = uuid.uuid4().hex
        open_requests[ticket] = [self.store.owner, False]
        return Decision(ticket, self._headers(state, policy))

    def _refusal(self, state: dict, policy: KeyPolicy, prompt_tokens: int) -> Decision | None:
        open_requests = state["open"]
        if policy.max_concurrent_requests is not None and len(open_requests) >= policy.max_concurrent_requests:
            message = f"key {policy.id} has {len(open_requests)} requests open, its limit"
            return Decision(None, limit="concurrent_requests", message=message, retry_after=1.0)
        queued = sum(not started for _, started in open_requests.values())
        if policy.max_queued_requests is not None and queued >= policy.max_queued_requests:
            message = f"key {policy.id} has {queued} requests waiting for a first token, its limit"
            return Decision(None, limit="queued_requests", message=message, retry_after=1.0)
        wanted = {"requests_per_minute": 1, "prompt_tokens_per_minute": prompt_tokens, "generated_tokens_per_minute": 1}
        for name, amount in wanted.items():
            per_minute = getattr(policy, name)
            if per_minute is None:
                continue
            if amount > per_minute:
                message = f"the request's {amount} prompt tokens are more than key {policy.id}'s {per_minute} a minute"
                return Decision(None, limit=name, message=message)
            level = self._level(state, policy, name)
            if level < amount:
                message = f"key {policy.id} is over its {per_minute} {name.replace('_', ' ')}"
                return Decision(None, limit=name, message=message, retry_after=(amount - level) * 60 / per_minute)
        return None

    def _level(self, state: dict, policy: KeyPolicy, name: str) -> float:
        """The bucket's level now (refilled since it was last touched), kept in ``state``."""
        per_minute, now = getattr(policy, name), self._clock()
        level, then = state.setdefault("buckets", {}).get(name, (per_minute, now))
        level = min(per_minute, level + max(0.0, now - then) * per_minute / 60)
        state["buckets"][name] = [level, now]
        return level

    def _take(self, state: dict, policy: KeyPolicy, name: str, amount: int) -> None:
        if getattr(policy, name) is not None:
            state["buckets"][name] = [self._level(state, policy, name) - amount, self._clock()]

    def _headers(self, state: dict, policy: KeyPolicy) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the key's per-minute limits: limit, remaining, and the time until
        the bucket is full again."""
        headers = {}
        for name, word in BUCKETS.items():
            per_minute = getattr(policy, name)
            if per_minute is None:
                continue
            level = self._level(state, policy, name)
            headers[f"x-ratelimit-limit-{word}"] = str(per_minute)
            headers[f"x-ratelimit-remaining-{word}"] = str(max(0, math.floor(level)))
            headers[f"x-ratelimit-reset-{word}"] = duration((per_minute - level) * 60 / per_minute)
        return headers


def duration(seconds: float) -> str:
    """As OpenAI writes a reset time: 20ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"
