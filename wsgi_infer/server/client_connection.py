"""Whether a request's client is still connected.

A stream finds a client that left when a write fails (a token or a heartbeat); a non-streamed response writes
nothing until its end, so a client that gave up (a timeout, then a retry) would leave its generation running to
``max_tokens``. Its socket tells: the request's body has been read whole (``app._read_body_in_time``), so the socket
turns readable only at the client's end of the connection, or with a pipelined next request.
"""

from __future__ import annotations

import _socket  # the C socket type, which gevent does not patch: a look that never waits
import socket
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its response was ready: nothing is left to answer."""


def client_gone(environ: dict) -> bool:
    """True once the client behind ``environ`` (gunicorn's socket) has closed its connection; False where there is
    no socket to look at (a test client)."""
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        view = _socket.socket(fileno=sock.fileno())  # the same descriptor, given back below
    except (OSError, ValueError):  # closed: no descriptor left
        return True
    try:
        # the end of its stream, or a pipelined request's first byte
        return view.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:  # nothing to read: still there
        return False
    except OSError:  # reset
        return True
    finally:
        view.detach()


def while_connected(items: Iterable[T], environ: dict, every: float = 1.0) -> Iterator[T]:
    """``items``, looking at most every ``every`` seconds whether the client is still there; ClientGone once it
    is not (the caller's cleanup then aborts the work)."""
    next_look = time.monotonic() + every
    for item in items:
        if time.monotonic() >= next_look:
            if client_gone(environ):
                raise ClientGone
            next_look = time.monotonic() + every
        yield item
