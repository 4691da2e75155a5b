"""The app in the test's own process, over a real engine thread: the API's checks that need no server process.

Requests go through httpx's WSGI transport (the openai SDK takes such a client too) or Flask's test client, in
this thread, which is also the gevent hub's: every wait inside the app runs the hub, which delivers the engine
thread's output. So one request at a time: concurrency, signals and sockets are the real server's tests.
"""

from __future__ import annotations

import httpx

from wsgi_infer.server.app import create_app
from wsgi_infer.server.engine_client.extension import manager_of
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
