"""The native API: POST /generate.

Streamed, it goes through the same machinery as the OpenAI routes: a pump
greenlet records its events in a stream log (bounded backlog, resumable at
``/v1/streams/<X-Stream-Id>``, generation aborted once nobody reads it). The
client gets Server-Sent Events (with heartbeats) when it accepts
``text/event-stream``, else the plain text of the same events: a plain body
has no comment syntax, so it carries no heartbeats, and an error cuts it.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

from flask import Blueprint, Response, jsonify, request

from ..client_connection import until_gone
from ..engine_client.streams import RequestStream
from ..streaming import sse
from ..streaming.stream_endings import openai_error_event
from ..streaming.stream_log import StreamInterrupted
from .bodies.parsing import fields_as_sent, parse
from .bodies.schemas import GenerateRequest
from .serving import collect_all, publish, publish_log, pumped_choices, served, start

if TYPE_CHECKING:
    from ..engine_client.served_model import ServedModel

log = logging.getLogger(__name__)

bp = Blueprint("native", __name__)


@bp.post("/generate")
def generate():
    req: GenerateRequest = parse(GenerateRequest, request.get_json(force=True))
    mgr = served(req.model, req.keep_alive)
    with fields_as_sent({"max_tokens": "max_new_tokens"}):  # a prompt too long names this route's field
        stream = start(mgr, [req.prompt], [req.sampling_params()])
    if not req.stream:
        choice = collect_all(stream)[0]
        return jsonify({"text": choice.delta.text, "finish_reason": choice.delta.finish_reason, "usage": stream.usage})
    if request.accept_mimetypes.best_match(["text/plain", "text/event-stream"]) == "text/event-stream":
        return publish(stream, _events(mgr, stream))
    log, _, stream_id = publish_log(stream, _events(mgr, stream))
    frames = until_gone(log.read(0, mgr.settings.heartbeat_seconds), request.environ)
    headers = {**sse.STREAM_HEADERS, "X-Stream-Id": stream_id}
    return Response(_plain_text(frames, request.environ), mimetype="text/plain", headers=headers)


def _events(mgr: ServedModel, stream: RequestStream) -> Iterator[str | None]:
    """The events of one response; runs in the pump greenlet (no request context)."""
    try:
        for choice in pumped_choices(mgr, stream):
            if choice is None:
                yield None
                continue
            yield sse.event({"text": choice.delta.text, "finish_reason": choice.delta.finish_reason})
        yield sse.event({"text": "", "finish_reason": stream.finish_reasons[0], "usage": stream.usage})
        yield sse.DONE
    except StreamInterrupted as exc:
        yield openai_error_event(exc.message, exc.code)


def _plain_text(frames: Iterator[str], environ: dict) -> Iterator[str]:
    """The text the log's events carry; heartbeats and the end write nothing. A stream cut short (an error event:
    cancelled, its engine stopped, its reader too far behind) closes the connection before the body's last chunk,
    which HTTP clients report as a body cut short: a plain body has no other way to tell it from a whole one."""
    for frame in frames:
        name, data = sse.fields(frame)
        if name == "error":
            error = json.loads(data)["error"]
            log.warning("plain-text stream cut short (%s): its connection closes before the body's end", error["code"])
            if (connection := environ.get("gunicorn.socket")) is not None:
                connection.shutdown(socket.SHUT_RDWR)  # gunicorn's last chunk then fails (EPIPE), which it ignores
            return
        if name is None and data and data != "[DONE]":
            text = json.loads(data)["text"]
            if text:
                yield text
