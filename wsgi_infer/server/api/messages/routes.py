"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens, served through the chat completion's path
(its errors in Anthropic's shape: server/errors.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from flask import Blueprint, jsonify, request

from ....engine.outputs import CONSTRAINT_FAILED, CONSTRAINT_FAILED_MESSAGE
from ...engine_client.streams import RequestStream
from ...errors import APIError, anthropic_error_body
from ...streaming import sse
from ...streaming.stream_endings import anthropic_error_event
from ...streaming.stream_log import StreamInterrupted
from ..bodies.parsing import fields_as_sent, parse
from ..chat.conversation import chat_token_ids, start_chat
from ..chat.formatters import ChatFormatter
from ..serving import collect_all, model_of, publish, pumped_choices
from . import events
from .schemas import CountTokensRequest, MessagesRequest, extensions_of

if TYPE_CHECKING:
    from ...engine_client.served_model import ServedModel

bp = Blueprint("messages", __name__, url_prefix="/v1")

# A chat completion's fields that a Messages request names otherwise.
_FIELDS = {"stop": "stop_sequences", "response_format": "output_config.format"}


@bp.post("/messages")
def messages():
    body = request.get_json(force=True)
    extensions = extensions_of(body)
    req: MessagesRequest = parse(MessagesRequest, body)
    with fields_as_sent(_FIELDS):
        stream, formatter = start_chat(req.as_chat(extensions), "message")
    frame = events.message(f"msg_{stream.request_id}", formatter.model)
    if req.stream:
        translate = events.MessageEvents(req.thinking_omitted)
        return publish(stream, _events(model_of(stream), stream, formatter, frame, translate), api="anthropic")
    choice = collect_all(stream)[0]
    final = formatter.final_choice(choice)
    if final["finish_reason"] == CONSTRAINT_FAILED:  # Anthropic's stop reasons have none for it
        raise APIError(CONSTRAINT_FAILED_MESSAGE, 400)
    content = events.content_blocks(final["message"], req.thinking_omitted)
    return jsonify(
        {
            **frame,
            "content": content,
            **events.stop_reason(final["finish_reason"], choice.delta.stop_reason),
            "usage": events.usage(stream),
        }
    )


@bp.post("/messages/count_tokens")
def count_tokens():
    body = request.get_json(force=True)
    req: CountTokensRequest = parse(CountTokensRequest, body)
    with fields_as_sent(_FIELDS):
        return jsonify({"input_tokens": len(chat_token_ids(req.as_chat()))})


def _events(
    mgr: ServedModel, stream: RequestStream, formatter: ChatFormatter, frame: dict, translate: events.MessageEvents
) -> Iterator[str | None]:
    """The events of one message, ``translate``'s; runs in the pump greenlet (no request context). It opens with
    the first output, whose usage counts the prompt's cached tokens apart, as Anthropic's ``message_start`` does
    (the stream's headers went out at once)."""
    stop_string, opened = None, False
    try:
        for choice in pumped_choices(mgr, stream):
            if choice is None:
                yield None
                continue
            if not opened:  # its output counted as none: how many tokens came by now varies (a host continuing the
                usage = {**events.usage(stream), "output_tokens": 0}  # stream writes the same event)
                yield from events.opening({**frame, "usage": usage})
                opened = True
            yield from translate.of(formatter.chunk_choice(choice))
            stop_string = stop_string or choice.delta.stop_reason
        if translate.finish_reason == CONSTRAINT_FAILED:
            yield sse.event(anthropic_error_body(CONSTRAINT_FAILED_MESSAGE, 400), name="error")
            return
        yield from events.closing(translate.finish_reason, stop_string, stream)
    except StreamInterrupted as exc:
        yield anthropic_error_event(exc.message)
