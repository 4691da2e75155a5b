"""The OpenAI API's replies over the tiny engine, in this process (the fast tier): a chat completion's chunks
carry its text and usage, and logprobs put a character split over tokens together again."""

from __future__ import annotations

from wsgi_infer.engine.outputs import RequestDelta, TokenLogprob
from wsgi_infer.server.api.openai.completion_formatter import CompletionFormatter
from wsgi_infer.server.engine_client.streams import ChoiceDelta, RequestStream

from ..support.sse_client import events
from .weather_tool import ASK


def test_a_chat_completion_and_its_chunks_carry_the_same_text_and_usage(tiny_api):
    body = {"messages": ASK, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with tiny_api.client() as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/chat/completions", json=stream_body) as r:
            chunks = [e for e in events(r) if e.data]
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    [choice] = whole["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 8
    assert chunks[-1].data == "[DONE]"
    usage_chunk, content = chunks[-2].json, [c.json for c in chunks[:-2]]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert usage_chunk["choices"] == [] and [usage_chunk["usage"][k] for k in counts] == [
        whole["usage"][k] for k in counts
    ]
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt, again
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == content[0]["id"] for c in content)
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in content) == choice["message"]["content"]
    assert content[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs_bytes_put_a_character_split_over_tokens_together_again(tiny_api):
    tokenizer = tiny_api.manager.default.tokenizer
    pieces = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(pieces) > 1 and all(tokenizer.decode([t]) == "\ufffd" for t in pieces)  # each piece alone reads so
    body = {"messages": ASK, "max_tokens": 1, "logprobs": True, "top_logprobs": 2}
    with tiny_api.client() as http:  # each piece made the reply's one token in turn
        replies = [http.post("/v1/chat/completions", json={**body, "logit_bias": {str(t): 100}}).json() for t in pieces]
    [entries] = zip(*(r["choices"][0]["logprobs"]["content"] for r in replies), strict=True)
    assert [e["token"] for e in entries] == ["\ufffd"] * len(pieces)
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "🎉"


def test_the_legacy_top_logprobs_keep_the_likelier_of_tokens_that_read_alike():
    # two pieces of characters, both "\ufffd" as text: the likelier one's logprob, whichever comes last
    stream = RequestStream("r", 1, key="0")
    top = [(7, -0.5), (8, -2.0), (9, -3.0)]
    delta = RequestDelta("r-0", "", [8], logprobs=[TokenLogprob(8, -2.0, top)])
    choice = ChoiceDelta(0, delta, {7: "\udcf0\udc9f", 8: "\udc8e", 9: "a"})
    for order in (top, top[::-1]):
        choice.delta.logprobs[0].top = order
        logprobs = CompletionFormatter(stream, "text_completion").final_choice(choice)["logprobs"]
        assert logprobs["tokens"] == ["\ufffd"] and logprobs["top_logprobs"] == [{"\ufffd": -0.5, "a": -3.0}]
