"""Owns a worker's engine thread and the requests' way to it.

Greenlets call ``submit`` and ``release``; these only send commands through
the bridge. The engine thread (``EngineLoop``) posts what each step did back
through the bridge, and the ``StreamRouter`` routes it to the streams in the
hub. The manager handles the engine's lifecycle: start, readiness, failure,
graceful drain and quick shutdown.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gevent
import gevent.event

from ...engine.loading.model_loader import load_imports
from ...engine.loading.model_paths import model_name
from ...engine.loop import EngineLoop
from ...engine.messages import Abort, EngineFailed, EngineReady, EngineStopped, Stop, Submit
from ...engine.sampling_params import SamplingParams, StructuredOutput
from ...engine.text.chat_template import opens_thought, template_thinks
from .. import metrics
from ..errors import APIError
from ..settings import ServerSettings
from ..streaming.response_store import response_store
from ..streaming.stream_log import StreamLogs
from .bridge import HubBridge, front_end_busy_for
from .prompts import Prompt, prompt_ids
from .router import StreamRouter
from .streams import RequestStream

if TYPE_CHECKING:
    from ...engine.sampling.grammar import GrammarCompiler

log = logging.getLogger(__name__)

STREAM_FLUSH_SECONDS = 0.5  # for streams to write their final event before the thread stops
OPENS_THOUGHT_CACHE = 64  # distinct chat_template_kwargs remembered
RELAYED_LOGGERS = ("wsgi_infer", "transformers")  # what the engine and front-end threads log, emitted in the hub


class EngineManager:
    """``on_engine_death`` runs (in the hub) when the engine thread dies of an error
    after it was serving; under gunicorn it ends the worker so a fresh one replaces it.
    ``on_load_failure`` runs with the reason when the model (or its tokenizer) cannot load."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.on_engine_death: Callable[[], None] | None = None
        self.on_load_failure: Callable[[str], None] | None = None
        self.model_name = settings.served_model_name or model_name(settings.model or None)
        self.model_dir = ""
        self.max_model_len = 0
        self._tokenizer = None  # see the tokenizer property
        self._opens_thought: dict[str, bool] = {}  # by the template variables' JSON
        self.started_at = time.time()
        self.ready = False
        self.failure: str | None = None
        self.draining = False
        self._closing = False
        self._bridge: HubBridge | None = None
        self._loop: EngineLoop | None = None
        self._grammars: GrammarCompiler | None = None
        self.task = "generate"  # or "embed", once the engine is ready
        self.metrics = metrics.ModelMetrics(self.model_name)
        self._router = StreamRouter(
            {EngineReady: self._on_ready, EngineFailed: self._on_failed, EngineStopped: self._on_stopped},
            self.metrics,
        )
        self._ready_event = gevent.event.Event()
        self._stopped = gevent.event.Event()
        self._idle = gevent.event.Event()  # set while no request has an open response
        self._idle.set()
        self._open_streams: set[int] = set()  # responses not yet released
        self._ids = itertools.count()
        # A stream nobody has read for one heartbeat interval is abandoned (the client left).
        self.stream_logs = StreamLogs(
            settings.resume_keep_seconds,
            grace=settings.heartbeat_seconds,
            backlog_bytes=settings.stream_backlog_bytes,
            redis_url=settings.redis_url,
            metrics=self.metrics,
        )
        self.responses = response_store(settings.redis_url, settings.responses_keep_seconds)

    # --- lifecycle (hub) ---------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it loads the model, then serves. Returns at once."""
        if self._bridge is not None:
            return
        # Import what loading imports here, in the hub, so the thread creates no loggers.
        for module in load_imports(self.settings.model or None):
            importlib.import_module(module)

        self._bridge = HubBridge(self._router.deliver)
        tests_only = (self.settings.test_fault_at_step, self.settings.test_stall_after_step)
        self._loop = EngineLoop(self.settings.engine_config(), self._bridge, *tests_only)
        self._bridge.start_thread(self._loop.run, relay_loggers=RELAYED_LOGGERS)

    @property
    def alive(self) -> bool:
        """The engine thread is running (or still loading)."""
        return self._bridge is not None and not self._stopped.is_set()

    def wait_ready(self, timeout: float) -> bool:
        """Wait (cooperatively) while the model is still loading."""
        if self.alive and not self.ready and not self.failure:
            self._ready_event.wait(timeout)
        return self.ready

    @property
    def stalled(self) -> bool:
        """Requests are open but the engine thread has delivered nothing for a long time, or the front-end thread
        is stuck on one call."""
        quiet_for = time.monotonic() - self._router.last_delivery_at
        engine_stalled = bool(self._router.streams) and quiet_for > self.settings.stall_seconds
        return engine_stalled or front_end_busy_for() > self.settings.stall_seconds

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (at its current step's next layer) and end every open stream.

        Idempotent. From the hub it waits cooperatively (the hub keeps running);
        from any other thread it only asks the engine thread to stop.
        """
        if not self.alive:
            return
        self._closing = True
        self._bridge.send(Stop())
        self._loop.interrupt()  # a slow step (a crowded CPU, a long prefill) stops at its next layer
        if not self._bridge.on_hub_thread():
            return
        stopped = self._stopped.wait(timeout)
        self.end_streams()
        if stopped:
            log.info("engine thread stopped")
            self._bridge.close()
        elif not self.ready and not self.failure:  # it reads the stop once loaded, and says so through the bridge
            log.info("engine thread still loading the model: it stops once loaded")
        else:  # the bridge stays open all the same, for a later close to hear it stop
            log.error("engine thread did not stop within %.1f s", timeout)

    def drain(self, deadline: float) -> None:
        """Graceful stop (in a greenlet): refuse new work, let open requests finish for
        up to ``deadline`` seconds, end the rest with a shutdown event, stop the thread."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: %d open requests, up to %.1f s", self.num_open_requests, deadline)
        if not self._idle.wait(deadline):
            ended = self.end_streams()
            log.info("drain deadline reached: ended %d open requests with a shutdown event", ended)
            self._idle.wait(STREAM_FLUSH_SECONDS)
        self.close()
        log.info("drained")

    def shutdown_now(self) -> None:
        """Quick stop: every open stream gets its shutdown event at once, then the thread stops."""
        self.draining = True
        ended = self.end_streams()
        log.info("quick shutdown: ended %d open requests", ended)
        self._idle.wait(STREAM_FLUSH_SECONDS)
        self.close(timeout=STREAM_FLUSH_SECONDS)

    def end_streams(self) -> int:
        """Give every open stream a shutdown event; its greenlet ends the response cleanly."""
        streams = self._router.streams
        for stream in streams:
            self._router.terminate(stream, "the server is shutting down; retry the request", "server_shutting_down")
        return len(streams)

    # --- requests (hub) ---------------------------------------------------------------
    @property
    def tokenizer(self):
        """The engine's tokenizer, which every request's prompt goes through on the front-end thread (the engine
        thread only detokenizes through its Rust backend: ``messages.EngineReady``)."""
        return self._tokenizer

    @property
    def template_thinks(self) -> bool:
        """Whether the model's chat template thinks in ``<think>…</think>`` before it answers."""
        return template_thinks(self._tokenizer.chat_template if self._tokenizer is not None else None)

    def opens_thought(self, template_kwargs: dict | None) -> bool:
        """Whether the generation prompt opens the thought, for these template variables (rendered once each,
        on the front-end thread)."""
        key = json.dumps(template_kwargs or {}, sort_keys=True, default=str)
        if key not in self._opens_thought:
            if len(self._opens_thought) >= OPENS_THOUGHT_CACHE:
                self._opens_thought.clear()
            self._opens_thought[key] = self.with_tokenizer(opens_thought, template_kwargs)
        return self._opens_thought[key]

    def with_tokenizer(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(tokenizer, *args)`` on the front-end thread (call once ready, in a greenlet): a long prompt's
        tokens take tens of milliseconds, which neither the hub nor the engine thread should wait for."""
        return self._off_hub(function, self.tokenizer, *args)

    def _off_hub(self, function: Callable[..., Any], *args: Any) -> Any:
        """``run_off_hub`` within ``stall_seconds``; past them a 503 the client may retry, never a hung request."""
        try:
            return self._bridge.run_off_hub(function, *args, timeout=self.settings.stall_seconds)
        except TimeoutError as exc:
            log.error("%s (%s): the request gets a 503", exc, getattr(function, "__qualname__", function))
            message = "the server is too busy to read the request; retry later"
            raise APIError(message, 503, code="front_end_timeout", headers={"Retry-After": "5"}) from None

    def encode(self, prompts: list[Prompt]) -> list[list[int]]:
        """Each prompt's token ids, off the hub; InvalidParameter for a conversation the template refuses. Token
        ids need no tokenizer, and so no wait behind the front-end thread's queue (a burst of requests)."""
        if all(isinstance(p, list) for p in prompts):
            return prompt_ids(None, prompts)
        return self.with_tokenizer(prompt_ids, prompts)

    def compile_constraints(self, params: list[SamplingParams]) -> None:
        """Compile each constraint on the front-end thread, so that the engine thread only copies the
        result and no running stream waits for a large schema. Raises InvalidParameter; call once ready."""
        compiled: dict[int, StructuredOutput] = {}
        for p in params:
            spec = p.structured_output
            if spec is not None and spec.compiled is None:
                if id(spec) not in compiled:
                    compiled[id(spec)] = self._off_hub(self._grammars.compile, spec)
                p.structured_output = compiled[id(spec)]

    def submit(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams]) -> RequestStream:
        """Queue ``len(params)`` choices of each prompt (choice index = prompt * n + j).

        The stream's first event is Accepted or Rejected; then the choices' deltas.
        """
        # The engine keys choices by a number of ours: clients may reuse their request ids.
        stream = RequestStream(
            request_id, len(prompts) * len(params), key=str(next(self._ids)), choices_per_prompt=len(params)
        )
        self._router.add(stream)
        self._open_streams.add(id(stream))
        self._idle.clear()
        self.metrics.open_streams.inc()
        self._bridge.send(Submit(stream.key, request_id, stream.choice_ids, prompts, params))
        return stream

    def release(self, stream: RequestStream) -> None:
        """The response is over (finished, failed or the client left): abort what still runs."""
        if stream.closed:
            return
        stream.closed = True
        self.metrics.open_streams.dec()
        self._open_streams.discard(id(stream))
        if not self._open_streams:
            self._idle.set()
        self._router.remove(stream)
        unfinished = [cid for i, cid in enumerate(stream.choice_ids) if i not in stream.finish_reasons]
        if unfinished and self.alive:
            self._bridge.send(Abort(stream.request_id, unfinished))

    @property
    def num_open_requests(self) -> int:
        return len(self._open_streams)

    # --- the engine's lifecycle events (hub) -------------------------------------------------
    def _on_ready(self, event: EngineReady) -> None:
        self.max_model_len = event.max_model_len
        self.model_dir = event.model_dir
        self._grammars = event.grammars
        self.task = event.task
        self.metrics.kv_blocks_total.set(event.num_blocks)
        self.metrics.kv_blocks_free.set(event.num_blocks)
        self._tokenizer = event.tokenizer
        self.ready = True
        self._ready_event.set()
        log.info("engine ready: serving %s (context %d tokens)", self.model_name, self.max_model_len)

    def _on_failed(self, event: EngineFailed) -> None:
        self.failure = event.message
        self._ready_event.set()  # nobody waits for a model that failed
        log.error("%s\n%s", event.message, event.detail)
        if not self.ready and self.on_load_failure is not None:
            self.on_load_failure(event.message)

    def _on_stopped(self, event: EngineStopped) -> None:
        was_serving, self.ready = self.ready, False
        self._stopped.set()
        if self._closing:
            self.end_streams()
        for stream in self._router.streams:
            self._router.terminate(stream, self.failure or "the engine stopped", "engine_stopped")
        if was_serving and not self._closing and self.on_engine_death is not None:
            self.on_engine_death()
