"""Whether a request's client is still connected.

A write finds a client that left only when it fails (a token or a heartbeat): a non-streamed response writes
nothing until its end, so a client that gave up (a timeout, then a retry) would leave its generation running to
``max_tokens``, and a stream in a long prefill or queue would find it at its next heartbeat. Its socket tells at
once: the request's body has been read whole (``app._read_body_in_time``), so the socket turns readable only at the
client's end of the connection, or with a pipelined next request. Both look at it every ``LOOK_SECONDS``.
"""

from __future__ import annotations

import _socket  # the C socket type, which gevent does not patch: a look that never waits
import contextlib
import socket
import time
from collections.abc import Generator, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
LOOK_SECONDS = 1.0  # how often a request that writes nothing looks whether its client is still there


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


def while_connected(items: Iterable[T], environ: dict, every: float = LOOK_SECONDS) -> Iterator[T]:
    """``items``, looking at most every ``every`` seconds whether the client is still there; ClientGone once it
    is not (the caller's cleanup then aborts the work)."""
    next_look = time.monotonic() + every
    for item in items:
        if time.monotonic() >= next_look:
            if client_gone(environ):
                raise ClientGone
            next_look = time.monotonic() + every
        yield item


def until_gone(items: Generator[str, None, None], environ: dict) -> Iterator[str]:
    """A stream's response body: ``items`` (a log's reader, which yields at least every ``LOOK_SECONDS``) until its
    client has left, then closed: the reader leaves as a failed write would have it, and the stream's grace (for a
    resume) starts then, not at the next heartbeat."""
    with contextlib.closing(items):
        try:
            yield from while_connected(items, environ)
        except ClientGone:
            return
