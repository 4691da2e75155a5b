"""A body's JSON read as JSON means it, on every route (in this process): NaN, Infinity and brackets nested past the
bound are a 400, not a number that passes every range check or a RecursionError's 500; a value is taken only as its
own JSON type (``true`` is no 1, ``"2"`` no 2, ``2.0`` no token count); null is an optional field's default, as
OpenAI takes it; a field that failed every form it takes is named as the body spells it."""

from __future__ import annotations

import json

import pytest

from wsgi_infer.engine.sampling_params import InvalidParameter, SamplingParams
from wsgi_infer.server.request_json import MAX_DEPTH

from .weather_tool import ASK

JSON_ROUTES = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/generate",
    "/tokenize",
    "/detokenize",
    "/models/load",
]
GREEDY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}


def limit(route: str) -> dict:
    """Two tokens, by the route's own name for them (/v1/responses refuses chat's)."""
    return {"max_output_tokens" if route == "/v1/responses" else "max_tokens": 2}


@pytest.mark.parametrize("route", JSON_ROUTES)
@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b'{"prompt": "Hi", "logit_bias": {"5": NaN}}', "NaN is not a JSON number"),
        (b'{"prompt": "Hi", "temperature": Infinity}', "Infinity is not a JSON number"),
        (b'{"prompt": "Hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", f"deeper than {MAX_DEPTH} levels"),
        (b'{"prompt": "Hi", "x": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", f"deeper than {MAX_DEPTH} levels"),
    ],
    ids=["nan", "infinity", "past-the-stack", "one-past-the-bound"],
)
def test_what_json_is_not_is_a_400_on_every_route(tiny_api, route, raw, said):
    with tiny_api.client() as http:
        response = http.post(route, content=raw, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        assert said in response.json()["error"]["message"]


def test_a_nan_bias_leaves_the_engine_serving_and_nesting_within_the_bound_is_read(tiny_api):
    """A NaN bias reached the engine, whose step raised and stopped it: every stream lost, the worker restarted."""
    within = b'{"prompt": "Hello", "max_tokens": 4, "temperature": 0, "x": ' + b"[" * (MAX_DEPTH - 1)
    within += b"]" * (MAX_DEPTH - 1) + b"}"
    with tiny_api.client() as http:
        nan = http.post("/v1/completions", content=b'{"prompt": "Hi", "logit_bias": {"5": NaN}}')
        assert nan.status_code == 400, nan.text
        plain = http.post("/v1/completions", json=GREEDY)
        nested = http.post("/v1/completions", content=within, headers={"Content-Type": "application/json"})
        assert plain.status_code == nested.status_code == 200, (plain.text, nested.text)
        assert nested.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [  # each was taken by pydantic's lax mode as the number or the id beside it
        ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, "max_tokens"),  # 1
        ("/v1/completions", {"prompt": "Hi", "max_tokens": "2"}, "max_tokens"),  # 2
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2.0}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "n": True}, "n"),
        ("/v1/completions", {"prompt": "Hi", "seed": True}, "seed"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": True}, "logprobs"),  # 1 alternative
        ("/v1/completions", {"prompt": "Hi", "temperature": "0"}, "temperature"),  # greedy
        ("/v1/completions", {"prompt": "Hi", "temperature": True}, "temperature"),
        ("/v1/chat/completions", {"messages": ASK, "top_k": True}, "top_k"),
        ("/v1/chat/completions", {"messages": ASK, "min_tokens": "1"}, "min_tokens"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"+50": 5}}, "logit_bias.+50"),  # token 50's bias
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"050": 5}}, "logit_bias.050"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5_0": 5}}, "logit_bias.5_0"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {" 50": 5}}, "logit_bias. 50"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"50": True}}, "logit_bias.50"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"50": "1"}}, "logit_bias.50"),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": True}, "max_output_tokens"),
        ("/v1/messages", {"messages": ASK, "max_tokens": True}, "max_tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens.0"),  # "<|im_start|>"
        ("/detokenize", {"tokens": [1.0]}, "tokens.0"),
    ],
)
def test_a_value_is_taken_as_its_own_json_type_only(tiny_api, route, fields, param):
    with tiny_api.client() as http:
        response = http.post(route, json={"model": tiny_api.manager.model_name, **limit(route), **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]  # Anthropic's has no param: its message names the field
        assert error["param"] == param if "param" in error else error["message"].startswith(param), error


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("/v1/responses", {"input": [5]}, "input"),  # pydantic's location: input.str
        ("/v1/chat/completions", {"messages": ASK, "tool_choice": "bogus"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ],
)
def test_a_field_that_fails_every_form_it_takes_is_named_as_sent(tiny_api, route, fields, param):
    with tiny_api.client() as http:
        response = http.post(route, json={**limit(route), **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(f"{param}: none of the forms it takes: ")


def test_null_is_an_optional_fields_default_as_openai_takes_it(tiny_api):
    """The openai SDK sends ``n=None`` as null; ``max_tokens`` null keeps its meaning (as much as the window holds)."""
    nulls = {"n": None, "stream": None, "logprobs": None, "parallel_tool_calls": None, "stream_options": None}
    chat = {"messages": ASK, "max_tokens": 4, "temperature": 0}
    with tiny_api.client() as http:
        plain, given = (http.post("/v1/chat/completions", json={**chat, **extra}) for extra in ({}, nulls))
        assert plain.status_code == given.status_code == 200, given.text
        assert given.json()["choices"] == plain.json()["choices"]
        required = http.post("/v1/chat/completions", json={**chat, "messages": None})
        assert required.status_code == 400 and required.json()["error"]["param"] == "messages"


def test_stream_options_without_stream_is_a_400_as_openai_answers(tiny_api):
    with tiny_api.client() as http:
        body = {**GREEDY, "stream_options": {"include_usage": True}}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options", response.text
        assert http.post("/v1/completions", json={**body, "stream": True}).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"seed": 2**63}, "seed", "less than or equal to 9223372036854775807"),  # it was 0's generator, as 2**64's
        ({"seed": -(2**63) - 1}, "seed", "greater than or equal to -9223372036854775808"),
        ({"logit_bias": {"-1": 1}}, "logit_bias.-1", "token ids are at least 0"),  # it said "a valid integer"
    ],
)
def test_values_past_a_fields_range_are_refused_by_its_bounds(tiny_api, fields, param, says):
    with tiny_api.client() as http:
        response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and says in error["message"], error
        top = {"prompt": "Hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2}  # the second choice's seed wraps round
        assert http.post("/v1/completions", json=top).status_code == 200
    with pytest.raises(InvalidParameter, match="seed"):
        SamplingParams(seed=2**64)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_with_include_usage_every_chunk_says_usage_null_until_the_last(tiny_api, route):
    """OpenAI's: "All other chunks will also include a usage field, but with a null value" (a typed client reads
    the field in each; it was absent)."""
    body = {**GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    if route.endswith("chat/completions"):
        body = {**body, "messages": ASK}
        del body["prompt"]
    with tiny_api.client() as http:
        reply = http.post(route, json=body)
    chunks = [json.loads(line[len("data: ") :]) for line in reply.text.splitlines() if line.startswith("data: {")]
    # one chunk at least before the usage: a slow reader takes the four tokens in one wake-up, merged into one chunk
    assert len(chunks) >= 2 and all("usage" in chunk and chunk["usage"] is None for chunk in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
