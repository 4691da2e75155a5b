"""gunicorn's gevent worker, taught to stop without leaving a client hanging.

gunicorn's own gevent worker only sets ``alive = False`` on SIGTERM, keeps
accepting for up to a second, then waits for its connections until the master
SIGKILLs it at graceful_timeout: endless streams would be cut without a word.
Here every transition of ``alive`` to False (SIGTERM, the old workers of a
SIGHUP reload, max_requests, an engine that died) stops accepting at once, so
the other (or new) workers take new connections, and starts the engine
manager's drain in a greenlet. SIGINT/SIGQUIT end every stream at once, then
exit.
"""

from __future__ import annotations

import time
from functools import partial

import gevent
from gevent.pool import Pool
from gevent.server import StreamServer
from gunicorn.sock import ssl_context
from gunicorn.workers.base import Worker
from gunicorn.workers.ggevent import GeventWorker

from .extension import manager_of


class InferenceWorker(GeventWorker):
    drain_seconds: float = 0.0  # set by post_worker_init from the settings and graceful_timeout
    _alive = True
    _quitting = False
    _servers: list[StreamServer] = []

    @property
    def alive(self) -> bool:
        return self._alive

    @alive.setter
    def alive(self, value: bool) -> None:
        stopping = self._alive and not value
        self._alive = value
        if not stopping:
            return
        for server in self._servers:
            server.stop_accepting()
        manager = manager_of(getattr(self, "wsgi", None))
        if manager is not None and not self._quitting:
            gevent.spawn(manager.drain, self.drain_seconds)

    def run(self) -> None:
        """GeventWorker.run for gunicorn's own HTTP handling, with the servers kept
        on the worker so that ``alive = False`` can stop accepting immediately."""
        ssl_args = {"ssl_context": ssl_context(self.cfg)} if self.cfg.is_ssl else {}
        for sock in self.sockets:
            sock.setblocking(1)
            server = StreamServer(
                sock, handle=partial(self.handle, sock), spawn=Pool(self.worker_connections), **ssl_args
            )
            if self.cfg.workers > 1:
                server.max_accept = 1
            server.start()
            self._servers = [*self._servers, server]
        while self.alive:
            self.notify()
            gevent.sleep(1.0)
        for server in self._servers:
            server.close()
        # Let open connections finish (the drain ends streams before this deadline).
        deadline = time.time() + self.cfg.graceful_timeout
        while time.time() < deadline and any(s.pool.free_count() != s.pool.size for s in self._servers):
            self.notify()
            gevent.sleep(0.1)
        for server in self._servers:
            server.stop(timeout=1)

    def handle_quit(self, sig, frame) -> None:
        # Out of the signal handler: blocking (cooperatively) is fine in a greenlet.
        gevent.spawn(self._quit, sig, frame)

    def _quit(self, sig, frame) -> None:
        self._quitting = True
        manager = manager_of(getattr(self, "wsgi", None))
        if manager is not None:
            manager.shutdown_now()
        Worker.handle_quit(self, sig, frame)  # worker_int hook, then exit
