"""Server-Sent Events framing (https://html.spec.whatwg.org/multipage/server-sent-events.html)."""

from __future__ import annotations

import json
from typing import Any

# A comment line with no blank line after it: a blank line would end an "event" of its own, and
# the openai SDK (which keeps the last event id, as the spec says) turns that into an event with
# empty data mid-stream, then fails to parse it. Comment lines between events are ignored by all.
HEARTBEAT = ": ping\n"
DONE = "data: [DONE]\n\n"
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: Any, name: str | None = None, retry_ms: int | None = None) -> str:
    """One event; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    lines = []  # the `id:` line is added by the stream log, which numbers the events
    if name is not None:
        lines.append(f"event: {name}")
    if retry_ms is not None:
        lines.append(f"retry: {retry_ms}")
    lines.extend(f"data: {line}" for line in payload.split("\n"))
    return "\n".join(lines) + "\n\n"


def fields(frame: str) -> tuple[str | None, str]:
    """An event's name and data, as ``event`` (with the stream log's ``id:`` line) wrote it; a heartbeat has
    neither."""
    name, data = None, []
    for line in frame.split("\n"):
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data.append(line[len("data: ") :])
    return name, "\n".join(data)
