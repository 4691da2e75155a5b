"""gunicorn's gevent worker, taught to stop without leaving a client hanging.

gunicorn's own gevent worker only sets ``alive = False`` on SIGTERM, keeps
accepting for up to a second, then waits for its connections until the master
SIGKILLs it at graceful_timeout: endless streams would be cut without a word.
Here every transition of ``alive`` to False (SIGTERM, the old workers of a
SIGHUP reload, max_requests, an engine that died) closes the worker's listeners
at once, so the other (or new) workers take new connections (or, the master's
closed too, they are refused), and starts the engine
manager's drain in a greenlet. SIGINT/SIGQUIT end every stream at once, then
exit.

Connections are bounded too: past ``worker_connections`` a new connection is
answered at once with a JSON 503 and Retry-After (gevent would otherwise stop
accepting, and the client would wait in the listen backlog, unseen). Idle
connections, and request headers, are bounded by gunicorn's keep-alive timeout.
A request gunicorn cannot parse gets its answer (400, 414, 431) in the API's JSON
error shape, not gunicorn's HTML page.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import partial
from http import HTTPStatus
from importlib import metadata

import gevent
from gevent.event import Event
from gevent.pool import Pool
from gevent.server import StreamServer
from gunicorn import util
from gunicorn.arbiter import Arbiter
from gunicorn.sock import ssl_context
from gunicorn.workers.base import Worker
from gunicorn.workers.ggevent import GeventWorker

from ..engine_client.extension import manager_of
from ..errors import error_body
from .request_checks import check_request

TURN_AWAY_LINGER_S = 1.0  # how long a refused client may finish sending before the close
TURN_AWAY_LOG_S = 10.0  # a flood of refusals logs a line this often at most (the metric counts each)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


class ConnectionPool(Pool):
    """The worker's connection greenlets; past ``limit`` a connection gets ``turn_away``
    (a short greenlet outside the pool) instead of waiting for a free slot."""

    def __init__(self, limit: int, turn_away: Callable[[socket.socket, tuple], None]) -> None:
        super().__init__()  # unbounded: the server never stops accepting, we count here
        self.limit = limit
        self._turn_away = turn_away

    def spawn(self, run_and_close, handle, close, args):  # gevent's StreamServer calls it so
        if len(self) >= self.limit:
            return gevent.spawn(run_and_close, self._turn_away, close, args)
        return super().spawn(run_and_close, handle, close, args)


class InferenceWorker(GeventWorker):
    drain_seconds: float = 0.0  # set by post_worker_init from the settings and graceful_timeout
    _alive = True
    _quitting = False
    boot_failure: str | None = None  # the model could not load: run ends with gunicorn's boot error
    _servers: list[StreamServer] = []
    _draining: gevent.Greenlet | None = None
    _stop_asked: Event | None = None  # wakes run()'s heartbeat loop: an idle worker leaves at once, not within 1 s
    _turned_away = 0  # connections refused since the last line that said so
    _next_turn_away_line = 0.0

    @property
    def alive(self) -> bool:
        return self._alive

    @alive.setter
    def alive(self, value: bool) -> None:
        stopping = self._alive and not value
        self._alive = value
        if not stopping:
            return
        if self._stop_asked is not None:
            self._stop_asked.set()
        # In a greenlet of its own: set in a signal handler, which runs inside whatever greenlet the signal
        # interrupted, a close there pulled the listening socket from under the server's accept in progress
        # (an AttributeError in gevent's _do_read, seen once on a SIGHUP)
        self._draining = gevent.spawn(self._stop_accepting_then_drain)

    def _stop_accepting_then_drain(self) -> None:
        for server in self._servers:  # closed, not only unwatched: a listener held open still completes handshakes,
            if not server.closed:  # and those connections were reset at the close, their requests sent (1 s later)
                server.close()
        manager = manager_of(getattr(self, "wsgi", None))
        if manager is not None and not self._quitting:
            manager.drain(self.drain_seconds)

    def init_process(self) -> None:
        _raise_open_files_limit(self.worker_connections, self.log)
        util.write_error = _write_json_error  # what gunicorn's handle_error answers with, in this worker only
        super().init_process()

    def keep_early_stops(self, master_queue: queue.SimpleQueue | list[int]) -> None:
        """Right after the fork (gunicorn's post_fork): a stop signal that reaches this worker before gunicorn sets
        its handlers (in ``init_signals``, after gevent's patching: 50-150 ms) would be taken by the master's
        handlers it inherited, into the master's queue it copied, and lost: the worker would start and serve until
        the master killed it at graceful_timeout (30 s; found by stopping a server just after its worker forked).
        So such a signal is kept, from that queue or from handlers of our own until then, and raised again once
        gunicorn's handlers are set."""
        self._early_stops = [sig for sig in _taken(master_queue) if sig in STOP_SIGNALS]
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda sig, frame: self._early_stops.append(sig))

    def init_signals(self) -> None:
        super().init_signals()
        early = set(getattr(self, "_early_stops", ()))
        if early:  # the most urgent once: a quick stop (SIGINT, SIGQUIT) over a drain (SIGTERM)
            sig = signal.SIGQUIT if early - {signal.SIGTERM} else signal.SIGTERM
            self.log.info("taking now the stop that came while this worker started (%s)", sig.name)
            os.kill(os.getpid(), sig)

    def patch(self) -> None:
        with _entry_points_read_once():
            super().patch()

    def run(self) -> None:
        """GeventWorker.run for gunicorn's own HTTP handling, with the servers kept
        on the worker so that ``alive = False`` can stop accepting immediately."""
        ssl_args = {"ssl_context": ssl_context(self.cfg)} if self.cfg.is_ssl else {}
        for sock in self.sockets:
            sock.setblocking(1)
            pool = ConnectionPool(self.worker_connections, self._turn_away)
            server = StreamServer(sock, handle=partial(self.handle, sock), spawn=pool, **ssl_args)
            if self.cfg.workers > 1:
                server.max_accept = 1
            server.start()
            self._servers = [*self._servers, server]
        self._stop_asked = Event()
        while self.alive:
            self.notify()
            self._stop_asked.wait(1.0)
        for server in self._servers:
            if not server.closed:  # alive was False before the servers started
                server.close()
        # Let open connections finish (the drain ends streams before this deadline).
        deadline = time.time() + self.cfg.graceful_timeout
        while time.time() < deadline and any(len(s.pool) for s in self._servers):
            self.notify()
            gevent.sleep(0.1)
        if self._draining is not None:  # its engine stop and last log lines, before worker_exit ends the process
            self._draining.join(max(0.0, deadline - time.time()))
        for server in self._servers:
            server.stop(timeout=1)
        if self.boot_failure:  # as gunicorn's arbiter does for a worker that failed to boot
            print(self.boot_failure, file=sys.stderr, flush=True)
            raise SystemExit(Arbiter.WORKER_BOOT_ERROR)

    def handle(self, listener, client, addr) -> None:
        metrics = self._metrics()
        if metrics is None:  # the app is not loaded yet
            return super().handle(listener, client, addr)
        metrics.http_connections.inc()
        metrics.greenlets.inc()
        try:
            super().handle(listener, client, addr)
        finally:
            metrics.http_connections.dec()
            metrics.greenlets.dec()

    def handle_request(self, listener_name, req, sock, addr):
        check_request(req, self._body_limit())
        # The app's way back to gunicorn's request, through the environ's wsgi.input (its body): to close the
        # connection after its answer (app._close_after), whatever reader the body has.
        req.body.request = req
        return super().handle_request(listener_name, req, sock, addr)

    def _body_limit(self) -> float:
        manager = manager_of(getattr(self, "wsgi", None))
        return manager.settings.max_body_bytes if manager is not None else float("inf")

    def _turn_away(self, client: socket.socket, addr: tuple) -> None:
        """A 503 without reading the request, then a short linger: closing with unread input
        would reset the connection, and the client might never see the answer."""
        metrics = self._metrics()
        if metrics is not None:
            metrics.http_connections_refused.inc()
        self._turned_away += 1
        if (now := time.monotonic()) >= self._next_turn_away_line:  # the first at once: the access log has none
            self.log.warning(
                "turned away %d connections with a 503 (too_many_connections) since this line last said so: this "
                "worker holds its limit of %d (--worker-connections)",
                self._turned_away,
                self.worker_connections,
            )
            self._turned_away, self._next_turn_away_line = 0, now + TURN_AWAY_LOG_S
        message = f"this worker holds its limit of {self.worker_connections} connections; retry later"
        body = error_body(message, 503, code="too_many_connections")
        try:
            client.sendall(_json_answer(503, "Service Unavailable", body, "Retry-After: 1\r\n"))
            client.shutdown(socket.SHUT_WR)
            with gevent.Timeout(TURN_AWAY_LINGER_S, False):
                while client.recv(65536):
                    pass
        except OSError:
            pass  # the client is gone already

    def _metrics(self):
        manager = manager_of(getattr(self, "wsgi", None))
        return manager.metrics if manager is not None else None

    def handle_quit(self, sig, frame) -> None:
        # Out of the signal handler: blocking (cooperatively) is fine in a greenlet.
        gevent.spawn(self._quit, sig, frame)

    def _quit(self, sig, frame) -> None:
        self._quitting = True
        manager = manager_of(getattr(self, "wsgi", None))
        if manager is not None:
            manager.shutdown_now()
        Worker.handle_quit(self, sig, frame)  # worker_int hook, then exit


def _json_answer(status: int, reason: str, body: dict, headers: str = "") -> bytes:
    """A whole HTTP/1.1 answer with a JSON body (``headers``: more lines, each ending in CRLF), after which the
    connection closes."""
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 {status} {reason}\r\nDate: {util.http_date()}\r\nContent-Type: application/json\r\n"
    head += f"{headers}Connection: close\r\n"
    return f"{head}Content-Length: {len(data)}\r\n\r\n".encode("latin1") + data


def _write_json_error(sock: socket.socket, status: int, reason: str, message: str) -> None:
    """gunicorn's ``util.write_error``, in JSON: its answer to a request it could not parse (a request line past
    ``limit_request_line``: 414; headers past their limits: 431; a malformed line, header or chunk: 400), which a
    client of the API then reads as it reads every other error."""
    phrase = HTTPStatus(status).phrase  # gunicorn's reason for its 501 is Bad Request
    util.write_nonblock(sock, _json_answer(status, phrase, error_body(message or phrase, status)))


def _taken(master_queue: queue.SimpleQueue | list[int]) -> list[int]:
    """What this worker's copy of the master's signal queue holds (a list before gunicorn 25)."""
    if isinstance(master_queue, list):
        return list(master_queue)
    taken = []
    with suppress(queue.Empty):
        while True:
            taken.append(master_queue.get_nowait())
    return taken


@contextmanager
def _entry_points_read_once() -> Iterator[None]:
    """gevent's ``patch_all`` looks for plugins in ``importlib.metadata.entry_points`` 25 times, and each look reads
    every installed distribution's metadata: 0.25-0.4 s of a start with the 143 of our environment. One read
    answers them all."""
    every, original = metadata.entry_points(), metadata.entry_points
    metadata.entry_points = lambda **selection: every.select(**selection)
    try:
        yield
    finally:
        metadata.entry_points = original


def _raise_open_files_limit(connections: int, log) -> None:
    """Each connection is a file descriptor: lift the soft limit to the hard one (as far as needed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256  # the model's files, the listeners, the log
    if hard != resource.RLIM_INFINITY and hard < wanted:
        log.warning("open files limited to %d: fewer than worker_connections=%d can be served", hard, connections)
        wanted = hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
