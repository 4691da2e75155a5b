"""One model a worker serves, as the hub sees it: its state, its tokenizer and its requests' way in.

States: ``unloaded`` (configured; the first request loads it), ``loading``, ``loaded``, and ``failed`` (with
its reason). The engine thread holds the model itself; this holds what the front end needs of it, kept from the
engine's ``EngineReady``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import gevent.event

from ...engine.messages import EngineFailed, EngineReady
from ...engine.sampling_params import SamplingParams, StructuredOutput
from ...engine.text.bad_words import spellings
from ...engine.text.chat_template import opens_thought, template_thinks
from .. import metrics
from ..errors import APIError
from .bridge import HubBridge
from .prompts import Prompt, prompt_ids
from .residency import footprint

if TYPE_CHECKING:
    from ...engine.text_side import TextSide
    from ..model_specs import ModelSpec
    from .streams import RequestStream

log = logging.getLogger(__name__)

OPENS_THOUGHT_CACHE = 64  # distinct chat_template_kwargs remembered
# A load that failed is tried again by a request this long after (a file still being copied, a mount back), at
# once by ``POST /v1/models/{id}/load``; meanwhile its requests are 503s saying when.
RETRY_FAILED_LOAD_SECONDS = 30.0


class ServedModel:
    """``worker`` is the worker's ``EngineManager``: it sends the model's loads and requests to the engine."""

    def __init__(self, spec: ModelSpec, worker: Any) -> None:
        self.spec = spec
        self.name = spec.name
        self.settings = spec.settings
        self._worker = worker
        self.state = "unloaded"
        self.failure: str | None = None
        self._failed_at = 0.0
        self.model_dir = ""
        self.max_model_len = 0
        self.task = spec.task  # "generate", or "embed"
        # The engine's tokenizer and grammar compiler, for the front end's prompts and constraints; kept when the
        # model unloads, for its next load, while the memory budget has room (``ModelLoads``).
        self.text: TextSide | None = None
        self._opens_thought: dict[str, bool] = {}  # by the template variables' JSON
        self._settled = gevent.event.Event()  # set while loaded or failed
        self.metrics = metrics.ModelMetrics(self.name)
        self.num_open_requests = 0
        self.num_open_choices = 0  # their choices (prompts × n each): the sequences the admission door counts
        self.holds = 0  # requests that named the model and have not submitted to it yet (``busy``)
        self.open_by_key: Counter[str] = Counter()  # of them, each API key's (``tenants``)
        self.last_used = time.monotonic()
        # Seconds it stays loaded with no request (-1: for ever): its table's, else for ever where loaded at start;
        # a request may set another for the time after it (``keep_alive``).
        configured = spec.keep_alive if spec.keep_alive is not None else -1.0 if spec.preload else None
        self.configured_keep_alive = self.settings.keep_alive if configured is None else configured
        self.keep_alive = self.configured_keep_alive
        self.footprint = footprint(spec.files, self.settings.kv_cache_memory_mb)  # bytes, estimated
        self.waiting = False  # for room in the memory budget, which models with open requests hold

    # --- state ---------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == "loaded"

    @property
    def busy(self) -> bool:
        """A request is open on the model, or on its way to it: rendering, tokenizing or compiling its constraint
        between the model's readiness and its submission. A busy model is never unloaded."""
        return bool(self.num_open_requests or self.holds)

    def count_open(self, stream: RequestStream, sign: int) -> None:
        """A stream opened (+1) or closed (-1): one request, and its choices."""
        self.num_open_requests += sign
        self.num_open_choices += sign * stream.num_choices

    def loading(self) -> None:
        self.state, self.failure = "loading", None
        self._settled.clear()

    def on_ready(self, event: EngineReady) -> None:
        if not event.num_blocks:  # an encoder has no KV cache
            self.footprint = footprint(self.spec.files, 0)
        self.max_model_len = event.max_model_len
        self.model_dir = event.model_dir
        if event.text is not self.text:  # a first load, or a new one: the template may differ
            self.text = event.text
            self._opens_thought.clear()
        self.task = event.task
        self.metrics.kv_blocks_total.set(event.num_blocks)
        self.metrics.kv_blocks_free.set(event.num_blocks)
        self.state = "loaded"
        self._settled.set()
        log.info("engine ready: serving %s (context %d tokens)", self.name, self.max_model_len)

    def on_failed(self, event: EngineFailed) -> None:
        self.state, self.failure, self._failed_at = "failed", event.message, time.monotonic()
        self._settled.set()  # nobody waits for a model that failed
        log.error("%s: %s\n%s", self.name, event.message, event.detail)

    def on_unloaded(self) -> None:
        self.state = "unloaded"  # its text side stays, for its next load
        self._settled.clear()  # its gauges read zero once the engine freed it (``StreamRouter.forget``)

    @property
    def retry_in(self) -> int:
        """Whole seconds until a request tries the failed load again (at least 1)."""
        return max(1, math.ceil(self._failed_at + RETRY_FAILED_LOAD_SECONDS - time.monotonic()))

    def stop_waiting(self) -> None:
        """The worker stops: requests waiting for the model's load stop waiting (each is told the server is
        shutting down, where it waited its load-wait time and was told the model was not loaded)."""
        self._settled.set()

    def wait_ready(self, timeout: float, retry_failed: bool = False) -> bool:
        """Wait (cooperatively) while the model loads; a request for an unloaded model loads it, and one for a
        model whose load failed a while ago (or at once, ``retry_failed``) tries again."""
        self.last_used = time.monotonic()
        if self.state == "failed" and (retry_failed or time.monotonic() >= self._failed_at + RETRY_FAILED_LOAD_SECONDS):
            self.state = "unloaded"  # its failure stays told until the next load's outcome
        if self.state == "unloaded":
            self._worker.wait_ready(timeout)  # a worker builds the text sides at start before it is ready
            self._worker.load(self)
        if self.state == "loading" or self.waiting:
            self._settled.wait(timeout)
        return self.ready

    def describe(self) -> dict:
        """The model in /v1/models: OpenAI's fields, Anthropic's (its SDK's ``models.list``), and its state."""
        created = int(self._worker.started_at)
        max_model_len = self.max_model_len or self.settings.max_model_len
        described = {
            "id": self.name,
            "object": "model",
            "created": created,
            "owned_by": "wsgi-infer",
            "type": "model",
            "display_name": self.name,
            "created_at": datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z"),
            "lifecycle": "active",
            "max_input_tokens": max_model_len,
            "root": self.model_dir or self.name,
            "parent": None,
            "aliases": list(self.spec.aliases),
            "state": self.state,
            "task": self.task,  # "generate", or "embed" for an embedding model (/v1/embeddings)
            "max_model_len": max_model_len,
        }
        if self.failure:
            described["failure"] = self.failure
        return described

    @property
    def text_bytes(self) -> int:
        """The memory its text side holds, estimated; 0 where none is kept."""
        return self.text.memory_bytes() if self.text is not None else 0

    def forget_text(self) -> None:
        """Let its text side go (for room in the memory budget): its next load builds one."""
        self.text = None

    # --- requests (hub, once ready) ---------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The engine's own (Hugging Face) tokenizer; None before the first load."""
        return self.text.tokenizer if self.text is not None else None

    @property
    def template_thinks(self) -> bool:
        """Whether the model's chat template thinks in ``<think>…</think>`` before it answers."""
        return template_thinks(self.tokenizer.chat_template if self.tokenizer is not None else None)

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

    def _off_hub(self, function: Callable[..., Any], *args: Any, beside_the_steps: bool = False) -> Any:
        """``run_off_hub`` within ``stall_seconds``; past them a 503 the client may retry, never a hung request."""
        try:
            timeout = self.settings.stall_seconds
            return HubBridge.run_off_hub(function, *args, timeout=timeout, beside_the_steps=beside_the_steps)
        except TimeoutError as exc:
            log.error("%s (%s): the request gets a 503", exc, getattr(function, "__qualname__", function))
            message = "the server is too busy to read the request; retry later"
            raise APIError(message, 503, code="front_end_timeout", headers={"Retry-After": "5"}) from None

    def encode(self, prompts: list[Prompt], keep: int | None = None) -> list[list[int]]:
        """Each prompt's token ids (its last ``keep`` at most), off the hub; InvalidParameter for a conversation the
        template refuses. Token ids need no tokenizer, and so no wait behind the front-end thread's queue (a burst
        of requests)."""
        if all(isinstance(p, list) for p in prompts):
            return prompt_ids(None, prompts, keep)
        return self.with_tokenizer(prompt_ids, prompts, keep)

    def prepare(self, params: list[SamplingParams]) -> None:
        """Compile each constraint and tokenize the bad words on the front-end thread, so that the engine thread
        only copies the result and no running stream waits for a large schema or a long list. Raises
        InvalidParameter; call once ready. The first constraint builds the grammar vocabulary, GIL-free native work
        beside the steps, at the engine's priority."""
        if params and params[0].bad_words:  # the choices share them
            ids = self.with_tokenizer(spellings, params[0].bad_words)
            for p in params:
                p.bad_word_ids = ids
        compiled: dict[int, StructuredOutput] = {}
        for p in params:
            spec = p.structured_output
            if spec is not None and spec.compiled is None:
                if not self.text.grammars.has_vocabulary():
                    self._off_hub(self.text.grammars.prepare_vocabulary, beside_the_steps=True)
                if id(spec) not in compiled:
                    compiled[id(spec)] = self._off_hub(self.text.grammars.compile, spec)
                p.structured_output = compiled[id(spec)]

    def submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        generated: list[list[int] | None] | None = None,
    ) -> RequestStream:
        """Queue ``len(params)`` choices of each prompt (choice index = prompt * n + j) on this model; ``generated``:
        a stream continued here, each choice's tokens so far (``Submit``).

        The stream's first event is Accepted or Rejected; then the choices' deltas.
        """
        self.last_used = time.monotonic()
        stream = self._worker.submit(self, request_id, prompts, params, generated or [])
        stream.prompt_ids = prompts
        return stream

    def release(self, stream: RequestStream) -> None:
        """The response is over (finished, failed or the client left): abort what still runs."""
        self._worker.release(stream)
