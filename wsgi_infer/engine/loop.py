"""An engine thread's whole life: serve commands and steps for every loaded model, until ``Stop``.

It runs on a thread of its client's (the server's bridge). While idle it sleeps
on the channel's command queue (no polling, no CPU); while busy it takes every
queued command between steps, then steps one model: the one that has computed
the fewest tokens (``StepSharing``); while another model serves streams, a
model's prefill is paced, so that their tokens never wait behind its long chunk.
Models load on a loader thread of their own, one at a time, so a load never
stalls the running streams' steps; the loaded engine comes back through the
command queue. After each step it posts everything that happened, in one list,
to the client. It knows nothing of the client's side (gevent, for the server);
``messages`` is all they share.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Protocol

from .config import EngineConfig, SettingError
from .embedding_engine import EmbeddingEngine
from .llm_engine import LLMEngine
from .loading.model_loader import resolve_model_dir
from .loading.model_paths import ModelLoadError, is_embedding_model
from .messages import (
    Abort,
    Aborted,
    Admitted,
    EngineFailed,
    EngineReady,
    EngineStopped,
    Load,
    Loaded,
    ModelUnloaded,
    PrepareText,
    Rejected,
    StepDone,
    Stop,
    StoreProgress,
    Submit,
    TextPrepared,
    Unload,
)
from .model_admission import admit, token_texts
from .runtime.heap import give_back_freed_memory, release_free_heap
from .runtime.native_threads import Empty, SimpleQueue, start_native_thread, start_openmp_team
from .runtime.step_interrupt import StepInterrupted
from .scheduling.fair_share import RECENT_SECONDS, FairShare
from .step_sharing import StepSharing
from .text_side import TextSide, prepared_text_side

log = logging.getLogger(__name__)

Engine = LLMEngine | EmbeddingEngine
MAX_FAILURE_CHARS = 400  # of a load's error, as its clients are told (the log has it whole)


class Channel(Protocol):
    """The loop's way to its client (the server's ``HubBridge``)."""

    def commands(self, block: bool) -> Iterator[object]:
        """Every queued command; with ``block``, sleep until the first one."""

    def post(self, item: list) -> None:
        """Hand a list of events to the client; thread-safe."""

    def send(self, command: object) -> None:
        """Queue a command for the loop itself; thread-safe (the loader thread's ``Loaded``)."""

    def start_thread(self, target: Callable[[], None]) -> None:
        """Run ``target`` on a new native thread whose log records reach the client as the loop's do."""


class EngineLoop:
    """``fault_at_step`` (tests only, from the settings) makes that step raise; ``stall_after_step`` steps after the
    last request it admitted, the loop takes no step until its next command (a request, an abort, a stop), as a
    stuck step looks from outside. Counted from the last request, not from the start: a test that starts its
    streams one after another, each awaited, then sees the stall only once all of them run, however long each
    start took (counted from the start, a slow one could find the engine already stalled, and wait for ever)."""

    def __init__(
        self, channel: Channel, fault_at_step: int = 0, stall_after_step: int = 0, load_seconds: float = 0.0
    ) -> None:
        self._channel = channel
        self._fault_at_step = fault_at_step
        self._stall_after_step = stall_after_step
        self._load_seconds = load_seconds  # tests only: every load takes this much longer, on its loader thread
        self._engines: dict[str, Engine] = {}  # loaded, in load order
        self._loads: collections.deque[Load | PrepareText] = collections.deque()  # the first one is running
        self._sharing = StepSharing()
        self._share = FairShare()  # between tenants, over every model
        self._serving_at: dict[str, float] = {}  # when each model last had requests waiting or streams decoding
        self._step_tokens: dict[str, list[int]] = collections.defaultdict(list)  # per step, until the next post
        self._steps = 0
        self._steps_since_admitted = 0  # tests only (stall_after_step)
        self._stopping = False

    def interrupt(self) -> None:
        """From the hub, after sending ``Stop``: the step in progress stops at its next layer (see
        ``LLMEngine.interrupt``); the loop then takes the ``Stop``."""
        self._stopping = True
        for engine in list(self._engines.values()):
            engine.interrupt()

    def run(self) -> None:
        """The thread's target: serve until ``Stop`` or an error, then free every model."""
        try:
            start_openmp_team()  # every thread the steps use runs before the first step
            self._serve()
        except StepInterrupted:
            pass  # the Stop that interrupted the step is still queued: nothing else is to be served
        except Exception as exc:
            failure = EngineFailed(f"the engine failed: {type(exc).__name__}: {exc}", traceback.format_exc())
            self._channel.post([failure])
        finally:
            for model in list(self._engines):  # freed here: torch's destructors must not run in interpreter shutdown
                self._unload(model, wait=True)  # (a thread still freeing tensors as the process exits aborts it)
            self._channel.post([EngineStopped()])

    def _serve(self) -> None:
        while True:
            events: list = []
            aborted: list[Aborted] = []  # delivered after the counters they changed
            touched: dict[str, None] = {}  # models whose counters changed, in order
            stall = self._steps_since_admitted == self._stall_after_step > 0  # tests only; a Stop ends it at once
            if stall:
                log.warning(
                    "step %d: stalled until the next command (test_stall_after_step: %d steps after the last request)",
                    self._steps,
                    self._stall_after_step,
                )
            for command in self._channel.commands(block=stall or not self._busy()):
                if isinstance(command, Stop):
                    return
                if isinstance(command, Abort) and command.model in self._engines:
                    aborted.append(self._abort(command))  # a method: this frame must hold no engine once unloaded
                    touched[command.model] = None
                elif isinstance(command, Submit):
                    events.append(self._admit(command))
                    self._steps_since_admitted = 0
                    touched[command.model] = None
                elif isinstance(command, StoreProgress):
                    touched[command.model] = None
                elif not isinstance(command, Abort):
                    events += self._lifecycle(command)
            self._note_serving()
            deltas, name = [], self._sharing.next(self._busy())
            if name is not None:
                deltas = self._step(name)
                touched[name] = None
            events += [self._step_done(m, deltas if m == name else []) for m in touched if m in self._engines]
            if events or aborted:
                self._channel.post(events + aborted)
            if name in self._engines:
                self._engines[name].write_stored_blocks()  # once the step's tokens are on their way

    def _abort(self, command: Abort) -> Aborted:
        engine = self._engines[command.model]
        return Aborted(command.model, command.request_id, sum(engine.abort(c) for c in command.choice_ids))

    def _busy(self) -> list[str]:
        return [name for name, engine in self._engines.items() if engine.has_unfinished()]

    def _note_serving(self) -> None:
        now = time.monotonic()
        for name, engine in self._engines.items():
            if engine.serving():
                self._serving_at[name] = now

    def _beside_others(self, model: str) -> bool:
        """Whether another model has requests waiting or streams decoding, or had a moment ago (a chat's next
        turn comes a moment after its last): ``model``'s prefill is then paced (``Scheduler``)."""
        since = time.monotonic() - RECENT_SECONDS
        return any(at >= since for name, at in self._serving_at.items() if name != model)

    def _step(self, name: str) -> list:
        engine = self._engines[name]
        self._steps += 1
        self._steps_since_admitted += 1
        if self._steps == self._fault_at_step:
            raise RuntimeError(f"fault injected at step {self._steps} (WSGI_INFER_TEST_FAULT_AT_STEP)")
        deltas = engine.step()
        self._sharing.add(name, engine.last_step_num_tokens)
        self._step_tokens[name].append(engine.last_step_num_tokens)
        return deltas

    def _step_done(self, model: str, deltas: list) -> StepDone:
        engine = self._engines[model]
        texts = token_texts(engine, deltas)
        return StepDone(model, deltas, engine.counters(), texts, self._step_tokens.pop(model, []))

    def _admit(self, command: Submit) -> Admitted:
        engine = self._engines.get(command.model)
        if engine is None:  # unloaded after the client sent the request (it waits for loads it asks for)
            return Admitted(command.key, Rejected(f"model {command.model!r} is not loaded; retry", status=503))
        return admit(engine, command)

    # --- loading and unloading -------------------------------------------------------------
    def _lifecycle(self, command: object) -> list:
        """A load (or a text side's), a loader's result or an unload; the events that say what happened."""
        if isinstance(command, Load | PrepareText):
            self._loads.append(command)
            if len(self._loads) == 1:
                self._channel.start_thread(lambda: self._load(command))
            return []
        if isinstance(command, Loaded):
            return self._on_loaded(command)
        if isinstance(command, Unload):
            return self._unload(command.model)
        raise TypeError(f"unknown command {command!r}")

    def _load(self, command: Load | PrepareText) -> None:
        """On the loader thread: build the engine (or the text side), and hand it (or the failure) to the loop."""
        try:
            if isinstance(command, PrepareText):
                text = prepared_text_side(command.config.model)
                release_free_heap()  # what building it left (a conversion's JSON): the models' budget excludes it
                self._channel.send(Loaded(command.model, text=text))
                return
            notify = lambda: self._channel.send(StoreProgress(command.model))  # noqa: E731
            beside = lambda: self._beside_others(command.model)  # noqa: E731
            engine = build_engine(command.config, self._channel.start_thread, notify, self._share, command.text, beside)
            with contextlib.suppress(Empty):  # a native wait: the server's time.sleep is gevent's
                SimpleQueue().get(timeout=self._load_seconds)
            self._channel.send(Loaded(command.model, engine))
        except Exception as exc:  # a bad model path or file: reported, the other models keep serving
            said = " ".join(str(exc).split())[:MAX_FAILURE_CHARS] or type(exc).__name__  # one line, all its parts
            said_all = isinstance(exc, (ModelLoadError, SettingError))  # a bad file or setting: its line says all
            trace = "" if said_all else traceback.format_exc()
            failure = EngineFailed(f"model failed to load: {said}", trace, command.model)
            self._channel.send(Loaded(command.model, failure=failure))

    def _on_loaded(self, loaded: Loaded) -> list:
        done = self._loads.popleft()
        if self._loads:
            following = self._loads[0]
            self._channel.start_thread(lambda: self._load(following))
        if isinstance(done, PrepareText):
            return [TextPrepared(loaded.model, loaded.text, loaded.failure.message if loaded.failure else "")]
        if loaded.failure is not None:
            return [loaded.failure]
        engine = self._engines[loaded.model] = loaded.engine
        if self._stopping:
            engine.interrupt()
        return [_ready(loaded.model, engine)]

    def _unload(self, model: str, wait: bool = False) -> list:
        """Free ``model`` before this returns (``wait``: once its KV store has written what it computed)."""
        engine = self._engines.pop(model, None)
        if engine is None:
            return []
        engine.abort_all()
        engine.close(wait=wait)
        on_cuda = engine.device.type == "cuda"
        del engine
        self._sharing.forget(model)
        self._step_tokens.pop(model, None)
        self._serving_at.pop(model, None)
        give_back_freed_memory(on_cuda)
        return [ModelUnloaded(model)]


def build_engine(
    config: EngineConfig,
    start_thread: Callable[[Callable[[], None]], None] = start_native_thread,
    notify: Callable[[], None] = lambda: None,
    share: FairShare | None = None,
    text: TextSide | None = None,
    beside: Callable[[], bool] = lambda: False,
) -> Engine:
    """The engine the model needs: an embedding model's, or the generating one (its KV store's threads started
    with ``start_thread``, ``notify`` called when they moved its counters); ``text``: its last load's text side;
    ``beside``: whether another model of the thread serves streams (its prefill is then paced)."""
    if is_embedding_model(resolve_model_dir(config.model)):
        return EmbeddingEngine(config, text)
    return LLMEngine(config, start_thread, notify, share, text, beside)


def _ready(model: str, engine: Engine) -> EngineReady:
    """What the hub needs of a loaded engine, including its text side."""
    return EngineReady(
        model=model,
        max_model_len=engine.max_model_len,
        model_dir=str(engine.model_dir),
        num_blocks=engine.counters().num_total_blocks,
        text=engine.text,
        task=engine.task,
    )
