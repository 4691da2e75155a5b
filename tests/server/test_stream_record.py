"""A stream's record batches (``streaming.stream_record``) come back from their JSON as they were taken."""

from __future__ import annotations

from wsgi_infer.engine.outputs import RequestDelta, TokenLogprob
from wsgi_infer.server.api.continuation import Continuation
from wsgi_infer.server.engine_client.delta_records import decode_batch, encode_batch
from wsgi_infer.server.engine_client.streams import ChoiceDelta
from wsgi_infer.server.streaming.stream_record import RequestRecord


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
