"""How a stream ends early, in the shape of the API whose events it holds: written by the worker generating it, or
by a reader of Redis's copy on another worker or host, should Redis or that worker go away. Both write the same
event for the same interruption."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import anthropic_error_body, error_body
from . import sse

RETRY_MS = 1000  # the `retry:` hint of an error event: how soon a client may resume the stream or retry
API_SHAPES = ("openai", "anthropic", "responses")  # the shapes a stream may end in: see error_event
MOVED = "stream_moved"  # another host continues it (its host was away past its lease): resume it


@dataclass
class StreamInterrupted(Exception):
    """A stream ends before its generation: the engine stopped, or its reader left or fell behind. Raised in a
    route's generator of events, which ends the stream in its own API's shape."""

    message: str
    code: str


def openai_error_event(message: str, code: str) -> str:
    """OpenAI's error event ending an interrupted stream: a 503's body (``service_unavailable_error``), ``code``
    saying why (``server_shutting_down``, ``engine_stopped``, ``stream_lost``...)."""
    return sse.event(error_body(message, 503, code=code), name="error", retry_ms=RETRY_MS)


def anthropic_error_event(message: str) -> str:
    """Anthropic's error event ending an interrupted stream (an ``overloaded_error``, as a 503's)."""
    return sse.event(anthropic_error_body(message, 503), name="error", retry_ms=RETRY_MS)


def error_event(api: str, events_before: int, message: str, code: str) -> str:
    """The event that ends a stream read elsewhere in its API's shape: Anthropic's error, the Responses API's ``error``
    event (numbered after the ``events_before`` the stream's numbers count from 0), else OpenAI's error."""
    if api == "anthropic":
        return anthropic_error_event(message)
    if api == "responses":
        data = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": events_before}
        return sse.event(data, name="error", retry_ms=RETRY_MS)
    return openai_error_event(message, code)
