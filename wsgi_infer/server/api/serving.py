"""What every generation route does: admit, submit, then stream or collect.

Runs in the request's greenlet; waiting is cooperative (gevent), and the
engine work happens on the manager's thread.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

from flask import Response, current_app, g, request

from ...engine.messages import Accepted, Rejected
from ...engine.sampling_params import InvalidParameter, SamplingParams, max_tokens_within, tokens_to_keep
from ..client_connection import LOOK_SECONDS, until_gone, while_connected
from ..engine_client.delta_records import encode_batch
from ..engine_client.extension import manager_of
from ..engine_client.manager import EngineManager
from ..engine_client.prompts import Prompt
from ..engine_client.served_model import ServedModel
from ..engine_client.streams import ChoiceDelta, RequestStream, Terminated, merge_deltas
from ..errors import APIError
from ..streaming import sse
from ..streaming.redis_reader import RedisStreamReader
from ..streaming.redis_store import StoreUnavailable
from ..streaming.stream_log import StreamInterrupted, StreamLog
from ..streaming.stream_record import RequestRecord, StreamRecord
from .access import require_admin
from .admission import admit_key, tenants, through_the_door
from .continuation import Continuation, continuer

ADMISSION_TIMEOUT_S = 60.0


def manager() -> EngineManager:
    return manager_of(current_app)


def served(name: str | None, keep_alive: float | None = None) -> ServedModel:
    """The model the request names (None: the default model); a 404 ``model_not_found`` for any other.
    ``keep_alive`` (the request's, as Ollama takes it): how long the model stays loaded once idle after it; without
    one, the model's configured keep-alive."""
    model = manager().model(name)
    if keep_alive is not None:
        require_admin("set keep_alive", param="keep_alive")
    model.keep_alive = model.configured_keep_alive if keep_alive is None else keep_alive
    model.holds += 1  # busy from here: no load of another model unloads it before this request submits
    g.setdefault("held", []).append(model)
    return model


def let_go_of_models() -> None:
    """The request's holds on the models it named end: when it submits (its stream keeps the model busy from then
    on), or when it ends without."""
    for model in g.pop("held", ()):
        manager().let_go(model)


def model_of(stream: RequestStream) -> ServedModel:
    """The model a stream runs on."""
    return manager().models[stream.model]


def wait_ready(model: ServedModel, retry_failed: bool = False) -> None:
    """A model that is loading (a worker just started, a reload, a request for an unloaded model, which loads it)
    holds the request a while."""
    if model.wait_ready(model.settings.load_wait_seconds, retry_failed):
        return
    if manager().draining:  # as new work is turned away: its client retries on a worker that stays
        stopping = "the server is shutting down; retry the request"
        raise APIError(stopping, 503, code="server_shutting_down", headers={"Retry-After": "1"})
    if model.state == "failed":
        retry = {"Retry-After": str(model.retry_in)}
        raise APIError(f"model {model.name!r}: {model.failure}", 503, code="model_load_failed", headers=retry)
    if model.waiting:
        budget = manager().loads.budget >> 20
        message = f"model {model.name!r} waits for room: models with open requests hold the memory ({budget} MiB)"
        raise APIError(message, 503, code="model_not_ready", headers={"Retry-After": "5"})
    raise APIError(f"model {model.name!r} is not loaded", 503, code="model_not_ready", headers={"Retry-After": "5"})


TASK_ROUTES = {"generate": "/v1/completions, /v1/chat/completions and the like", "embed": "/v1/embeddings"}


def require_task(model: ServedModel, task: str) -> None:
    """A generation route for an embedding model, or the other way round, is a 400 saying what the model serves,
    before it waits (the task is known from the model's files: a wrong route loads nothing)."""
    if model.task != task:
        raise APIError(
            f"the model {model.name} serves {TASK_ROUTES[model.task]}, not this route", code="wrong_model_task"
        )
    wait_ready(model)


def start(
    model: ServedModel, prompts: list[Prompt], params: list[SamplingParams], task: str | None = "generate"
) -> RequestStream:
    """Compile the constraint, tokenize, submit and wait for the engine to accept; raise the right APIError
    otherwise (InvalidParameter for bad input, which errors.py renders). ``task``: the model's it needs (None:
    either)."""
    if task is None:
        wait_ready(model)
    else:
        require_task(model, task)  # waits for readiness too
    with through_the_door(model, len(prompts) * len(params)):
        model.prepare(params)
        prompt_ids = model.encode(prompts, tokens_to_keep(params[0], model.max_model_len))
        for index, ids in enumerate(prompt_ids):  # as the engine would, but a long prompt costs its thread nothing
            try:
                max_tokens_within(len(ids), params[0], model.max_model_len)
            except InvalidParameter as exc:
                exc.index = index  # for a route that names its inputs one by one
                raise
        ticket = admit_key(model, params, sum(map(len, prompt_ids)))
        continuation: Continuation | None = g.get("continuation")
        generated = continuation.generated(len(prompt_ids) * len(params)) if continuation else None
        stream = model.submit(g.request_id, prompt_ids, params, generated)
    stream.identity = g.setdefault("identity", stream.identity)  # a continued stream's, drawn where it began
    if continuation is not None:
        stream.replay(continuation.batches)
    let_go_of_models()
    if "key" in g:
        tenants().track(g.key, ticket, stream, model)
    try:
        outcome = stream.wait_admission(ADMISSION_TIMEOUT_S)
        if isinstance(outcome, Rejected) and outcome.status == 400:  # bad input: rendered as every other
            raise InvalidParameter(outcome.param, outcome.message)
        if isinstance(outcome, Rejected):  # the engine failed on this request (or its model just went)
            raise APIError(
                outcome.message, outcome.status, headers={"Retry-After": "1"} if outcome.status == 503 else None
            )
        if isinstance(outcome, Terminated):
            raise APIError(outcome.message, 503, code=outcome.code, headers={"Retry-After": "5"})
        if not isinstance(outcome, Accepted):
            raise APIError(
                "the engine did not answer in time", 503, code="engine_timeout", headers={"Retry-After": "5"}
            )
    except BaseException:
        model.release(stream)
        raise
    return stream


class Heartbeat:
    """Nothing to send for a while: the caller writes a keep-alive."""


def iter_deltas(stream: RequestStream, heartbeat: float) -> Iterator[list[ChoiceDelta] | Heartbeat]:
    """Per wake-up, one merged delta per choice that has something to show.

    A delta with no text yet (an incomplete character, or text held back as a
    possible stop string) waits for the next one unless it ends its choice.
    Raises StreamInterrupted when the engine stops or fails. The caller must
    ``manager().release(stream)`` when done, also on error or disconnect.
    """
    carry: list[ChoiceDelta] = []
    # Not `finished`: the last pieces may be pushed while the caller is busy with earlier ones.
    while not stream.drained:
        events = stream.take(heartbeat)
        if not events:
            yield Heartbeat()
            continue
        stop = next((e for e in events if isinstance(e, Terminated)), None)
        pending, ready, carry = carry + events, [], []
        for choice in merge_deltas(pending):
            (ready if choice.delta.text or choice.delta.finish_reason else carry).append(choice)
        if ready:
            yield ready
        if stop is not None:
            raise StreamInterrupted(stop.message, stop.code)


def pumped(mgr: ServedModel, stream: RequestStream) -> Iterator[list[ChoiceDelta] | None]:
    """``iter_deltas`` for a pump greenlet: None for a quiet heartbeat interval, StreamInterrupted once the
    stream is abandoned (released: nobody reads it any more); the stream is released when done."""
    try:
        for batch in iter_deltas(stream, mgr.settings.heartbeat_seconds):
            if not isinstance(batch, Heartbeat):
                yield batch
            elif stream.closed:
                raise StreamInterrupted("nobody read this stream for a while; generation aborted", "stream_abandoned")
            else:
                yield None
    finally:
        mgr.release(stream)


def pumped_choices(mgr: ServedModel, stream: RequestStream) -> Iterator[ChoiceDelta | None]:
    """``pumped``, one choice's merged delta at a time; None for a quiet heartbeat interval."""
    for batch in pumped(mgr, stream):
        yield from (None,) if batch is None else batch


def log_response(log: StreamLog | RedisStreamReader, after: int, stream_id: str) -> Response:
    """A stream log's events after id ``after``, as the response's SSE body."""
    headers = {**sse.STREAM_HEADERS, "X-Stream-Id": stream_id}
    events = until_gone(log.read(after, manager().settings.heartbeat_seconds), request.environ)
    return Response(events, mimetype="text/event-stream", headers=headers)


def _tenant_key(stream_id: str) -> str:
    """Where a stream is kept: under the API key that created it, so that another key never finds it."""
    tenant = g.get("tenant")
    return f"{tenant}.{stream_id}" if tenant else stream_id


def published_log(stream_id: str) -> StreamLog | RedisStreamReader:
    """The stream this request's API key published under ``stream_id``; a 404 for any other."""
    key = _tenant_key(stream_id)
    try:
        log = manager().stream_logs.get(key)
        gone = log is None or (log.api == "responses" and _response_gone(log, stream_id))
    except StoreUnavailable as exc:
        raise APIError(str(exc), 503, code="store_unavailable", headers={"Retry-After": "1"}) from None
    if gone:
        raise APIError(
            f"stream {stream_id!r} is unknown or has expired", 404, param="stream_id", code="stream_not_found"
        )
    if isinstance(log, RedisStreamReader):
        log.continue_here = continuer(key)  # should the host generating it be gone
    return log


def _response_gone(log: StreamLog | RedisStreamReader, response_id: str) -> bool:
    """A response's stream is read while it runs, then while the response is stored: not once deleted, nor at all
    after its end with ``store: false``. Raises StoreUnavailable."""
    return log.finished and manager().responses.get(response_id, g.get("tenant", "")) is None


def publish(
    stream: RequestStream, events: Iterator[str | None], stream_id: str | None = None, api: str = "openai"
) -> Response:
    """A streamed response: a pump greenlet owns the generation and records its events; this response, and any
    resume of it (``published_log``), only read that log, so a dropped connection loses nothing. ``api``: the shape
    of its events (``stream_endings.API_SHAPES``)."""
    return log_response(*publish_log(stream, events, stream_id, api))


def publish_log(
    stream: RequestStream, events: Iterator[str | None], stream_id: str | None = None, api: str = "openai"
) -> tuple[StreamLog, int, str]:
    """``publish``'s log, the event id to read after, and the stream's id. With copies in Redis, the log keeps what
    another host needs to continue it (``streaming.stream_record``); a continued stream keeps its own id."""
    mgr, stream_id, continuation = manager(), stream_id or uuid.uuid4().hex, g.get("continuation")
    key, known = (continuation.key, continuation.known) if continuation else (_tenant_key(stream_id), None)
    record = None
    if mgr.stream_logs.store is not None:
        recorded = list(continuation.recorded) if continuation else []  # as JSON (``delta_records``)
        stream.on_take = lambda batch: recorded.append(encode_batch(batch))
        identity = stream.identity
        body = request.get_data(as_text=True)
        record = StreamRecord(
            RequestRecord(request.path, body, g.request_id, identity.seed, identity.created), recorded
        )
    log = mgr.stream_logs.publish(events, lambda: mgr.release(stream), key, api, record, known, stream.cancel)
    if continuation is not None:
        continuation.log = log
    return log, 0, stream_id


def collect_all(stream: RequestStream) -> dict[int, ChoiceDelta]:
    """A non-streamed request run to the end, then released: one merged delta per choice; a 503 when the engine
    stopped it; ClientGone (and the request aborted) once its client has left."""
    merged: dict[int, ChoiceDelta] = {}
    try:
        quiet = min(manager().settings.heartbeat_seconds, LOOK_SECONDS)  # a look at the client per quiet interval
        for batch in while_connected(iter_deltas(stream, quiet), request.environ):
            if isinstance(batch, Heartbeat):
                continue
            for choice in batch:
                merged[choice.index] = merged[choice.index].then(choice) if choice.index in merged else choice
    except StreamInterrupted as exc:
        raise APIError(exc.message, 503, code=exc.code, headers={"Retry-After": "1"}) from None
    finally:
        manager().release(stream)
    return merged
