"""Owns a worker's engine thread, its models, and the requests' way to them.

Greenlets resolve a request's model (``model``), then call its ``submit`` and ``release``; these only send commands
through the bridge. The engine thread (``EngineLoop``) steps every loaded model and posts what each step did back
through the bridge, and the ``StreamRouter`` routes it to the streams in the hub. The manager handles the lifecycle:
start, loads and unloads, readiness, failure, graceful drain and quick shutdown.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import gevent
import gevent.event

from ...engine import messages
from ...engine.loading.model_loader import load_imports
from ...engine.loop import EngineLoop
from ...engine.messages import Abort, Stop, Submit
from ...engine.runtime.native_threads import import_modules, set_importer
from ...engine.sampling_params import SamplingParams
from ..errors import APIError
from ..model_specs import model_specs
from ..settings import ServerSettings
from ..streaming.response_store import response_store
from ..streaming.stream_log import StreamLogs
from .bridge import HubBridge, front_end_busy_for, start_front_end
from .model_loads import ModelLoads
from .open_work import OpenWork
from .router import StreamRouter
from .served_model import ServedModel
from .streams import RequestStream

log = logging.getLogger(__name__)

STREAM_FLUSH_SECONDS = 0.5  # for streams to write their final event before the thread stops
RELAYED_LOGGERS = ("wsgi_infer", "transformers")  # what the engine and front-end threads log, emitted in the hub


class EngineManager:
    """``on_engine_death`` runs (in the hub) when the engine thread dies of an error after it was serving; under
    gunicorn it ends the worker so a fresh one replaces it. ``on_load_failure`` runs with the reason when no model
    loaded at start (each failed)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.on_engine_death: Callable[[], None] | None = None
        self.on_load_failure: Callable[[str], None] | None = None
        self.models = {spec.name: ServedModel(spec, self) for spec in model_specs(settings)}
        self._names = {name: m for m in self.models.values() for name in (m.name, *m.spec.aliases)}
        self.default = next(iter(self.models.values()))  # for requests that name no model
        self.model_name = self.default.name
        self.started_at = time.time()
        self.ready = False  # the models loaded at start have loaded (one at least)
        self.failure: str | None = None
        self.draining = False
        self._closing = False
        self._bridge: HubBridge | None = None
        self._loop: EngineLoop | None = None
        self.metrics = self.default.metrics  # the worker's own series (connections, streams) carry its name
        budget = settings.models_memory_mb << 20 if settings.models_memory_mb else None
        self.loads = ModelLoads(self.models, self._send, budget, settings.max_loaded_models)
        self._router = StreamRouter(
            {
                messages.EngineReady: self._on_ready,
                messages.EngineFailed: self._on_failed,
                messages.ModelUnloaded: self._on_unloaded,
                messages.EngineStopped: self._on_stopped,
                messages.TextPrepared: self._on_text_prepared,
            },
            lambda name: self.models[name].metrics,
        )
        self._ready_event = gevent.event.Event()
        self._stopped = gevent.event.Event()
        self.open_work = OpenWork()  # what a drain waits for
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
        """Start the engine thread and load the models loaded at start. Returns at once."""
        if self._bridge is not None:
            return
        # Import what loading imports here, in the hub, so the engine's threads create no loggers.
        import_modules(tuple({m for model in self.models.values() for m in load_imports(model.spec.path)}))

        self._bridge = HubBridge(self._router.deliver, RELAYED_LOGGERS)
        set_importer(self._bridge.call_on_hub)  # what a load imports later, the hub imports
        settings = self.settings
        tests_only = (settings.test_fault_at_step, settings.test_stall_after_step, settings.test_load_seconds)
        self._loop = EngineLoop(self._bridge, *tests_only)
        self._bridge.start_thread(self._loop.run)
        start_front_end()
        self.loads.start(settings.text_sides_at_start)

    def model(self, name: str | None) -> ServedModel:
        """The model a request names (None: the default); a 404 listing the served names for any other."""
        if name is None:
            return self.default
        found = self._names.get(name)
        if found is None:
            served = ", ".join(repr(n) for n in self.models)
            message = f"model {name!r} does not exist; this server serves {served}"
            raise APIError(message, 404, param="model", code="model_not_found")
        return found

    def _send(self, command: object) -> None:
        self._bridge.send(command)

    def load(self, model: ServedModel) -> None:
        """Load ``model`` on the engine's loader thread, within the memory budget (``model.wait_ready`` waits)."""
        if self.alive and not self._closing:
            self.loads.load(model)

    def _preloads_settled(self) -> None:
        """Once every model loaded at start has loaded or failed, and every text side built at start is: ready,
        or (none loaded) failed."""
        preloads = [m for m in self.models.values() if m.spec.preload]
        if self.ready or self.failure or self.loads.preparing or any(m.state == "loading" for m in preloads):
            return
        if any(m.ready for m in self.models.values()):
            self.ready = True
            self._ready_event.set()
            return
        failures = [m.failure for m in preloads if m.failure]
        if not failures:  # none failed, none loaded (unloaded already): nothing settled yet
            return
        self.failure = failures[0]
        self._ready_event.set()
        if self.on_load_failure is not None:
            self.on_load_failure(self.failure)

    @property
    def alive(self) -> bool:
        """The engine thread is running (or still loading)."""
        return self._bridge is not None and not self._stopped.is_set()

    def wait_ready(self, timeout: float) -> bool:
        """Wait (cooperatively) while the models loaded at start are still loading."""
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
        """Stop the thread (at its current step's next layer) and end every open stream. Idempotent. From the hub
        it waits cooperatively (the hub keeps running); from any other thread it only asks the engine thread to stop."""
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
        else:  # the bridge stays open all the same, for a later close to hear it stop
            log.error("engine thread did not stop within %.1f s", timeout)

    def drain(self, deadline: float) -> None:
        """Graceful stop (in a greenlet): refuse new work, let open requests finish for up to ``deadline`` seconds,
        end the rest with a shutdown event, stop the thread."""
        if self.draining:
            return
        self._stop_waiting()
        log.info("draining: %d open requests, up to %.1f s", self.num_open_requests, deadline)
        if not self.open_work.idle.wait(deadline):
            ended = self.end_streams()
            log.info("drain deadline reached: ended %d open requests with a shutdown event", ended)
            self.open_work.idle.wait(STREAM_FLUSH_SECONDS)
        self.close()
        log.info("drained")

    def shutdown_now(self) -> None:
        """Quick stop: every open stream gets its shutdown event at once, then the thread stops."""
        self._stop_waiting()
        ended = self.end_streams()
        log.info("quick shutdown: ended %d open requests", ended)
        self.open_work.idle.wait(STREAM_FLUSH_SECONDS)
        self.close(timeout=STREAM_FLUSH_SECONDS)

    def _stop_waiting(self) -> None:
        """New work is refused, and requests waiting for a load (at start, or a model's on demand) stop waiting."""
        self.draining = True
        self._ready_event.set()
        for model in self.models.values():
            model.stop_waiting()

    def end_streams(self) -> int:
        """Give every open stream a shutdown event; its greenlet ends the response cleanly."""
        return self._router.terminate_all("the server is shutting down; retry the request", "server_shutting_down")

    # --- requests (hub) ---------------------------------------------------------------
    def submit(
        self,
        model: ServedModel,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        generated: list[list[int] | None],
    ) -> RequestStream:
        """``model.submit``: queue ``len(params)`` choices of each prompt (choice index = prompt * n + j)."""
        # The engine keys choices by a number of ours: clients may reuse their request ids.
        choices, key = len(prompts) * len(params), str(next(self._ids))
        stream = RequestStream(request_id, choices, key=key, model=model.name, choices_per_prompt=len(params))
        self._router.add(stream)
        self.open_work.add_stream(stream)
        model.count_open(stream, +1)
        model.metrics.open_streams.inc()
        self._bridge.send(Submit(model.name, stream.key, request_id, stream.choice_ids, prompts, params, generated))
        return stream

    def release(self, stream: RequestStream) -> None:
        """The response is over (finished, failed or the client left): abort what still runs."""
        if stream.closed:
            return
        stream.closed = True
        if stream.on_close is not None:
            stream.on_close()
        self._router.remove(stream)
        unfinished = [cid for i, cid in enumerate(stream.choice_ids) if i not in stream.finish_reasons]
        if unfinished and self.alive:  # before the model goes idle: an unload it starts would drop the abort
            self._bridge.send(Abort(stream.model, stream.request_id, unfinished))
            self._router.abort_sent(stream.model, stream.request_id, len(unfinished))
        elif unfinished:  # the engine stopped (it failed, or a drain ended it): no abort of its to answer
            self._router.count_aborted(stream.model, stream.request_id, len(unfinished))
        model = self.models[stream.model]
        model.count_open(stream, -1)
        model.metrics.open_streams.dec()
        model.last_used = time.monotonic()
        if not model.busy:
            self.loads.on_idle(model)
        self.open_work.discard_stream(stream)

    def let_go(self, model: ServedModel) -> None:
        """A request that named ``model`` submitted to it (its stream keeps it busy now) or ended before."""
        model.holds -= 1
        if not model.busy:
            self.loads.on_idle(model)

    @property
    def num_open_requests(self) -> int:
        return self.open_work.num_streams

    # --- the engine's lifecycle events (hub) -------------------------------------------------
    def _on_ready(self, event: messages.EngineReady) -> None:
        self.models[event.model].on_ready(event)
        self.loads.on_ready(self.models[event.model])
        self._preloads_settled()

    def _on_failed(self, event: messages.EngineFailed) -> None:
        if event.model:
            self.models[event.model].on_failed(event)
            self.loads.on_failed(self.models[event.model])
            self._preloads_settled()
            return
        self.failure = event.message
        self._ready_event.set()
        log.error("%s\n%s", event.message, event.detail)

    def _on_text_prepared(self, event: messages.TextPrepared) -> None:
        self.loads.on_text_prepared(self.models[event.model], event)
        self._preloads_settled()

    def _on_unloaded(self, event: messages.ModelUnloaded) -> None:
        self._router.forget(event.model)  # its next engine counts from zero
        log.info("model %s freed", event.model)

    def _on_stopped(self, event: messages.EngineStopped) -> None:
        was_serving, self.ready = self.ready, False
        self._stopped.set()
        if self._closing:
            self.end_streams()
        self._router.engine_stopped()
        self._router.terminate_all(self.failure or "the engine stopped", "engine_stopped")
        if was_serving and not self._closing and self.on_engine_death is not None:
            self.on_engine_death()
