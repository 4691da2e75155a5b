"""The native API: POST /generate.

Streams Server-Sent Events when the client accepts ``text/event-stream``,
plain text chunks otherwise (no heartbeats there: a chunked body has no
comment syntax).
"""

from __future__ import annotations

from collections.abc import Iterator

from flask import Blueprint, Response, jsonify, request, stream_with_context

from ..engine_client.streams import RequestStream
from ..streaming import sse
from .schemas import GenerateRequest, parse
from .serving import Heartbeat, StreamInterrupted, collect, iter_deltas, manager, start

bp = Blueprint("native", __name__)


@bp.post("/generate")
def generate():
    req: GenerateRequest = parse(GenerateRequest, request.get_json(force=True))
    stream = start([req.prompt], [req.sampling_params()])
    if not req.stream:
        try:
            choice = collect(stream)[0]
        finally:
            manager().release(stream)
        return jsonify({"text": choice.delta.text, "finish_reason": choice.delta.finish_reason, "usage": stream.usage})
    if request.accept_mimetypes.best_match(["text/plain", "text/event-stream"]) == "text/event-stream":
        return Response(stream_with_context(_events(stream)), mimetype="text/event-stream", headers=sse.STREAM_HEADERS)
    return Response(stream_with_context(_plain(stream)), mimetype="text/plain", headers=sse.STREAM_HEADERS)


def _events(stream: RequestStream) -> Iterator[str]:
    try:
        for batch in iter_deltas(stream, manager().settings.heartbeat_seconds):
            if isinstance(batch, Heartbeat):
                yield sse.HEARTBEAT
                continue
            delta = batch[0].delta
            yield sse.event({"text": delta.text, "finish_reason": delta.finish_reason})
        yield sse.event({"text": "", "finish_reason": stream.finish_reasons[0], "usage": stream.usage})
        yield sse.DONE
    except StreamInterrupted as exc:
        yield sse.event({"error": {"message": exc.message, "type": "server_error", "code": exc.code}}, name="error")
    finally:
        manager().release(stream)


def _plain(stream: RequestStream) -> Iterator[str]:
    try:
        for batch in iter_deltas(stream, manager().settings.heartbeat_seconds):
            if not isinstance(batch, Heartbeat) and batch[0].delta.text:
                yield batch[0].delta.text
    except StreamInterrupted:
        return  # the body simply ends; plain-text clients cannot be told more
    finally:
        manager().release(stream)
