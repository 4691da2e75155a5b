"""OpenAI's Responses API: POST /v1/responses through the chat completion's path, stored responses (GET, DELETE,
``previous_response_id``) and streams resumable by ``starting_after``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from flask import Blueprint, g, jsonify, request

from ...engine_client.streams import RequestStream
from ...errors import APIError
from ...query_numbers import whole_number
from ...streaming.redis_store import StoreUnavailable
from ...streaming.stream_log import StreamInterrupted
from ..bodies.parsing import fields_as_sent, parse
from ..chat.conversation import start_chat
from ..chat.formatters import ChatFormatter
from ..serving import collect_all, log_response, manager, model_of, publish, published_log, pumped_choices
from .events import ResponseBuilder, chunk_of, response_id
from .input_items import as_items, page
from .schemas import ResponsesRequest, input_messages, refuse_unsupported, unmatched_call

if TYPE_CHECKING:
    from ...engine_client.identity import ResponseIdentity
    from ...engine_client.served_model import ServedModel
    from ...streaming.response_store import ResponseStore

log = logging.getLogger(__name__)

bp = Blueprint("responses", __name__, url_prefix="/v1")


@bp.post("/responses")
def create():
    body = request.get_json(force=True)
    refuse_unsupported(body)
    req: ResponsesRequest = parse(ResponsesRequest, body)
    previous = None
    if req.previous_response_id:  # OpenAI's 400, whose code clients match (to send the whole conversation instead)
        message = f"Previous response with id '{req.previous_response_id}' not found."
        missing = APIError(message, 400, param="previous_response_id", code="previous_response_not_found")
        previous = _stored(req.previous_response_id, missing)
    conversation = (previous["history"] if previous else []) + input_messages(req.input)
    earlier = previous.get("items", []) + previous["response"]["output"] if previous else []
    if unmatched := unmatched_call(conversation):
        raise APIError(unmatched, param="input")
    if previous and req.model is None:  # a chain keeps its model
        req.model = previous["response"]["model"]
    with fields_as_sent(_FIELDS):
        stream, formatter = start_chat(req.as_chat(conversation), "response")
    builder = ResponseBuilder(_frame(req, formatter.model, stream.identity), stream.identity)
    store = manager().responses if req.store else None
    keep = _Keeper(store, g.get("tenant", ""), conversation, earlier + as_items(req.input))
    if req.stream:
        events = _events(model_of(stream), stream, formatter, builder, keep)
        return publish(stream, events, stream_id=builder.response["id"], api="responses")
    builder.feed(chunk_of(formatter.final_choice(collect_all(stream)[0])))
    builder.finish(stream)
    keep(builder.response)
    return jsonify(builder.response)


@bp.get("/responses/<response_id>")
def retrieve(response_id: str):
    if request.args.get("stream") in ("true", "1"):
        text = request.args.get("starting_after", "-1")
        after = -1 if text == "-1" else whole_number(text)  # -1: from the first event
        if after is None:
            raise APIError("starting_after must be an event's sequence_number, or -1", param="starting_after")
        log = published_log(response_id)
        if log.api != "responses":  # another API's stream (its X-Stream-Id): no response; /v1/streams serves it
            raise _not_found(response_id)
        return log_response(log, after + 1, response_id)  # log ids count from 1
    return jsonify(_stored(response_id, _not_found(response_id))["response"])


@bp.get("/responses/<response_id>/input_items")
def list_input_items(response_id: str):
    return jsonify(page(_stored(response_id, _not_found(response_id)).get("items", []), request.args))


@bp.delete("/responses/<response_id>")
def delete(response_id: str):
    if not _call_store(manager().responses.delete, response_id, g.get("tenant", "")):
        if _generating(response_id):  # stored at its end: no 404 now, and a response kept after a "deleted"
            message = f"response {response_id!r} is still being generated: cancel it (DELETE /v1/streams/{{id}})"
            message += " or let it end, then delete it"
            raise APIError(message, 409, param="response_id", code="response_in_progress")
        raise _not_found(response_id)
    return jsonify({"id": response_id, "object": "response.deleted", "deleted": True})


class _Keeper:
    """Stores a finished response with its conversation, so that a later one continues it (when ``store``)."""

    def __init__(self, store: ResponseStore | None, owner: str, conversation: list[dict], items: list[dict]) -> None:
        self._store, self._owner, self._conversation = store, owner, conversation
        self._items = items  # its input items, as /input_items lists them

    def __call__(self, response: dict) -> None:
        if self._store is None:
            return
        history = self._conversation + input_messages(response["output"])
        try:
            record = {"response": response, "history": history, "items": self._items}
            self._store.put(response["id"], self._owner, record)
        except StoreUnavailable as exc:  # the client has its answer; only continuing it later fails
            log.warning("response %s was not stored: %s", response["id"], exc)


def _events(
    mgr: ServedModel, stream: RequestStream, formatter: ChatFormatter, builder: ResponseBuilder, keep: _Keeper
) -> Iterator[str | None]:
    """The events of one response; runs in the pump greenlet (no request context)."""
    yield from builder.start()
    try:
        for choice in pumped_choices(mgr, stream):
            if choice is None:
                yield None
                continue
            yield from builder.feed(formatter.chunk_choice(choice))
        yield from builder.finish(stream)
    except StreamInterrupted as exc:
        yield from builder.fail(exc.message, exc.code, stream)
    keep(builder.response)


# A chat completion's fields (and the engine's prompt) that a Responses request names otherwise.
_FIELDS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "prompt": "input",
    "response_format": "text.format",
}


def _frame(req: ResponsesRequest, model: str, ids: ResponseIdentity) -> dict:
    """The response before its output: what was asked, as OpenAI echoes it."""
    return {
        "id": response_id(req.previous_response_id, ids),
        "object": "response",
        "created_at": ids.created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning and req.reasoning.effort, "summary": None},
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
        if req.text and req.text.format
        else {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": None,
        "metadata": req.metadata or {},
    }


def _stored(response_id: str, missing: APIError) -> dict:
    """The stored response of this key, or ``missing`` raised."""
    record = _call_store(manager().responses.get, response_id, g.get("tenant", ""))
    if record is None:
        raise missing
    return record


def _call_store(method, *args):
    try:
        return method(*args)
    except StoreUnavailable as exc:
        raise APIError(str(exc), 503, code="store_unavailable", headers={"Retry-After": "1"}) from None


def _generating(response_id: str) -> bool:
    """Whether this key's response is still streaming (its stream not yet ended, so not yet stored)."""
    try:
        return published_log(response_id).api == "responses"
    except APIError as unknown:
        if unknown.status != 404:
            raise
        return False


def _not_found(response_id: str) -> APIError:
    return APIError(f"response {response_id!r} is unknown or has expired", 404, param="response_id", code="not_found")
