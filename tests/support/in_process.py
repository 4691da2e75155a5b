"""The app in the test's own process, over a real engine thread: the API's checks that need no server process.

Requests go through httpx's WSGI transport (the openai SDK takes such a client too) or Flask's test client, in
this thread, which is also the gevent hub's: every wait inside the app runs the hub, which delivers the engine
thread's output. So one request at a time: concurrency, signals and sockets are the real server's tests. And a
route's own events for a stream the engine cut short, with no app at all (``interrupted_endings``).
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx

from wsgi_infer.server.api import native
from wsgi_infer.server.api.openai import routes
from wsgi_infer.server.app import create_app
from wsgi_infer.server.engine_client.extension import manager_of
from wsgi_infer.server.engine_client.streams import RequestStream, Terminated
from wsgi_infer.server.settings import ServerSettings

from .server import parse_metrics


class InProcessServer:
    url = "http://in-process"

    def __init__(self, settings: dict) -> None:
        self.app = create_app(ServerSettings(**{k: str(v) for k, v in settings.items()}))
        self.manager = manager_of(self.app)
        self.manager.start()
        assert self.manager.wait_ready(300), self.manager.failure

    def client(self, **kwargs) -> httpx.Client:
        transport = httpx.WSGITransport(app=self.app)
        return httpx.Client(transport=transport, base_url=self.url, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def metrics(self) -> dict[str, float]:
        with self.client() as http:
            return parse_metrics(http.get("/metrics").text, self.manager.model_name)

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Envelopes:
    """What ending a stream asks of an OpenAI route's formatter: an envelope, and an abort chunk per unfinished
    choice."""

    def envelope(self, choices: list, **fields) -> dict:
        return {"choices": choices, **fields}

    def abort_choice(self, index: int) -> dict:
        return {"index": index, "finish_reason": "abort"}


def interrupted_endings(message: str, code: str) -> dict[str, str]:
    """The last event each OpenAI-shaped route (``openai``: completions and chat; ``native``: /generate) writes
    where the engine ends its stream before it finished (``message``, ``code``): its generator, driven alone."""
    model = SimpleNamespace(settings=SimpleNamespace(heartbeat_seconds=1.0), release=lambda stream: None)
    events = {
        "openai": lambda stream: routes._sse(model, stream, False, _Envelopes()),
        "native": lambda stream: native._events(model, stream),
    }
    endings = {}
    for name, route in events.items():
        stream = RequestStream(name, 1, key="0")
        stream.push(Terminated(message, code))
        endings[name] = list(route(stream))[-1]
    return endings
