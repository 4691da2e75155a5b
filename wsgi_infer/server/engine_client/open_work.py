"""What a drain waits for: the responses not yet released, and the requests the app runs before they submit.

gunicorn starts the drain of a worker that reaches ``max_requests`` before the app runs that request (it flips
``alive`` first): counted from its arrival, the request is served, where a drain that counted responses alone
found none, stopped the engine at once, and the request got a 503 (one in every ``max_requests``).
"""

from __future__ import annotations

import gevent.event


class OpenWork:
    def __init__(self) -> None:
        self.idle = gevent.event.Event()  # set while nothing is open
        self.idle.set()
        self._streams: set[int] = set()  # responses not yet released, by id
        self._in_app = 0  # requests the app runs (each arrival not turned away, until its teardown)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def add_stream(self, stream: object) -> None:
        self._streams.add(id(stream))
        self.idle.clear()

    def discard_stream(self, stream: object) -> None:
        self._streams.discard(id(stream))
        self._settle()

    def arrived(self) -> None:
        self._in_app += 1
        self.idle.clear()

    def left(self) -> None:
        self._in_app -= 1
        self._settle()

    def _settle(self) -> None:
        if not self._streams and not self._in_app:
            self.idle.set()
