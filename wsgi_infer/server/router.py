"""Hub side of the engine thread's output: events to the requests' streams, and metrics.

The bridge hands each delivery (a list of events from one wake-up of the
engine thread) to ``StreamRouter.deliver``, which dispatches every event by
its type. The engine's lifecycle events (ready, failed, stopped) go to
handlers the manager supplies, since they change the manager's state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from . import metrics
from .engine_messages import Aborted, Accepted, Admitted, StepDone
from .streams import ChoiceDelta, RequestStream, Terminated

log = logging.getLogger(__name__)


class StreamRouter:
    def __init__(self, lifecycle_handlers: dict[type, Callable[[Any], None]]) -> None:
        self._targets: dict[str, tuple[RequestStream, int]] = {}  # engine request id -> (stream, choice index)
        self._last_token_at: dict[str, float] = {}
        self._handlers: dict[type, Callable[[Any], None]] = {
            StepDone: self._on_step,
            Admitted: self._on_admitted,
            Aborted: self._on_aborted,
            **lifecycle_handlers,
        }
        self.last_delivery_at = time.monotonic()
        self._prefix_hit_tokens = 0  # the engine's cumulative count, as last seen

    # --- the routing table --------------------------------------------------------------
    def add(self, stream: RequestStream) -> None:
        for index, choice_id in enumerate(stream.choice_ids):
            self._targets[choice_id] = (stream, index)

    def remove(self, stream: RequestStream) -> None:
        """Stop routing to ``stream``; what the engine still sends for it is dropped."""
        for choice_id in stream.choice_ids:
            self._targets.pop(choice_id, None)
            self._last_token_at.pop(choice_id, None)

    @property
    def streams(self) -> list[RequestStream]:
        """The streams still waiting for engine output."""
        return list({id(stream): stream for stream, _ in self._targets.values()}.values())

    def terminate(self, stream: RequestStream, message: str, code: str) -> None:
        """End ``stream`` without finishing it: its greenlet sends the terminal event."""
        for choice_id in stream.choice_ids:
            self._targets.pop(choice_id, None)
        stream.push(Terminated(message, code))

    # --- deliveries -----------------------------------------------------------------------
    def deliver(self, events: list) -> None:
        self.last_delivery_at = time.monotonic()
        self._prefix_hit_tokens = 0  # the engine's cumulative count, as last seen
        for event in events:
            self._handlers[type(event)](event)

    def _on_admitted(self, event: Admitted) -> None:
        if isinstance(event.outcome, Accepted):
            metrics.prompt_tokens.inc(event.outcome.prompt_tokens)
        event.stream.push(event.outcome)

    @staticmethod
    def _on_aborted(event: Aborted) -> None:
        log.info("request %s: response ended early, aborted %d unfinished choices", event.request_id, event.num_choices)

    def _on_step(self, step: StepDone) -> None:
        now = time.monotonic()
        counters = step.counters
        metrics.num_requests_running.set(counters.num_running)
        metrics.num_requests_waiting.set(counters.num_waiting)
        metrics.kv_blocks_free.set(counters.num_free_blocks)
        metrics.kv_cache_usage_perc.set(1 - counters.num_free_blocks / counters.num_total_blocks)
        metrics.prefix_cache_hits.inc(counters.num_prefix_hit_tokens - self._prefix_hit_tokens)
        self._prefix_hit_tokens = counters.num_prefix_hit_tokens
        for delta in step.deltas:
            target = self._targets.get(delta.request_id)
            if target is None:  # released while the step ran
                continue
            stream, index = target
            previous = self._last_token_at.get(delta.request_id)
            if previous is None:
                metrics.time_to_first_token.observe(now - stream.created)
            else:
                metrics.inter_token_latency.observe(now - previous)
            self._last_token_at[delta.request_id] = now
            metrics.generation_tokens.inc(len(delta.token_ids))
            if delta.finish_reason is not None:
                metrics.request_success.labels(finished_reason=delta.finish_reason).inc()
                if len(stream.finish_reasons) + 1 == stream.num_choices:
                    metrics.e2e_request_latency.observe(now - stream.created)
            stream.push(ChoiceDelta(index, delta, step.token_texts))
