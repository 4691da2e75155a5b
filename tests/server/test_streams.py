"""A request's stream in the hub, without a server: what a reader takes from it, and whether its client is there."""

from __future__ import annotations

import select
import socket

import pytest

from wsgi_infer.engine.outputs import RequestDelta
from wsgi_infer.server.api.serving import iter_deltas
from wsgi_infer.server.client_connection import ClientGone, client_gone, while_connected
from wsgi_infer.server.engine_client.streams import ChoiceDelta, RequestStream


def test_a_reader_that_falls_behind_still_gets_the_end():
    stream = RequestStream("r", 1, key="0")
    stream.push(ChoiceDelta(0, RequestDelta("0-0", "Hel", [1])))
    reader = iter_deltas(stream, heartbeat=1.0)
    first = next(reader)
    # While the reader is busy with its first piece (a slow socket, a Redis write), the
    # engine finishes the request: the last piece is pushed before the reader takes it.
    stream.push(ChoiceDelta(0, RequestDelta("0-0", "lo", [2], finish_reason="length")))
    rest = list(reader)
    pieces = [choice.delta for batch in [first, *rest] for choice in batch]
    assert [d.text for d in pieces] == ["Hel", "lo"] and pieces[-1].finish_reason == "length"


def arrived(sock: socket.socket) -> bool:
    """Whether something (bytes, or the peer's end of the stream) has reached ``sock``, waiting up to 10 s for it."""
    return bool(select.select([sock], [], [], 10)[0])


def test_a_client_is_gone_once_its_end_of_the_connection_closes():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client_side = socket.create_connection(listener.getsockname())
        server_side, _ = listener.accept()
    environ = {"gunicorn.socket": server_side}
    with server_side:
        assert not client_gone(environ) and not client_gone({})  # connected; no socket (a test client)
        client_side.sendall(b"GET /next HTTP/1.1\r\n")  # a pipelined request: still there
        assert arrived(server_side) and not client_gone(environ)
        assert server_side.recv(100)
        client_side.close()
        assert arrived(server_side) and client_gone(environ)  # its end of the stream
        with pytest.raises(ClientGone):
            list(while_connected(range(3), environ, every=0))
    assert client_gone(environ)  # its own end closed too
