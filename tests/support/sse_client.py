"""A small SSE reader over httpx, for tests that watch the wire format itself."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx


@dataclass
class Event:
    data: str = ""
    name: str | None = None
    id: str | None = None
    retry: int | None = None
    comments: list[str] = field(default_factory=list)

    @property
    def json(self):
        return json.loads(self.data)


def events(response: httpx.Response) -> Iterator[Event]:
    """Events in arrival order; a comment line between events (a heartbeat) comes as an Event with no data."""
    current = Event()
    for line in response.iter_lines():
        if line == "":
            yield current
            current = Event()
        elif line.startswith(":") and current == Event():
            yield Event(comments=[line[1:].strip()])  # a heartbeat: a comment line between events
        elif line.startswith(":"):
            current.comments.append(line[1:].strip())
        else:
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "data":
                current.data = f"{current.data}\n{value}" if current.data else value
            elif key == "event":
                current.name = value
            elif key == "id":
                current.id = value
            elif key == "retry":
                current.retry = int(value)


def text_of(data_events: list[Event]) -> str:
    """The completion text a stream's data events carry (choice 0), [DONE] and usage-only chunks skipped."""
    return "".join(e.json["choices"][0]["text"] for e in data_events if e.data != "[DONE]" and e.json["choices"])
