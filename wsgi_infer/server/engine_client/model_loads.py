"""A worker's loads and unloads of its models, in the hub.

A load goes ahead when the model fits the memory budget (weights and KV caches, ``residency``) and the most
loaded at once; else the least recently used models with no open request are unloaded first. When even that
would not make room (the others are busy), the load waits for a model to go idle, as long as its requests wait.
A model with no request for its ``keep_alive`` seconds is unloaded (-1: never). The engine thread takes the
``Unload`` before any later ``Load``, so the memory is free before the next model is read. An unloaded model's
text side (tokenizer, grammar vocabulary: building them holds the GIL, seconds for a large vocabulary) stays for its
next load, while the budget has room for it; kept text sides go before any loaded model. The text sides of the
models not loaded at start are built as the worker starts (``start``), so that a first load stalls nobody.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import gevent

from ...engine.messages import EngineFailed, Load, PrepareText, TextPrepared, Unload
from .residency import Evictions, Resident, default_budget, evictions
from .served_model import ServedModel

log = logging.getLogger(__name__)

BUDGET_SETTING = "WSGI_INFER_MODELS_MEMORY_MB"


class ModelLoads:
    """``send`` queues a command for the engine thread; ``budget`` in bytes (None: ``default_budget``)."""

    def __init__(self, models: dict[str, ServedModel], send: Callable[[object], None], budget: int | None, most: int):
        self._models = models
        self._send = send
        self._budget_given = budget is not None
        self.budget = budget if budget is not None else default_budget(1)
        self._most = most
        self._waiting: dict[str, float] = {}  # models waiting for room, until a monotonic deadline
        self._started: dict[str, float] = {}  # when each load in progress was sent
        self._keep_alive: dict[str, gevent.Greenlet] = {}  # each idle model's unload, pending
        self.preparing: set[str] = set()  # models whose text side the loader thread is building

    def set_workers(self, workers: int) -> None:
        """The default budget is a share per worker: known once gunicorn's worker starts."""
        if not self._budget_given:
            self.budget = default_budget(workers)
            log.info("models' memory budget: %d MiB per worker", self.budget >> 20)

    def load(self, model: ServedModel, at_start: bool = False) -> None:
        """Load ``model`` if it fits, after unloading what must go; else wait for room (models loaded at start
        load regardless: a worker serves them or fails)."""
        if model.state in ("loading", "loaded"):
            return
        going = Evictions() if at_start else self._room_for(model)
        if going is None and model.footprint + model.text_bytes > self.budget:  # no unload ever makes room
            needs, budget = (model.footprint + model.text_bytes) >> 20, self.budget >> 20
            why = f"it needs about {needs} MiB, more than the worker's memory budget ({budget} MiB, {BUDGET_SETTING})"
            model.on_failed(EngineFailed(why, model=model.name))
            return
        if going is None:
            if not model.waiting:
                log.info("%s waits for room: the models loaded are busy", model.name)
            model.waiting = True
            self._waiting[model.name] = time.monotonic() + model.settings.load_wait_seconds
            return
        for name in going.unload:
            self.unload(self._models[name], "memory")
        for name in going.forget_text:
            log.info("letting go of %s's text side (tokenizer, grammar vocabulary): memory", name)
            self._models[name].forget_text()
        self._waiting.pop(model.name, None)
        model.waiting = False
        log.info("loading %s", model.name)
        model.loading()
        self._started[model.name] = time.monotonic()
        self._send(Load(model.name, model.settings.engine_config(), model.text))

    def start(self, prepare_texts: bool) -> None:
        """Load the models loaded at start; then, with ``prepare_texts``, have the loader thread build the other
        models' text sides (the worker is ready once it has)."""
        for model in self._models.values():
            if model.spec.preload:
                self.load(model, at_start=True)
        for model in self._models.values():
            if prepare_texts and not model.spec.preload:
                self.preparing.add(model.name)
                self._send(PrepareText(model.name, model.settings.engine_config()))

    def on_text_prepared(self, model: ServedModel, event: TextPrepared) -> None:
        """Keep the text side for the model's first load, where the budget has room for it beside the rest."""
        self.preparing.discard(model.name)
        if event.text is None:
            if model.state == "unloaded" and model.text is None:  # its load would fail as well: told now, in
                model.on_failed(EngineFailed(event.failure, model=model.name))  # /v1/models and /health
            else:
                log.warning("%s: its text side could not be built ahead of its load: %s", model.name, event.failure)
            return
        fits = evictions(event.text.memory_bytes(), self._residents(model), self.budget, 0) == Evictions()
        if model.text is None and fits:  # beside everything held, nothing let go for it
            model.text = event.text
            log.info("%s: its text side built ahead of its load", model.name)
        else:
            log.info("%s: its text side not kept: the memory budget (%d MiB) is full", model.name, self.budget >> 20)

    def unload(self, model: ServedModel, reason: str) -> bool:
        """Unload ``model`` unless it is busy (or not loaded); whether it was."""
        if model.state != "loaded" or model.busy:
            return False
        self._send(Unload(model.name))
        model.on_unloaded()
        model.metrics.model_loaded.set(0)
        model.metrics.model_unloads(reason).inc()
        log.info("unloading %s (%s)", model.name, reason)
        return True

    def on_ready(self, model: ServedModel) -> None:
        model.metrics.model_loaded.set(1)
        model.metrics.model_loads.inc()
        started = self._started.pop(model.name, None)
        if started is not None:
            model.metrics.model_load_seconds.observe(time.monotonic() - started)
        self.on_idle(model)

    def on_failed(self, model: ServedModel) -> None:
        self._started.pop(model.name, None)
        self._retry_waiting()

    def on_idle(self, model: ServedModel) -> None:
        """``model`` is not busy (any more): a waiting load may go ahead; its keep-alive starts."""
        self._retry_waiting()
        pending = self._keep_alive.pop(model.name, None)
        if pending is not None:  # one timer per model, however many requests came and went
            pending.kill(block=False)
        if model.ready and model.keep_alive >= 0 and not model.busy:
            timer = gevent.spawn_later(model.keep_alive, self._unload_if_idle, model, model.last_used)
            self._keep_alive[model.name] = timer

    def _unload_if_idle(self, model: ServedModel, used_at: float) -> None:
        self._keep_alive.pop(model.name, None)
        if model.last_used == used_at:  # no request came since the keep-alive started
            self.unload(model, "idle")

    def _retry_waiting(self) -> None:
        now = time.monotonic()
        for name, deadline in list(self._waiting.items()):
            if deadline < now:
                del self._waiting[name]
                self._models[name].waiting = False
            else:
                self.load(self._models[name])

    def _room_for(self, model: ServedModel) -> Evictions | None:
        """What must go for ``model`` (and its kept text side) to fit: loaded models, and kept text sides."""
        return evictions(model.footprint + model.text_bytes, self._residents(model), self.budget, self._most)

    def _residents(self, besides: ServedModel) -> list[Resident]:
        """The other models as the budget weighs them: those loaded (or loading), and the kept text sides."""
        residents = []
        for m in self._models.values():
            loaded = m.state in ("loading", "loaded")
            if m is not besides and (loaded or m.text is not None):
                busy = m.busy or m.state == "loading"
                residents.append(Resident(m.name, m.footprint if loaded else 0, m.last_used, busy, m.text_bytes))
        return residents
