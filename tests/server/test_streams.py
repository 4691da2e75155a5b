"""A request's stream in the hub, without a server: what a reader takes from it, whether its client is there, and
its record batches (``streaming.stream_record``), which come back from their JSON as they were taken."""

from __future__ import annotations

import select
import socket

import pytest

from wsgi_infer.engine.outputs import RequestDelta, TokenLogprob
from wsgi_infer.server.api.continuation import Continuation
from wsgi_infer.server.api.serving import iter_deltas
from wsgi_infer.server.client_connection import ClientGone, client_gone, until_gone, while_connected
from wsgi_infer.server.engine_client.delta_records import decode_batch, encode_batch
from wsgi_infer.server.engine_client.streams import ChoiceDelta, RequestStream
from wsgi_infer.server.streaming import sse
from wsgi_infer.server.streaming.stream_log import StreamLog
from wsgi_infer.server.streaming.stream_record import RequestRecord


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


def test_a_streams_reader_leaves_once_its_client_has_gone_though_nothing_is_written():
    """A stream in a long prefill or a queue writes nothing until its heartbeat: its reader looks at the client's
    socket at each of the log's quiet intervals, and leaves (the stream's grace for a resume starts then)."""
    log = StreamLog("s", grace=60.0, on_release=lambda: None)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client_side = socket.create_connection(listener.getsockname())
        server_side, _ = listener.accept()
    with server_side:
        body = until_gone(log.read(0, heartbeat=60.0), {"gunicorn.socket": server_side})
        assert next(body) == "" and log.readers == 1  # at once: the response's headers go out with it
        log.append(sse.event({"n": 1}))
        assert next(body).startswith("id: 1\n")
        client_side.close()
        assert arrived(server_side)
        assert list(body) == [] and log.readers == 0  # within a look interval, not at the heartbeat a minute away


def test_a_batch_comes_back_whole_logprobs_and_token_texts_included():
    first = RequestDelta(
        "7-0",
        "Hel",
        [15, 16],
        logprobs=[TokenLogprob(15, -0.25, [(15, -0.25), (9, -1.5)]), TokenLogprob(16, -0.125, [])],
        num_prompt_tokens=5,
        num_output_tokens=2,
        num_cached_tokens=4,
        queue_seconds=0.01,
        prompt_token_ids=[1, 2, 3, 4, 5],
        prompt_logprobs=[TokenLogprob(2, -3.0, [(8, -0.5)])],
    )
    last = RequestDelta("7-1", "lo", [17], finish_reason="stop", stop_reason="\n", num_output_tokens=3)
    batch = [ChoiceDelta(0, first, {15: "He", 16: "l", 9: "x"}), ChoiceDelta(1, last)]
    assert decode_batch(encode_batch(batch)) == batch
    record = RequestRecord("/v1/completions", '{"prompt": "é"}', "abc", 2**62, 1796000000)
    assert RequestRecord.decode(record.encode()) == record


def test_a_continuation_gives_each_unfinished_choice_its_tokens_and_none_to_an_ended_one():
    def delta(index: int, tokens: list[int], finish: str | None = None) -> ChoiceDelta:
        return ChoiceDelta(index, RequestDelta(f"k-{index}", "", tokens, finish_reason=finish))

    batches = [[delta(0, [1, 2]), delta(2, [7])], [delta(1, [5], "length"), delta(0, [3])], [delta(2, [8])]]
    assert Continuation("k", list(map(encode_batch, batches)), []).generated(3) == [[1, 2, 3], None, [7, 8]]
