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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...engine.messages import Aborted, Accepted, Admitted, StepDone
from ..metrics import ModelMetrics
from .streams import ChoiceDelta, RequestStream, Terminated

if TYPE_CHECKING:
    from ...engine.outputs import RequestDelta

log = logging.getLogger(__name__)


# Engine counters that only grow, and the metric each one's growth is added to.
CUMULATIVE = {
    "num_prefix_query_tokens": "prefix_cache_queries",
    "num_prefix_hit_tokens": "prefix_cache_hits",
    "num_store_query_tokens": "external_prefix_cache_queries",
    "num_store_hit_tokens": "external_prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "num_spec_drafts": "spec_decode_num_drafts",
    "num_spec_draft_tokens": "spec_decode_num_draft_tokens",
    "num_spec_accepted_tokens": "spec_decode_num_accepted_tokens",
}


@dataclass
class _ChoiceTimes:
    """A choice's times on the hub's clock, for vLLM's per-request histograms."""

    first_token_at: float
    last_token_at: float
    queue_seconds: float  # the engine's, from its add_request to the choice's first step


class StreamRouter:
    """``metrics_of`` gives a served model's metrics, by its name."""

    def __init__(
        self, lifecycle_handlers: dict[type, Callable[[Any], None]], metrics_of: Callable[[str], ModelMetrics]
    ) -> None:
        self._metrics_of = metrics_of
        self._targets: dict[str, tuple[RequestStream, int]] = {}  # engine request id -> (stream, choice index)
        self._submitted: dict[str, RequestStream] = {}  # stream key -> stream, until the engine admits it
        self._times: dict[str, _ChoiceTimes] = {}  # engine request id -> its times, from its first token
        self._handlers: dict[type, Callable[[Any], None]] = {
            StepDone: self._on_step,
            Admitted: self._on_admitted,
            Aborted: self._on_aborted,
            **lifecycle_handlers,
        }
        self.last_delivery_at = time.monotonic()
        # Each model's engine's cumulative counters, as last seen (a load starts them again).
        self._last_seen: dict[str, dict[str, int]] = {}
        self._accepted_seen: dict[str, list[int]] = {}
        # Aborts the engine has not answered, by (model, request id): their choices, in the order sent.
        self._aborting: dict[tuple[str, str], list[int]] = {}

    # --- the routing table --------------------------------------------------------------
    def add(self, stream: RequestStream) -> None:
        self._submitted[stream.key] = stream
        for index, choice_id in enumerate(stream.choice_ids):
            self._targets[choice_id] = (stream, index)

    def remove(self, stream: RequestStream) -> None:
        """Stop routing to ``stream``; what the engine still sends for it is dropped."""
        self._submitted.pop(stream.key, None)
        for choice_id in stream.choice_ids:
            self._targets.pop(choice_id, None)
            self._times.pop(choice_id, None)

    @property
    def streams(self) -> list[RequestStream]:
        """The streams still waiting for engine output."""
        return list({id(stream): stream for stream, _ in self._targets.values()}.values())

    def terminate(self, stream: RequestStream, message: str, code: str) -> None:
        """End ``stream`` without finishing it: its greenlet sends the terminal event."""
        self._submitted.pop(stream.key, None)
        for choice_id in stream.choice_ids:
            self._targets.pop(choice_id, None)
        stream.push(Terminated(message, code))

    def terminate_all(self, message: str, code: str) -> int:
        """``terminate`` every stream still waiting for engine output; how many there were."""
        streams = self.streams
        for stream in streams:
            self.terminate(stream, message, code)
        return len(streams)

    # --- deliveries -----------------------------------------------------------------------
    def deliver(self, events: list) -> None:
        self.last_delivery_at = time.monotonic()
        for event in events:
            self._handlers[type(event)](event)

    def _on_admitted(self, event: Admitted) -> None:
        stream = self._submitted.pop(event.key, None)
        if stream is not None:  # else released (or ended) while the engine admitted it
            if isinstance(event.outcome, Accepted):  # each choice's, as vLLM runs each as a request of its own
                self._metrics_of(stream.model).prompt_tokens.inc(event.outcome.prompt_tokens * stream.num_choices)
            stream.push(event.outcome)

    def abort_sent(self, model: str, request_id: str, num_choices: int) -> None:
        self._aborting.setdefault((model, request_id), []).append(num_choices)

    def engine_stopped(self) -> None:
        """The aborts the engine stopped before answering (a drain's, its step interrupted) end early all the same."""
        for (model, request_id), counts in self._aborting.items():
            for num_choices in counts:
                self.count_aborted(model, request_id, num_choices)
        self._aborting.clear()

    def _on_aborted(self, event: Aborted) -> None:
        key = (event.model, event.request_id)
        if pending := self._aborting.get(key):
            pending.pop(0)
            if not pending:
                del self._aborting[key]
        if event.num_choices:  # else the engine refused the request (a 400), or it finished as it was aborted
            self.count_aborted(event.model, event.request_id, event.num_choices)

    def count_aborted(self, model: str, request_id: str, num_choices: int) -> None:
        self._metrics_of(model).request_success("abort").inc(num_choices)  # as vLLM counts them
        log.info("request %s: response ended early, aborted %d unfinished choices", request_id, num_choices)

    def _on_step(self, step: StepDone) -> None:
        now = time.monotonic()
        self._record_counters(step)
        for delta in step.deltas:
            target = self._targets.get(delta.request_id)
            if target is None:  # released while the step ran
                continue
            stream, index = target
            self._record_delta(stream, delta, now)
            stream.push(ChoiceDelta(index, delta, step.token_texts))

    def forget(self, model: str) -> None:
        """The model was unloaded, and every step it ran is counted (the engine's steps come before its word that
        the model is gone): its gauges read zero, and its next engine counts from zero."""
        self._last_seen.pop(model, None)
        self._accepted_seen.pop(model, None)
        m = self._metrics_of(model)
        gauges = (m.kv_blocks_total, m.kv_blocks_free, m.kv_cache_usage_perc)
        for gauge in (*gauges, m.num_requests_running, m.num_requests_waiting):
            gauge.set(0)

    def _record_counters(self, step: StepDone) -> None:
        m, counters = self._metrics_of(step.model), step.counters
        last_seen = self._last_seen.setdefault(step.model, {})  # by metric
        m.num_requests_running.set(counters.num_running)
        m.num_requests_waiting.set(counters.num_waiting)
        m.kv_blocks_free.set(counters.num_free_blocks)
        if counters.num_total_blocks:  # an embedding model's engine has no KV cache
            m.kv_cache_usage_perc.set(1 - counters.num_free_blocks / counters.num_total_blocks)
        grown = {metric: getattr(counters, name) for name, metric in CUMULATIVE.items()}
        grown.update({f"kv_store_{name}": value for name, value in counters.store.items()})
        for metric, value in grown.items():
            getattr(m, metric).inc(value - last_seen.get(metric, 0))
            last_seen[metric] = value
        m.kv_store_degraded.set(int(counters.store_degraded))
        accepted_seen = self._accepted_seen.get(step.model, [])
        seen = accepted_seen + [0] * (len(counters.num_spec_accepted_per_position) - len(accepted_seen))
        for position, (accepted, before) in enumerate(zip(counters.num_spec_accepted_per_position, seen)):
            if accepted > before:
                m.accepted_at(position).inc(accepted - before)
        self._accepted_seen[step.model] = list(counters.num_spec_accepted_per_position)
        for num_tokens in step.step_tokens:
            m.iteration_tokens.observe(num_tokens)

    def _record_delta(self, stream: RequestStream, delta: RequestDelta, now: float) -> None:
        m = self._metrics_of(stream.model)
        times = self._times.get(delta.request_id)
        if times is None:
            m.time_to_first_token.observe(now - stream.created)
            if delta.queue_seconds is not None:
                m.request_queue_time.observe(delta.queue_seconds)
            times = self._times[delta.request_id] = _ChoiceTimes(now, now, delta.queue_seconds or 0.0)
        else:  # once per step, however many tokens it brought (a draft's), as vLLM observes it
            m.inter_token_latency.observe(now - times.last_token_at)
            times.last_token_at = now
        m.generation_tokens.inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            self._record_finish(m, stream, delta, times, now)

    def _record_finish(
        self, m: ModelMetrics, stream: RequestStream, delta: RequestDelta, times: _ChoiceTimes, now: float
    ) -> None:
        """A finished choice's histograms: each choice is a request, as vLLM runs each of ``n`` as one."""
        m.request_success(delta.finish_reason).inc()
        m.request_prompt_tokens.observe(delta.num_prompt_tokens)
        m.request_generation_tokens.observe(delta.num_output_tokens)
        m.e2e_request_latency.observe(now - stream.created)
        prefill = max(times.first_token_at - stream.created - times.queue_seconds, 0.0)
        decode = now - times.first_token_at
        m.request_prefill_time.observe(prefill)
        m.request_decode_time.observe(decode)
        m.request_inference_time.observe(prefill + decode)
        if delta.num_output_tokens > 1:
            m.request_time_per_output_token.observe(decode / (delta.num_output_tokens - 1))
