"""Structured outputs and logit_bias over HTTP, with the real openai client."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from enum import StrEnum

import pytest
from pydantic import BaseModel, ConfigDict, Field

from wsgi_infer import SamplingParams

pytestmark = pytest.mark.slow  # the default model, generating in float32


class Unit(StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Place(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Forecast(BaseModel):
    place: Place
    unit: Unit
    temperatures: list[int] = Field(min_length=1, max_length=4)
    humidity: int = Field(ge=0, le=100)


ASK = [{"role": "user", "content": "Give a short weather forecast for Paris as JSON."}]


def test_chat_parse_returns_the_pydantic_object_streamed_and_not(packed_client, packed_model):
    client, model = packed_client, packed_model  # the fast path: no offline output to equal
    parsed = client.chat.completions.parse(
        model=model, messages=ASK, response_format=Forecast, temperature=0, max_tokens=200
    )
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    with client.chat.completions.stream(
        model=model, messages=ASK, response_format=Forecast, temperature=0, max_tokens=200
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == choice.message.content
    assert final.choices[0].message.parsed == choice.message.parsed


CONSTRAINTS = [
    ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": Place.model_json_schema()}}},
        Place.model_validate_json,
    ),
    ({"structured_outputs": {"regex": r"[A-Z][a-z]+, [0-9]{4}"}}, lambda t: re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", t)),
    ({"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}}, lambda text: text in ("Paris", "Lyon", "Nice")),
    (
        {"structured_outputs": {"grammar": 'start: "City: " /[A-Z][a-z]{2,9}/'}},
        lambda t: re.fullmatch(r"City: [A-Z][a-z]{2,9}", t),
    ),
]


@pytest.mark.parametrize(
    ("fields", "check"), CONSTRAINTS, ids=["json_object", "json_schema", "regex", "choice", "lark"]
)
def test_completions_honour_every_constraint_streamed_and_not(server, fields, check):
    body = {
        "prompt": "Q: What is the capital of France? Reply as a JSON object.\nA:",
        "max_tokens": 60,
        "temperature": 0,
        **fields,
    }
    with server.client() as http:
        whole = http.post("/v1/completions", json=body)
        assert whole.status_code == 200, whole.text
        text = whole.json()["choices"][0]["text"]
        assert check(text), text
        assert whole.json()["choices"][0]["finish_reason"] == "stop"
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
            events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == text


def test_sampled_choices_each_follow_the_constraint(packed_client, packed_model):
    client, model = packed_client, packed_model  # the fast path: no offline output to equal
    response = client.chat.completions.create(
        model=model,
        messages=ASK,
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": Place.model_json_schema()}},
    )
    texts = [c.message.content for c in response.choices]
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        Place.model_validate_json(choice.message.content)
    assert len(set(texts)) > 1


def test_logit_bias_over_http_equals_the_offline_engine(client, model, default_llm):
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=6)
    first = default_llm.generate(prompt, greedy)[0].token_ids[0]
    biased = default_llm.generate(prompt, replace(greedy, logit_bias={first: -100}))[0]
    assert biased.token_ids[0] != first
    response = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, logit_bias={str(first): -100}
    )
    assert response.choices[0].text == biased.text


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [IMAGE]}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, AUDIO]}]},
            "messages",
        ),
        ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"prediction": {"type": "content", "content": "Paris"}}, "prediction"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/completions", {"suffix": " the end."}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"max_completion_tokens": 40}, "max_completion_tokens"),  # chat's: was ignored
        ("/v1/completions", {"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_fields_that_would_change_the_output_are_refused_by_name(server, route, fields, param):
    base = {"messages": ASK} if route.endswith("chat/completions") else {"prompt": "Hi"}
    with server.client() as http:
        response = http.post(route, json={**base, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_fields_that_change_nothing_are_accepted(server):
    neutral = {"metadata": {"team": "a"}, "store": False, "user": "u1", "service_tier": "auto", "modalities": ["text"]}
    body = {"messages": ASK, "max_tokens": 6, "temperature": 0}
    with server.client() as http:
        plain = http.post("/v1/chat/completions", json=body)
        with_neutral = http.post("/v1/chat/completions", json={**body, **neutral})
    assert plain.status_code == with_neutral.status_code == 200
    assert with_neutral.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
