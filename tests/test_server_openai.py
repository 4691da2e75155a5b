"""The official openai client against a real gunicorn server: same text as the offline engine."""

from __future__ import annotations

import openai
import pytest

from wsgi_infer import SamplingParams

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


def test_logprobs_in_chat(client, model):
    response = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob <= 0


def test_unknown_model_is_a_404_api_error(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert "gpt-9" in str(info.value)
