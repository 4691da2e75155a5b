"""Owns the engine and the native thread that drives it.

Greenlets call ``submit`` and ``abort``; these only put commands into a native
queue. The engine thread sleeps on that queue while idle (no polling, no CPU),
and while busy drains it between steps. After each step it posts every delta
of the step, in one batch, to the hub through the bridge; the hub routes them
to the requests' streams and updates the metrics.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
import traceback
from _queue import SimpleQueue  # C implementation: never monkey-patched
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gevent.event

from . import metrics
from .bridge import HubBridge, emit_relayed, native_get_ident, relay_native_logs, start_native_thread
from .llm_engine import EngineCounters, LLMEngine
from .model_loader import default_model_path
from .outputs import RequestDelta
from .sampling_params import SamplingParams
from .settings import ServerSettings
from .stream_log import StreamLogs
from .streams import Accepted, ChoiceDelta, Rejected, RequestStream, Terminated

log = logging.getLogger(__name__)

Prompt = str | list[int] | list[dict]  # text, token ids, or chat messages
FAULT_ENV = "WSGI_INFER_TEST_FAULT_AT_STEP"
STALL_SECONDS = 60.0
STREAM_FLUSH_SECONDS = 0.5  # for streams to write their final event before the thread stops  # no step for this long with requests open: /health says 503


@dataclass
class _Submit:
    stream: RequestStream
    prompts: list[Prompt]
    params: list[SamplingParams]  # one per choice of each prompt (n)
    chat: bool


@dataclass
class _Abort:
    request_id: str
    choice_ids: list[str]


class _Stop:
    pass


@dataclass
class _Admitted:
    stream: RequestStream
    outcome: Accepted | Rejected


# Events from the engine thread to the hub.
@dataclass
class _EngineReady:
    max_model_len: int
    model_dir: str
    num_blocks: int


@dataclass
class _EngineFailed:
    message: str  # one line, safe to show clients
    detail: str = ""  # the traceback, for the log only


@dataclass
class _StepDone:
    deltas: list[RequestDelta]
    counters: EngineCounters
    token_texts: dict[int, str]


@dataclass
class _Aborted:
    request_id: str
    num_choices: int


class _EngineStopped:
    pass


class EngineManager:
    """``on_engine_death`` runs (in the hub) when the engine thread dies of an error
    after it was serving; under gunicorn it ends the worker so a fresh one replaces it."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.on_engine_death: Callable[[], None] | None = None
        self.draining = False
        self._closing = False
        self._hub_thread: int | None = None
        self._idle = gevent.event.Event()  # set while no request has an open stream
        self._idle.set()
        self._ready_event = gevent.event.Event()
        self.model_name = settings.served_model_name or _default_name(settings.model)
        self.model_dir = ""
        self.started_at = time.time()
        self.max_model_len = 0
        self.ready = False
        self.failure: str | None = None
        self._inbox: SimpleQueue = SimpleQueue()
        self._bridge: HubBridge | None = None
        self._thread_ident: int | None = None
        self._stopped = gevent.event.Event()
        self._started = False
        self._streams: dict[str, tuple[RequestStream, int]] = {}  # choice id -> (stream, index)
        self._open_streams: set[int] = set()  # responses not yet released
        self._last_token_at: dict[str, float] = {}
        self._ids = itertools.count()
        self.last_progress_at = time.monotonic()
        # A stream nobody has read for one heartbeat interval is abandoned (the client left).
        self.stream_logs = StreamLogs(settings.resume_keep_seconds, grace=settings.heartbeat_seconds, redis_url=settings.redis_url)

    # --- lifecycle (hub) ---------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it loads the model, then serves. Returns at once."""
        if self._started:
            return
        self._started = True
        # Import the heavy modules here, in the hub, so the thread creates no loggers.
        import transformers  # noqa: F401
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401

        self._hub_thread = native_get_ident()
        self._bridge = HubBridge(self._on_delivery)
        relay_native_logs(lambda: self._thread_ident, self._bridge, ("wsgi_infer", "transformers"))
        start_native_thread(self._run)

    @property
    def alive(self) -> bool:
        """The engine thread is running (or still loading)."""
        return self._started and not self._stopped.is_set()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (after its current step) and end every open stream.

        Idempotent. From the hub it waits cooperatively (the hub keeps running);
        from any other thread it only asks the engine thread to stop.
        """
        if not self._started or self._stopped.is_set():
            return
        self._closing = True
        self._inbox.put(_Stop())
        if native_get_ident() != self._hub_thread:
            return
        if self._stopped.wait(timeout):
            log.info("engine thread stopped")
        else:
            log.error("engine thread did not stop within %.0f s", timeout)
        self.end_streams()
        if self._bridge is not None:
            self._bridge.close()

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
        streams = {id(stream): stream for stream, _ in self._streams.values()}.values()
        for stream in streams:
            self._terminate(stream, "the server is shutting down; retry the request", "server_shutting_down")
        return len(streams)

    def wait_ready(self, timeout: float) -> bool:
        """Wait (cooperatively) while the model is still loading."""
        if self.alive and not self.ready and not self.failure:
            self._ready_event.wait(timeout)
        return self.ready

    # --- requests (hub) ---------------------------------------------------------------
    def submit(self, request_id: str, prompts: list[Prompt], params: list[SamplingParams], chat: bool = False) -> RequestStream:
        """Queue ``len(params)`` choices of each prompt (choice index = prompt * n + j).

        The stream's first event is Accepted or Rejected; then the choices' deltas.
        """
        # The engine keys choices by a number of ours: clients may reuse their request ids.
        stream = RequestStream(request_id, len(prompts) * len(params), key=str(next(self._ids)))
        for i, choice_id in enumerate(stream.choice_ids):
            self._streams[choice_id] = (stream, i)
        self._open_streams.add(id(stream))
        self._idle.clear()
        metrics.open_streams.inc()
        self._inbox.put(_Submit(stream, prompts, params, chat))
        return stream

    def release(self, stream: RequestStream) -> None:
        """The response is over (finished, failed or the client left): abort what still runs."""
        if stream.closed:
            return
        stream.closed = True
        metrics.open_streams.dec()
        self._open_streams.discard(id(stream))
        if not self._open_streams:
            self._idle.set()
        unfinished = [cid for i, cid in enumerate(stream.choice_ids) if i not in stream.finish_reasons]
        for choice_id in stream.choice_ids:
            self._streams.pop(choice_id, None)
            self._last_token_at.pop(choice_id, None)
        if unfinished and self.alive:
            self._inbox.put(_Abort(stream.request_id, unfinished))

    @property
    def num_open_requests(self) -> int:
        return len(self._open_streams)

    # --- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        self._thread_ident = native_get_ident()
        post = self._bridge.post
        try:
            engine = LLMEngine(self.settings.engine_config())
        except Exception as exc:  # a bad model path or file: reported, the worker stays up unready
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            post([_EngineFailed(f"model failed to load: {first_line}", traceback.format_exc()), _EngineStopped()])
            return
        post([_EngineReady(engine.max_model_len, str(engine.model_dir), engine.block_manager.num_blocks)])
        try:
            self._serve(engine)
        except Exception as exc:
            post([_EngineFailed(f"the engine failed: {type(exc).__name__}: {exc}", traceback.format_exc())])
        finally:
            # Free the model here: torch destructors must not run during interpreter shutdown.
            on_cuda = engine.device.type == "cuda"
            del engine
            if on_cuda:
                import torch

                torch.cuda.empty_cache()
            post([_EngineStopped()])

    def _serve(self, engine: LLMEngine) -> None:
        post = self._bridge.post
        fault_at = int(os.environ.get(FAULT_ENV, "0"))  # tests only: make step N raise
        steps = 0
        while True:
            outbox: list = []
            aborted_notices: list[_Aborted] = []  # delivered after the counters they changed
            for command in self._commands(block=not engine.has_unfinished()):
                if isinstance(command, _Stop):
                    engine.abort_all()
                    return
                if isinstance(command, _Abort):
                    aborted = sum(engine.abort(choice_id) for choice_id in command.choice_ids)
                    aborted_notices.append(_Aborted(command.request_id, aborted))
                else:
                    outbox.append(self._admit(engine, command))
            deltas: list[RequestDelta] = []
            if engine.has_unfinished():
                steps += 1
                if steps == fault_at:
                    raise RuntimeError(f"fault injected at step {steps} ({FAULT_ENV})")
                deltas = engine.step()
            if outbox or deltas or aborted_notices:
                wanted = {t for d in deltas if d.logprobs for lp in d.logprobs for t in (lp.token_id, *(i for i, _ in lp.top))}
                texts = {t: engine.tokenizer.decode([t]) for t in wanted}
                # Counters go with every delivery, so the gauges are right even when the engine goes idle.
                outbox.append(_StepDone(deltas, engine.counters(), texts))
                post(outbox + aborted_notices)

    def _commands(self, block: bool):
        if block:
            yield self._inbox.get()
        while not self._inbox.empty():
            yield self._inbox.get_nowait()

    @staticmethod
    def _admit(engine: LLMEngine, command: _Submit) -> _Admitted:
        stream, n = command.stream, len(command.params)
        try:
            prompt_ids = [
                engine.apply_chat_template(p) if command.chat else engine.tokenize(p) if isinstance(p, str) else p
                for p in command.prompts
            ]
            for i, ids in enumerate(prompt_ids):
                for j, params in enumerate(command.params):
                    engine.add_request(stream.choice_id(i * n + j), ids, params)
        except ValueError as exc:
            for choice_id in stream.choice_ids:
                engine.abort(choice_id)
            return _Admitted(stream, Rejected(str(exc)))
        return _Admitted(stream, Accepted(sum(len(ids) for ids in prompt_ids)))

    # --- deliveries (hub) --------------------------------------------------------------------
    @property
    def stalled(self) -> bool:
        """Requests are open but the engine thread has delivered nothing for a long time."""
        return bool(self._streams) and time.monotonic() - self.last_progress_at > STALL_SECONDS

    def _on_delivery(self, item) -> None:
        if isinstance(item, logging.LogRecord):
            emit_relayed(item)
            return
        self.last_progress_at = time.monotonic()
        for event in item:
            if isinstance(event, _StepDone):
                self._on_step(event)
            elif isinstance(event, _Admitted):
                if isinstance(event.outcome, Accepted):
                    metrics.prompt_tokens.inc(event.outcome.prompt_tokens)
                event.stream.push(event.outcome)
            elif isinstance(event, _Aborted):
                log.info("request %s: response ended early, aborted %d unfinished choices", event.request_id, event.num_choices)
            elif isinstance(event, _EngineReady):
                self.max_model_len = event.max_model_len
                self.model_dir = event.model_dir
                metrics.kv_blocks_total.set(event.num_blocks)
                metrics.kv_blocks_free.set(event.num_blocks)
                self.ready = True
                self._ready_event.set()
                log.info("engine ready: serving %s (context %d tokens)", self.model_name, self.max_model_len)
            elif isinstance(event, _EngineFailed):
                self.failure = event.message
                self._ready_event.set()  # nobody waits for a model that failed
                log.error("%s\n%s", event.message, event.detail)
            elif isinstance(event, _EngineStopped):
                was_serving, self.ready = self.ready, False
                self._stopped.set()
                if self._closing:
                    self.end_streams()
                for stream, _ in list(self._streams.values()):
                    self._terminate(stream, self.failure or "the engine stopped", "engine_stopped")
                if was_serving and not self._closing and self.on_engine_death is not None:
                    self.on_engine_death()

    def _on_step(self, step: _StepDone) -> None:
        now = time.monotonic()
        counters = step.counters
        metrics.num_requests_running.set(counters.num_running)
        metrics.num_requests_waiting.set(counters.num_waiting)
        metrics.kv_blocks_free.set(counters.num_free_blocks)
        metrics.kv_cache_usage_perc.set(1 - counters.num_free_blocks / counters.num_total_blocks)
        for delta in step.deltas:
            target = self._streams.get(delta.request_id)
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

    def _terminate(self, stream: RequestStream, message: str, code: str) -> None:
        for choice_id in stream.choice_ids:
            self._streams.pop(choice_id, None)
        stream.push(Terminated(message, code))


def _default_name(model: str | None) -> str:
    """What clients call the model: its directory name, or its file name without .gguf."""
    path = Path(model) if model else default_model_path()
    return path.stem if path.suffix == ".gguf" else path.name
