"""A request's stream of engine output, living in the hub.

The router pushes events into a ``RequestStream`` from the bridge's
callback; the request's greenlet takes everything queued at once, so a slow
reader gets fewer, larger pieces instead of a growing backlog.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import gevent.event

from ...engine.messages import Accepted, Rejected
from .identity import ResponseIdentity

if TYPE_CHECKING:
    from ...engine.outputs import RequestDelta


@dataclass
class Terminated:
    """The request ended without finishing: engine failure or shutdown."""

    message: str
    code: str  # "server_shutting_down", "engine_stopped" or "stream_cancelled"


@dataclass
class ChoiceDelta:
    """An engine delta, tagged with the choice (n > 1) it belongs to.

    ``token_texts`` holds the text of every token id its logprobs mention (``engine.text.token_pieces``: part of a
    character as its bytes).
    """

    index: int
    delta: RequestDelta
    token_texts: dict[int, str] = field(default_factory=dict)

    def then(self, later: ChoiceDelta) -> ChoiceDelta:
        """This choice's delta followed by a later one, as one (see ``RequestDelta.then``)."""
        return ChoiceDelta(self.index, self.delta.then(later.delta), {**self.token_texts, **later.token_texts})


StreamEvent = Accepted | Rejected | Terminated | ChoiceDelta


@dataclass
class RequestStream:
    request_id: str  # the client's (or generated) X-Request-Id: for logs and response ids
    num_choices: int
    key: str  # unique per stream in this worker: the engine's request ids derive from it
    model: str = ""  # the served model's name
    choices_per_prompt: int = 1  # n: choice index = prompt * n + j
    created: float = field(default_factory=time.monotonic)
    identity: ResponseIdentity = field(default_factory=ResponseIdentity.new)  # its ids and creation time
    prompt_tokens: int = 0
    prompt_ids: list[list[int]] = field(default_factory=list)  # each prompt's token ids, as submitted
    completion_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per choice, from the prefix cache
    closed: bool = False
    on_first_token: Callable[[], None] | None = None  # its key's limits hear of it (``tenants``)
    on_close: Callable[[], None] | None = None
    # Hears each batch of engine output the reader takes, where a copy of the stream lets another host continue it
    # (``streaming.stream_record``); on that host, the batches it had taken go to the reader first.
    on_take: Callable[[list[ChoiceDelta]], None] | None = None
    _replay: deque[list[ChoiceDelta]] = field(default_factory=deque)
    _queue: list[StreamEvent] = field(default_factory=list)
    _ready: gevent.event.Event = field(default_factory=gevent.event.Event)

    def choice_id(self, index: int) -> str:
        return f"{self.key}-{index}"

    @property
    def choice_ids(self) -> list[str]:
        return [self.choice_id(i) for i in range(self.num_choices)]

    @property
    def finished(self) -> bool:
        """Every choice has ended (as pushed; its reader may not have taken it yet)."""
        return len(self.finish_reasons) == self.num_choices

    @property
    def drained(self) -> bool:
        """Every choice has ended and the reader has taken every event."""
        return self.finished and not self._queue and not self._replay

    def replay(self, batches: list[list[ChoiceDelta]]) -> None:
        """Before the engine's first output: the batches a stream continued here had taken where it ran before,
        for the reader to take first, one at a time, as it took them there (each counted as it is taken: what
        the reader sees of the counts on the way is what it saw there)."""
        self._replay.extend(batches)

    def push(self, event: StreamEvent) -> None:
        """Hub only (bridge callback or a greenlet)."""
        if isinstance(event, Accepted):
            self.prompt_tokens = event.prompt_tokens
        elif isinstance(event, ChoiceDelta):
            self._count(event)
        self._queue.append(event)
        self._ready.set()

    def cancel(self) -> None:
        """A client's stop (DELETE /v1/streams/<id>): its reader ends the stream now, in its API's shape, and
        releases it (the generation is aborted)."""
        self.push(Terminated("the stream was cancelled by a client", "stream_cancelled"))

    def _count(self, choice: ChoiceDelta) -> None:
        if choice.delta.token_ids and self.on_first_token is not None:
            self.on_first_token()
            self.on_first_token = None
        self.completion_tokens += len(choice.delta.token_ids)
        if choice.delta.finish_reason is not None:
            self.finish_reasons[choice.index] = choice.delta.finish_reason

    def wait_admission(self, timeout: float) -> Accepted | Rejected | Terminated | None:
        """The engine's answer to the submission (always the first event); None on timeout."""
        if not self._queue:
            self._ready.wait(timeout)
        if not self._queue:
            return None
        if isinstance(self._queue[0], (Accepted, Rejected)):
            return self._queue.pop(0)
        return next((e for e in self._queue if isinstance(e, Terminated)), None)

    def take(self, timeout: float | None) -> list[StreamEvent]:
        """Everything queued, waiting up to ``timeout`` seconds; [] on timeout."""
        if self._replay:
            batch = self._replay.popleft()
            for choice in batch:
                self._count(choice)
            self._note_cache_hits(batch)
            return batch
        if not self._queue:
            self._ready.wait(timeout)
        events, self._queue = self._queue, []
        self._ready.clear()
        batch = [e for e in events if isinstance(e, ChoiceDelta)]
        self._note_cache_hits(batch)
        if self.on_take is not None and batch:
            self.on_take(batch)
        return events

    def _note_cache_hits(self, batch: list[ChoiceDelta]) -> None:
        """A choice's prompt tokens from the prefix cache, as its first delta the reader takes says: on a host
        continuing the stream, the replayed one's (the engine's own may be pushed first), as where it ran before."""
        for choice in batch:
            self.cached_tokens.setdefault(choice.index, choice.delta.num_cached_tokens)

    @property
    def usage(self) -> dict:
        """Exact usage, counted from token ids; a prompt counts once, with its first choice's cache hits."""
        cached = sum(v for i, v in self.cached_tokens.items() if i % self.choices_per_prompt == 0)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def merge_deltas(events: list[StreamEvent]) -> list[ChoiceDelta]:
    """One delta per choice for a batch of events, in order of first appearance."""
    merged: dict[int, ChoiceDelta] = {}
    for event in events:
        if isinstance(event, ChoiceDelta):
            earlier = merged.get(event.index)
            merged[event.index] = event if earlier is None else earlier.then(event)
    return list(merged.values())
