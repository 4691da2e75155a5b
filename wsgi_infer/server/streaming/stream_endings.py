"""How a stream read from Redis's copy ends early, in the shape of the API whose events it holds (a reader on
another worker or host than the one generating it ends it, should Redis or that worker go away)."""

from __future__ import annotations

from ..errors import anthropic_error_body, error_body
from . import sse

RETRY_MS = 1000
API_SHAPES = ("openai", "anthropic", "responses")  # the shapes a stream may end in: see error_event


def error_event(api: str, events_before: int, message: str, code: str) -> str:
    """The event that ends a stream read elsewhere in its API's shape: Anthropic's error, the Responses API's ``error``
    event (numbered after the ``events_before`` the stream's numbers count from 0), else OpenAI's error."""
    if api == "anthropic":
        data = anthropic_error_body(message, 503)
    elif api == "responses":
        data = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": events_before}
    else:
        data = error_body(message, 503, code=code)
    return sse.event(data, name="error", retry_ms=RETRY_MS)
