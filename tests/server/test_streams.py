"""A request's stream in the hub, without a server: what a reader takes from it."""

from __future__ import annotations

from wsgi_infer.engine.outputs import RequestDelta
from wsgi_infer.server.api.serving import iter_deltas
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
