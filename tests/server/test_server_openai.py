"""The official openai client against a real gunicorn server: same text as the offline engine."""

from __future__ import annotations

import uuid

import openai
import pytest
import torch

from wsgi_infer import SamplingParams

from ..support.sse_client import events

pytestmark = pytest.mark.slow  # the default model, generating in float32

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model_with_root(client, model):
    entry = client.models.list().data[0]
    assert entry.id == model == "SmolLM2-135M-Instruct.Q4_1"
    assert entry.root  # vllm bench serve reads it


def test_completions_equal_offline_engine(client, model, default_llm):
    prompt = "The capital of France is"
    expected = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0]
    response = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0)
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)

    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == expected.text
    assert content[-1].choices[0].finish_reason == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert len(content) >= len(expected.token_ids) - 2  # one chunk per step, bar held-back pieces
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.total_tokens == len(expected.prompt_token_ids) + len(expected.token_ids)


def test_chat_equals_offline_engine(client, model, default_llm):
    expected = default_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in expected.text
    response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.completion_tokens == len(expected.token_ids)

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_completion_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = [c for c in chunks if c.choices]
    assert (
        content[0].choices[0].delta.role == "assistant" and content[0].choices[0].delta.content
    )  # role with a real token
    assert all(c.choices[0].delta.role is None for c in content[1:])
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected.text
    assert content[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_n_choices_stream_interleaved_with_exact_usage(client, model):
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Once upon a time",
            max_tokens=8,
            n=3,
            temperature=0.8,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts = {0: "", 1: "", 2: ""}
    order = []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            order.append(choice.index)
    assert set(order) == {0, 1, 2}
    assert order != sorted(order)  # interleaved, not one choice after another
    assert chunks[-1].usage.completion_tokens == 24
    assert len(set(texts.values())) > 1  # seed + index: the choices differ


def test_logprobs_in_chat(client, model, default_llm):
    response = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob <= 0
    # the values are the engine's own: the sampled token's and each top one's
    expected = default_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0].logprobs
    assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    tops = [[t.logprob for t in e.top_logprobs] for e in content]
    assert tops == [pytest.approx([v for _, v in lp.top], abs=1e-4) for lp in expected]


def test_unknown_model_is_a_404_api_error(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert "gpt-9" in str(info.value)


def test_echo_scores_a_prompt_like_transformers(server, default_model_dir):
    """lm-eval-harness's loglikelihood request: echo, logprobs 1, max_tokens 0."""
    from ..support.transformers_reference import reference_prompt_logprobs

    prompt = "Paris is the capital and most populous city of France."
    with server.client() as http:
        body = http.post(
            "/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
        ).json()
        ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    choice = body["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and "".join(logprobs["tokens"]) == prompt
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = reference_prompt_logprobs(default_model_dir, ids)
    torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"][1:]), expected, atol=1e-3, rtol=1e-3)
    for token, logprob, top in zip(
        logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]
    ):
        assert len(top) in (1, 2) and top[token] == logprob  # logprobs 1, and the token's own (lm-eval's is_greedy)
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0


def test_echo_with_generation_streamed_and_not(client, model, server):
    prompts = ["The capital of France is", "Hello"]
    kwargs = dict(model=model, prompt=prompts, max_tokens=5, temperature=0, echo=True)
    whole = sorted(client.completions.create(**kwargs).choices, key=lambda c: c.index)
    texts = ["", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in whole]
    assert all(c.text.startswith(p) and len(c.text) > len(p) for c, p in zip(whole, prompts))
    # a one-token prompt's logprobs: the prompt's token first (its logprob none), then the generated ones
    one = client.completions.create(**{**kwargs, "prompt": "Hello", "logprobs": 1}).choices[0].logprobs
    assert one.tokens[0] == "Hello" and one.token_logprobs[0] is None and one.text_offset[:2] == [0, 5]
    assert len(one.tokens) == 1 + 5
    ids = [9707, 1834, 28]  # a prompt of token ids is echoed as its decoded text
    echoed = client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True).choices[0].text
    with server.client() as http:
        assert echoed == http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_legacy_top_logprobs_list_the_most_likely_first_streamed_or_not(server, model):
    """Clients take a top_logprobs dict's first key for the model's pick: the order is the answer's, not the
    alphabet's (non-streamed answers were written with their keys sorted)."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logprobs": 5}
    with server.client() as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["top_logprobs"]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
            chunks = [e.json for e in events(reply) if e.data and e.data != "[DONE]"]
    streamed = [top for chunk in chunks for top in chunk["choices"][0]["logprobs"]["top_logprobs"]]
    assert [list(top.items()) for top in whole] == [list(top.items()) for top in streamed]
    for top in whole:
        assert list(top.values()) == sorted(top.values(), reverse=True), top


def test_tokenize_and_detokenize_round_trip_with_chat_template(server, default_llm):
    messages = [{"role": "user", "content": "Hi there"}]
    with server.client() as http:
        plain = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        chat = http.post("/tokenize", json={"messages": messages}).json()
        back = http.post("/detokenize", json={"tokens": plain["tokens"]}).json()
        bad = http.post("/detokenize", json={"tokens": [10**9]})
        unknown = http.post("/tokenize", json={"prompt": "x", "model": "nope"})
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] > 0
    assert plain["tokens"] == default_llm.engine.tokenize("Hello world")
    assert len(plain["token_strs"]) == plain["count"]
    assert back["prompt"] == "Hello world"
    assert chat["tokens"] == default_llm.apply_chat_template(messages)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert unknown.status_code == 404


def test_cached_prompt_tokens_are_reported_in_usage(server):
    prompt = f"{uuid.uuid4().hex} " + "A long shared preamble about gardens and rivers. " * 8
    with server.client() as http:
        first, second = (
            http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["usage"] for _ in range(2)
        )
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["prompt_tokens"] and cached % 16 == 0  # whole blocks of the default size


def test_metrics_carry_the_model_name_and_add_up_per_request(server, model):
    """vLLM's series under our prefix: per-request histograms, queue time, tokens per step, prefix cache."""
    prompt = f"{uuid.uuid4().hex} " + "Rivers and gardens, again and again. " * 6
    before = server.metrics()
    with server.client() as http:
        usages = [
            http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()["usage"]
            for _ in range(2)
        ]
    after = server.metrics()

    def grew(name: str) -> float:
        return after[f"wsgi_infer:{name}"] - before.get(f"wsgi_infer:{name}", 0)

    assert grew("request_prompt_tokens_count") == 2
    assert grew("request_prompt_tokens_sum") == sum(u["prompt_tokens"] for u in usages)
    assert grew("request_generation_tokens_sum") == sum(u["completion_tokens"] for u in usages)
    assert grew("request_queue_time_seconds_count") == 2
    computed = sum(
        u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] + u["completion_tokens"] - 1 for u in usages
    )
    assert grew("iteration_tokens_total_sum") == computed  # every token a step computed, no more
    assert grew("prefix_cache_queries_total") == 2 * usages[0]["prompt_tokens"]
    assert grew("prefix_cache_hits_total") == usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    text = server.client().get("/metrics").text
    series = [line for line in text.splitlines() if line.startswith("wsgi_infer:")]
    assert series and all("model_name=" in line for line in series)
    assert any(f'model_name="{model}"' in line for line in series)
    assert "wsgi_infer:num_preemptions_total" in text
