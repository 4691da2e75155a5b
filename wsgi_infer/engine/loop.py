"""An engine thread's whole life: load the model, then serve commands and steps.

It runs on a thread of its client's (the server's bridge). While idle it sleeps
on the channel's command queue (no polling, no CPU); while busy it takes every
queued command between steps. After each step it posts everything that
happened, in one list, to the client. It knows nothing of the client's side
(gevent, for the server); ``messages`` is all they share.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator
from typing import Protocol

from .config import EngineConfig
from .embedding_engine import EmbeddingEngine, is_embedding_model
from .llm_engine import LLMEngine
from .loading.model_loader import resolve_model_dir
from .messages import (
    Abort,
    Aborted,
    Accepted,
    Admitted,
    EngineFailed,
    EngineReady,
    EngineStopped,
    Rejected,
    StepDone,
    Stop,
    Submit,
)
from .outputs import RequestDelta
from .runtime.step_interrupt import StepInterrupted

log = logging.getLogger(__name__)


class Channel(Protocol):
    """The loop's way to its client (the server's ``HubBridge``)."""

    def commands(self, block: bool) -> Iterator[object]:
        """Every queued command; with ``block``, sleep until the first one."""

    def post(self, item: list) -> None:
        """Hand a list of events to the client; thread-safe."""


class EngineLoop:
    """``fault_at_step`` (tests only, from the settings) makes that step raise; after ``stall_after_step`` the loop
    takes no step until its next command (a request, an abort, a stop), as a stuck step looks from outside."""

    def __init__(
        self, config: EngineConfig, channel: Channel, fault_at_step: int = 0, stall_after_step: int = 0
    ) -> None:
        self._config = config
        self._channel = channel
        self._fault_at_step = fault_at_step
        self._stall_after_step = stall_after_step
        self._engine: LLMEngine | None = None
        self._stopping = False

    def interrupt(self) -> None:
        """From the hub, after sending ``Stop``: the step in progress stops at its next layer (see
        ``LLMEngine.interrupt``); the loop then takes the ``Stop``."""
        self._stopping = True
        if self._engine is not None:
            self._engine.interrupt()

    def run(self) -> None:
        """The thread's target: load, serve until ``Stop`` or an error, free the model."""
        post = self._channel.post
        try:
            engine = self._engine = build_engine(self._config)
            if self._stopping:  # asked while the model loaded
                engine.interrupt()
            ready = _ready(engine)
        except Exception as exc:  # a bad model path or file: reported, the worker stays up unready
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            post([EngineFailed(f"model failed to load: {first_line}", traceback.format_exc()), EngineStopped()])
            return
        post([ready])
        try:
            self._serve(engine)
        except StepInterrupted:
            engine.abort_all()  # the Stop that interrupted the step is still queued: nothing else is to be served
        except Exception as exc:
            post([EngineFailed(f"the engine failed: {type(exc).__name__}: {exc}", traceback.format_exc())])
        finally:
            # Free the model here: torch destructors must not run during interpreter shutdown.
            on_cuda = engine.device.type == "cuda"
            self._engine = None
            del engine
            if on_cuda:
                import torch

                torch.cuda.empty_cache()
            post([EngineStopped()])

    def _serve(self, engine: LLMEngine) -> None:
        step = self._step_function(engine)
        step_tokens: list[int] = []  # per step, until the next post
        steps = 0
        while True:
            outbox: list = []
            aborted: list[Aborted] = []  # delivered after the counters they changed
            stall = steps == self._stall_after_step > 0  # tests only; a Stop still ends it at once
            for command in self._channel.commands(block=stall or not engine.has_unfinished()):
                if isinstance(command, Stop):
                    engine.abort_all()
                    return
                if isinstance(command, Abort):
                    aborted.append(Aborted(command.request_id, sum(engine.abort(c) for c in command.choice_ids)))
                else:
                    outbox.append(_admit(engine, command))
            deltas = []
            if engine.has_unfinished():
                deltas = step()
                steps += 1
                step_tokens.append(engine.last_step_num_tokens)
            if outbox or deltas or aborted:
                outbox.append(StepDone(deltas, engine.counters(), _token_texts(engine, deltas), step_tokens))
                step_tokens = []
                self._channel.post(outbox + aborted)

    def _step_function(self, engine: LLMEngine) -> Callable[[], list[RequestDelta]]:
        if not self._fault_at_step:
            return engine.step
        steps = 0

        def faulty_step() -> list[RequestDelta]:
            nonlocal steps
            steps += 1
            if steps == self._fault_at_step:
                raise RuntimeError(f"fault injected at step {steps} (WSGI_INFER_TEST_FAULT_AT_STEP)")
            return engine.step()

        return faulty_step


def build_engine(config: EngineConfig) -> LLMEngine | EmbeddingEngine:
    """The engine the model needs: an embedding model's, or the generating one."""
    if is_embedding_model(resolve_model_dir(config.model)):
        return EmbeddingEngine(config)
    return LLMEngine(config)


def _ready(engine: LLMEngine | EmbeddingEngine) -> EngineReady:
    """What the hub needs of a loaded engine, including the grammar compiler."""
    return EngineReady(
        max_model_len=engine.max_model_len,
        model_dir=str(engine.model_dir),
        num_blocks=engine.counters().num_total_blocks,
        grammars=engine.grammars,
        tokenizer=engine.tokenizer,
        task=engine.task,
    )


def _admit(engine: LLMEngine, command: Submit) -> Admitted:
    """Queue every choice of every prompt (choice index = prompt * n + j), or none of them."""
    n = len(command.params)
    try:
        for i, ids in enumerate(command.prompts):
            for j, params in enumerate(command.params):
                engine.add_request(command.choice_ids[i * n + j], ids, params)
    except Exception as exc:  # one request's bad input (or our bug) must not end the engine thread
        for choice_id in command.choice_ids:
            engine.abort(choice_id)
        if isinstance(exc, ValueError):
            return Admitted(command.key, Rejected(str(exc), getattr(exc, "param", None)))
        log.exception("request %s could not be admitted", command.request_id)
        return Admitted(
            command.key, Rejected(f"the engine could not take this request: {type(exc).__name__}", status=500)
        )
    return Admitted(command.key, Accepted(sum(len(ids) for ids in command.prompts)))


def _token_texts(engine: LLMEngine, deltas: list[RequestDelta]) -> dict[int, str]:
    """The text of every token the deltas' logprobs mention (prompt ones too), decoded here, off the hub."""
    wanted = {t for d in deltas for lp in _all_logprobs(d) for t in (lp.token_id, *(i for i, _ in lp.top))}
    wanted.update(d.prompt_token_ids[0] for d in deltas if d.prompt_token_ids)  # the first has no logprob
    return {t: engine.tokenizer.decode([t]) for t in wanted}


def _all_logprobs(delta: RequestDelta) -> list:
    return (delta.logprobs or []) + (delta.prompt_logprobs or [])
