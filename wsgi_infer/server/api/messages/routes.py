"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens, served through the chat completion's path
(its errors in Anthropic's shape: server/errors.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from flask import Blueprint, jsonify, request

from ...engine_client.streams import RequestStream
from ...errors import anthropic_error_body
from ...streaming import sse
from ...streaming.stream_log import StreamInterrupted
from ..bodies.parsing import parse
from ..chat.conversation import chat_token_ids, start_chat
from ..chat.formatters import ChatFormatter
from ..serving import collect_all, model_of, publish, pumped_choices
from . import events
from .schemas import CountTokensRequest, MessagesRequest, extensions_of

if TYPE_CHECKING:
    from ...engine_client.served_model import ServedModel

bp = Blueprint("messages", __name__, url_prefix="/v1")


@bp.post("/messages")
def messages():
    body = request.get_json(force=True)
    extensions = extensions_of(body)
    req: MessagesRequest = parse(MessagesRequest, body)
    stream, formatter = start_chat(req.as_chat(extensions), "message")
    frame = events.message(f"msg_{stream.request_id}", formatter.model, stream)
    if req.stream:
        return publish(stream, _events(model_of(stream), stream, formatter, frame), api="anthropic")
    choice = collect_all(stream)[0]
    final = formatter.final_choice(choice)
    content = events.content_blocks(final["message"])
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
    extensions_of(body)
    req: CountTokensRequest = parse(CountTokensRequest, body)
    return jsonify({"input_tokens": len(chat_token_ids(req.as_chat()))})


def _events(mgr: ServedModel, stream: RequestStream, formatter: ChatFormatter, frame: dict) -> Iterator[str | None]:
    """The events of one message; runs in the pump greenlet (no request context)."""
    translate, stop_string = events.MessageEvents(), None
    yield from events.opening(frame)
    try:
        for choice in pumped_choices(mgr, stream):
            if choice is None:
                yield None
                continue
            yield from translate.of(formatter.chunk_choice(choice))
            stop_string = stop_string or choice.delta.stop_reason
        yield from events.closing(translate.finish_reason, stop_string, stream)
    except StreamInterrupted as exc:
        yield sse.event(anthropic_error_body(exc.message, 503), name="error")
