"""What a response says about its tokens, over the tiny engine in this process: a chat completion's chunks carry its
text and usage; logprobs put a character split over tokens together again; and what vLLM adds: prompt_logprobs (in
vLLM's shape, equal to transformers' reference), return_token_ids (the prompt's and each choice's token ids, in the
response or a stream's chunks) and return_tokens_as_token_ids (logprobs' tokens as "token_id:N")."""

from __future__ import annotations

import pytest
import torch

from wsgi_infer.engine.outputs import RequestDelta, TokenLogprob
from wsgi_infer.server.api.openai.completion_formatter import CompletionFormatter
from wsgi_infer.server.engine_client.streams import ChoiceDelta, RequestStream

from ..support.sse_client import events
from ..support.transformers_reference import load_hf_model
from .weather_tool import ASK

CHAT = {"messages": ASK, "max_tokens": 12, "temperature": 0}
COMPLETION = {"prompt": "The weather in Paris is", "max_tokens": 12, "temperature": 0}


def _reference_prompt_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_model(model_dir)(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)


def test_prompt_logprobs_in_vllms_shape_equal_the_transformers_reference(tiny_api, tiny_model_dirs):
    """Per prompt token after the first: its logprob and rank, and the top n alternatives ranked 1..n; beside
    echo's legacy entries (trimmed to logprobs' own n), and once per chat response."""
    prompt = "The weather in Paris is sunny, and in Rome"
    body = {**COMPLETION, "prompt": prompt, "max_tokens": 1}
    with tiny_api.client() as http:
        ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        vllm = http.post("/v1/completions", json={**body, "prompt_logprobs": 3}).json()["choices"][0]
        both = http.post("/v1/completions", json={**body, "prompt_logprobs": 3, "echo": True, "logprobs": 1}).json()
        chat = http.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 0}).json()
        chat_ids = http.post("/tokenize", json={"messages": ASK}).json()["tokens"]
    reference = _reference_prompt_logprobs(tiny_model_dirs["llama"], ids)
    entries = vllm["prompt_logprobs"]
    assert vllm["logprobs"] is None and entries[0] is None and len(entries) == len(ids)
    for position, (token, entry) in enumerate(zip(ids[1:], entries[1:])):
        row = reference[position]
        own = entry[str(token)]
        assert abs(own["logprob"] - row[token].item()) < 1e-4
        # 1 + the tokens likelier than it, where the reference may differ by 1e-4 (the upper count holds itself)
        higher = (row > row[token] + 1e-4).sum().item(), (row > row[token] - 1e-4).sum().item()
        assert higher[0] + 1 <= own["rank"] <= higher[1], (own, higher)
        top = row.topk(3)
        ranked = {int(t): e for t, e in entry.items() if e["rank"] <= 3}
        assert sorted(ranked) == sorted(top.indices.tolist()) and len(entry) in (3, 4)
        assert all(abs(e["logprob"] - row[t].item()) < 1e-4 for t, e in ranked.items())
    legacy = both["choices"][0]["logprobs"]
    assert [round(lp, 5) for lp in legacy["token_logprobs"][1 : len(ids)]] == [
        round(entry[str(token)]["logprob"], 5) for token, entry in zip(ids[1:], entries[1:])
    ]
    # logprobs' own 1 (not prompt_logprobs' 3) and the token itself: OpenAI's "up to logprobs+1", as vLLM gives them
    for token, logprob, top in zip(legacy["tokens"][1:], legacy["token_logprobs"][1:], legacy["top_logprobs"][1:]):
        assert len(top) in (1, 2) and top[token] == logprob and max(top.values()) >= logprob
    assert len(chat["prompt_logprobs"]) == len(chat_ids) == chat["usage"]["prompt_tokens"]
    assert all(list(e) == [str(t)] for t, e in zip(chat_ids[1:], chat["prompt_logprobs"][1:]))


def test_prompt_logprobs_are_not_streamed(tiny_api):
    with tiny_api.client() as http:
        answer = http.post("/v1/completions", json={**COMPLETION, "prompt_logprobs": 1, "stream": True})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt_logprobs", answer.text


def _streamed(http, route: str, body: dict) -> list[dict]:
    with http.stream("POST", route, json={**body, "stream": True}) as response:
        return [event.json for event in events(response) if event.data and event.data != "[DONE]"]


def test_return_token_ids_give_the_prompts_and_each_choices_ids_whole_and_streamed(tiny_api):
    """Completions: per choice (its prompt's in its first chunk); chat: the prompt's once, in the response or the
    stream's first chunk. A stream's chunks' ids add up to the whole response's, and read as its text."""
    asked = {"return_token_ids": True, "n": 2, "seed": 5, "temperature": 1.0, "ignore_eos": True}
    with tiny_api.client() as http:
        prompt_ids = {
            "/v1/completions": http.post("/tokenize", json={"prompt": COMPLETION["prompt"]}).json()["tokens"],
            "/v1/chat/completions": http.post("/tokenize", json={"messages": ASK}).json()["tokens"],
        }
        for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            whole = http.post(route, json={**body, **asked}).json()
            chunks = _streamed(http, route, {**body, **asked})
            for choice in whole["choices"]:
                ids, text = choice["token_ids"], choice.get("text", choice.get("message", {}).get("content"))
                assert len(ids) == 12 and http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == text
                mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == choice["index"]]
                assert [t for c in mine for t in c.get("token_ids", [])] == ids
                if route == "/v1/completions":
                    assert choice["prompt_token_ids"] == mine[0]["prompt_token_ids"] == prompt_ids[route]
                    assert not any("prompt_token_ids" in c for c in mine[1:])
            if route == "/v1/chat/completions":
                assert whole["prompt_token_ids"] == chunks[0]["prompt_token_ids"] == prompt_ids[route]
                assert not any("prompt_token_ids" in chunk for chunk in chunks[1:])
            plain = http.post(route, json={**body, "n": 2, "seed": 5, "temperature": 1.0, "ignore_eos": True}).json()
            assert "prompt_token_ids" not in plain and all("token_ids" not in c for c in plain["choices"])


def test_return_tokens_as_token_ids_writes_each_logprobs_token_as_its_id(tiny_api):
    with tiny_api.client() as http:
        ids = http.post("/v1/completions", json={**COMPLETION, "return_token_ids": True}).json()["choices"][0]
        legacy = http.post(
            "/v1/completions", json={**COMPLETION, "logprobs": 2, "return_tokens_as_token_ids": True}
        ).json()["choices"][0]["logprobs"]
        chat_ids = http.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True}).json()["choices"][0]
        chat = http.post(
            "/v1/chat/completions",
            json={**CHAT, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True},
        ).json()["choices"][0]["logprobs"]["content"]
    assert legacy["tokens"] == [f"token_id:{t}" for t in ids["token_ids"]]
    assert all(len(top) == 2 and all(k.startswith("token_id:") for k in top) for top in legacy["top_logprobs"])
    assert [e["token"] for e in chat] == [f"token_id:{t}" for t in chat_ids["token_ids"]]
    assert all(bytes(e["bytes"]).decode() == e["token"] for e in chat)
    assert all(top["token"].startswith("token_id:") for e in chat for top in e["top_logprobs"])


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


@pytest.mark.parametrize("n", [0, 2])
def test_the_legacy_top_logprobs_hold_the_sampled_token_too(tiny_api, n):
    """OpenAI's "up to logprobs+1 elements": a client looks up each token in its own entry (logprobs 0: it alone)."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "logprobs": n, "temperature": 1.5, "seed": 3}
    with tiny_api.client() as http:
        logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert top[token] == logprob and n <= len(top) <= n + 1
