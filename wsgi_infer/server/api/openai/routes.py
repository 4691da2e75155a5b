"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from flask import Blueprint, jsonify, request

from ...engine_client.streams import RequestStream
from ...errors import APIError
from ...query_numbers import whole_number
from ...streaming import sse
from ...streaming.redis_store import StoreUnavailable
from ...streaming.stream_endings import openai_error_event
from ...streaming.stream_log import StreamInterrupted
from ..bodies.parsing import parse
from ..bodies.schemas import CompletionRequest
from ..chat.conversation import start_chat
from ..chat.formatters import Formatter, VllmFields
from ..chat.schemas import ChatCompletionRequest
from ..serving import (
    collect_all,
    log_response,
    manager,
    model_of,
    publish,
    published_log,
    pumped_choices,
    served,
    start,
)
from .completion_formatter import CompletionFormatter

if TYPE_CHECKING:
    from ...engine_client.served_model import ServedModel

bp = Blueprint("openai", __name__, url_prefix="/v1")


@bp.get("/models")
def models():
    """Every model this server serves, loaded or not, with its state: OpenAI's list, and a page of Anthropic's."""
    return jsonify(_model_page([model.describe() for model in manager().models.values()], request.args))


def _model_page(data: list[dict], args) -> dict:
    """Anthropic's paging (``limit``, ``after_id``, ``before_id``) over the list OpenAI's clients read whole."""
    limit = whole_number(args.get("limit", str(len(data) or 1)))  # every model unless asked: OpenAI's is whole
    if limit is None or not 1 <= limit <= 1000:
        raise APIError("limit must be an integer from 1 to 1000", param="limit")
    start, end = 0, len(data)
    for name in ("after_id", "before_id"):
        if name in args:
            ids = [model["id"] for model in data]
            if args[name] not in ids:
                raise APIError(f"no model {args[name]!r}", 404, param=name, code="model_not_found")
            start, end = (ids.index(args[name]) + 1, end) if name == "after_id" else (start, ids.index(args[name]))
    window = data[start:end]
    page = window[-limit:] if "before_id" in args and "after_id" not in args else window[:limit]
    ends = {"first_id": page[0]["id"], "last_id": page[-1]["id"]} if page else {"first_id": None, "last_id": None}
    return {"object": "list", "data": page, "has_more": len(page) < len(window), **ends}


@bp.get("/models/<path:model_id>")
def model(model_id: str):
    try:
        return jsonify(manager().model(model_id).describe())  # a look: no keep-alive of a request's
    except APIError as missing:  # a model's admin route asked with GET: its name is no model's
        known, _, action = model_id.rpartition("/")
        if missing.status != 404 or action not in ("load", "unload") or not known:
            raise
        raise APIError(f"/v1/models/{{id}}/{action} takes POST", 405, headers={"Allow": "POST"}) from None


@bp.post("/completions")
def completions():
    req: CompletionRequest = parse(CompletionRequest, request.get_json(force=True))
    mgr = served(req.model, req.keep_alive)
    params = req.sampling_params(req.max_tokens, req.logprobs, req.echo_logprobs)
    stream = start(mgr, req.prompts, params)
    echo = None
    if req.echo:
        tokenizer = mgr.tokenizer
        echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in req.prompts]
    formatter = CompletionFormatter(stream, "text_completion", echo, req.logprobs, VllmFields.of(req))
    return _respond(stream, req.stream, req.include_usage, formatter)


@bp.post("/chat/completions")
def chat_completions():
    req: ChatCompletionRequest = parse(ChatCompletionRequest, request.get_json(force=True))
    stream, formatter = start_chat(req, "chat.completion.chunk" if req.stream else "chat.completion")
    return _respond(stream, req.stream, req.include_usage, formatter)


def _respond(stream: RequestStream, streaming: bool, include_usage: bool, formatter: Formatter):
    if not streaming:
        merged = collect_all(stream)
        body = formatter.envelope([formatter.final_choice(merged[i]) for i in sorted(merged)])
        body.update(formatter.response_fields(merged), usage=stream.usage)
        return jsonify(body)
    return publish(stream, _sse(model_of(stream), stream, include_usage, formatter))


@bp.get("/streams/<stream_id>")
def resume(stream_id: str):
    """Resume a stream after the event the client saw last (Last-Event-ID, as EventSource sends)."""
    log = published_log(stream_id)
    last = whole_number(request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or "0")
    if last is None:
        raise APIError("Last-Event-ID must be an event id of this stream", 400, param="Last-Event-ID")
    return log_response(log, last, stream_id)


@bp.delete("/streams/<stream_id>")
def cancel(stream_id: str):
    """Stop a stream's generation now, wherever it runs (a chat page's Stop: a connection cut keeps the stream for
    a resume, one heartbeat interval); ``cancelled`` is false for a stream that had ended already."""
    try:
        cancelled = published_log(stream_id).cancel()
    except StoreUnavailable as exc:
        raise APIError(str(exc), 503, code="store_unavailable", headers={"Retry-After": "1"}) from None
    return jsonify({"id": stream_id, "object": "stream", "cancelled": cancelled})


def _sse(mgr: ServedModel, stream: RequestStream, include_usage: bool, formatter: Formatter) -> Iterator[str | None]:
    """The events of one response; runs in the pump greenlet (no request context)."""

    def chunk_event(choice: dict) -> str:
        body = formatter.envelope([choice])
        return sse.event(body | {"usage": None} if include_usage else body)  # OpenAI's: null but in the last

    try:
        for choice in pumped_choices(mgr, stream):
            if choice is None:
                yield None
            elif (chunk := formatter.chunk_choice(choice)) is not None:
                yield chunk_event(chunk)
        if include_usage:
            yield sse.event(formatter.envelope([], usage=stream.usage))
        yield sse.DONE
    except StreamInterrupted as exc:
        # Each unfinished choice ends with "abort", then an error event; never [DONE].
        for index in range(stream.num_choices):
            if index not in stream.finish_reasons:
                yield chunk_event(formatter.abort_choice(index))
        yield openai_error_event(exc.message, exc.code)  # as a reader of Redis's copy ends it (stream_endings)
