"""The fields vLLM's and llama-server's clients send beyond OpenAI's, over the tiny engine in this process: those we
implement do what those servers do (constraints, min_tokens, add_generation_prompt); every other one that would
change the output is a 400 naming it, unless its value changes nothing."""

from __future__ import annotations

import re

import pytest

from wsgi_infer.engine.sampling import token_bans
from wsgi_infer.server.api.bodies.schemas import CompletionRequest
from wsgi_infer.server.api.chat.schemas import ChatCompletionRequest

from ..support.sse_client import events

ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
ROUTES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
SCHEMA = {"type": "object", "properties": {"warm": {"type": "boolean"}}, "required": ["warm"]}
LARK = 'start: "sunny" | "rainy"'
GBNF = 'root ::= "sunny" | "rainy"'


def base(route: str) -> dict:
    body = {"messages": ASK} if route.endswith("chat/completions") else {"prompt": "The weather in Paris is"}
    return {**body, "max_tokens": 12, "temperature": 0}


def text_of(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("route", ROUTES)
def test_every_field_refused_is_a_400_naming_it_unless_its_value_changes_nothing(tiny_api, route):
    refused = ROUTES[route].refused
    assert {"use_beam_search", "logits_processors", "mirostat", "n_predict", "prediction"} <= set(refused)
    body = {**base(route), "max_tokens": 2}
    with tiny_api.client() as http:
        plain = text_of(http.post(route, json=body).json())
        for name, refusal in refused.items():
            answer = http.post(route, json={**body, name: "x"})
            assert answer.status_code == 400, (name, answer.text)
            error = answer.json()["error"]
            assert (error["param"], error["message"]) == (name, refusal.reason)
            for value in refusal.neutral:
                accepted = http.post(route, json={**body, name: value})
                assert accepted.status_code == 200 and text_of(accepted.json()) == plain, (name, value)
        usage = {"continuous_usage_stats": True}  # vLLM's usage in every chunk
        answer = http.post(route, json={**body, "stream": True, "stream_options": usage}).json()
    assert answer["error"]["param"] == "stream_options.continuous_usage_stats"


CONSTRAINTS = [  # a field of vLLM's or llama-server's, and the structured_outputs it is taken as
    ("guided_json", SCHEMA, {"json": SCHEMA}),
    ("guided_regex", "(sun|rain)y!", {"regex": "(sun|rain)y!"}),
    ("guided_choice", ["sunny", "rainy"], {"choice": ["sunny", "rainy"]}),
    ("guided_grammar", LARK, {"grammar": LARK}),
    ("json_schema", SCHEMA, {"json": SCHEMA}),
    ("grammar", GBNF, {"grammar": GBNF}),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("field", "value", "ours"), CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
def test_other_apis_constraint_fields_constrain_as_structured_outputs_does(tiny_api, route, field, value, ours):
    body = {**base(route), "max_tokens": 40}
    with tiny_api.client() as http:
        theirs = http.post(route, json={**body, field: value})
        expected = http.post(route, json={**body, "structured_outputs": ours})
        unconstrained = http.post(route, json=body)
    assert theirs.status_code == 200, theirs.text
    assert text_of(theirs.json()) == text_of(expected.json()) != text_of(unconstrained.json())
    if field in ("guided_regex", "guided_choice", "guided_grammar", "grammar"):
        assert re.fullmatch(r"(sunny|rainy)!?", text_of(theirs.json()))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "json_schema": SCHEMA}, "json_schema"),
        ({"grammar": GBNF, "guided_choice": ["a"]}, "grammar"),
        ({"guided_regex": "(("}, "guided_regex"),  # does not compile
        ({"guided_choice": ["a"], "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"min_tokens": 13}, "min_tokens"),  # over max_tokens
        ({"min_tokens": 10**6, "max_tokens": None}, "min_tokens"),  # over the room the context window leaves
        ({"min_tokens": 2, "guided_regex": "a+"}, "min_tokens"),
    ],
)
def test_constraints_given_twice_or_beside_tools_and_min_tokens_past_the_end_are_refused_by_name(
    tiny_api, fields, param
):
    with tiny_api.client() as http:
        answer = http.post("/v1/chat/completions", json={**base("/v1/chat/completions"), **fields})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


@pytest.mark.parametrize("route", ROUTES)
def test_min_tokens_keeps_a_stop_string_in_its_text_from_ending_the_reply(tiny_api, route):
    body = {**base(route), "ignore_eos": True}
    with tiny_api.client() as http:
        free = text_of(http.post(route, json=body).json())
        stop = free[1:4]  # in the first few tokens' text
        cut = http.post(route, json={**body, "stop": stop}).json()
        held = http.post(route, json={**body, "stop": stop, "min_tokens": 12}).json()
    assert (text_of(cut), cut["choices"][0]["finish_reason"]) == (free[: free.index(stop)], "stop")
    assert (text_of(held), held["choices"][0]["finish_reason"]) == (free, "length")


def test_add_generation_prompt_false_opens_no_reply_as_tokenize_counts_it(tiny_api):
    body = base("/v1/chat/completions")
    with tiny_api.client() as http:
        counts = [
            (
                http.post("/v1/chat/completions", json={**body, "add_generation_prompt": opens}).json()["usage"],
                http.post("/tokenize", json={"messages": ASK, "add_generation_prompt": opens}).json()["count"],
            )
            for opens in (True, False)
        ]
    (usage_open, tokenized_open), (usage_closed, tokenized_closed) = counts
    assert usage_open["prompt_tokens"] == tokenized_open > usage_closed["prompt_tokens"] == tokenized_closed


def _tokens(reply: dict) -> list[str]:
    """A chat reply's tokens, each as its text (its logprobs' entries)."""
    return [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]


def test_allowed_token_ids_and_bad_words_bar_tokens_on_the_chat_route(tiny_api, monkeypatch):
    """The bad words tokenized on the front end: the engine thread, which every stream waits on, never does it."""

    def on_the_engine_thread(tokenizer, words):
        raise AssertionError("the engine thread tokenized bad words")

    monkeypatch.setattr(token_bans, "spellings", on_the_engine_thread)
    body = {**base("/v1/chat/completions"), "logprobs": True, "ignore_eos": True}
    with tiny_api.client() as http:
        free = _tokens(http.post("/v1/chat/completions", json=body).json())
        words = {"prompt": " sunny rainy cloudy", "add_special_tokens": False}
        ids = http.post("/tokenize", json=words).json()["tokens"]
        pieces = {http.post("/detokenize", json={"tokens": [i]}).json()["prompt"] for i in ids}
        allowed = _tokens(http.post("/v1/chat/completions", json={**body, "allowed_token_ids": ids}).json())
        word = free[0].strip()  # the reply's first token, barred as a word (with and without a space before it)
        barred = _tokens(http.post("/v1/chat/completions", json={**body, "bad_words": [word]}).json())
    assert len(allowed) == 12 and set(allowed) <= pieces and not set(free) <= pieces, (allowed, pieces)
    assert barred[0] != free[0] and all(t.strip() != word for t in barred), (word, barred)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"allowed_token_ids": []}, "non-empty"),
        ({"allowed_token_ids": [10**6]}, "vocabulary size"),
        ({"allowed_token_ids": ["1"]}, "integer"),
        ({"bad_words": [" "]}, "more than whitespace"),
        ({"bad_words": ["sun"], "guided_regex": "a+"}, "constraint"),
        ({"truncate_prompt_tokens": 0}, "-1 (as many as the context window holds) or at least 1"),
        ({"truncate_prompt_tokens": 10**6}, "more than the context window"),
        ({"echo": True, "truncate_prompt_tokens": 4}, "echo cannot be combined"),  # it would not be the prompt read
    ],
)
def test_bad_bans_and_truncations_are_refused_by_name(tiny_api, fields, why):
    with tiny_api.client() as http:
        answer = http.post("/v1/completions", json={**base("/v1/completions"), **fields})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"].startswith(next(iter(fields))), error
    assert why in error["message"], error


def test_truncate_prompt_tokens_reads_the_prompts_last_tokens_on_both_routes(tiny_api):
    long_ask = [{"role": "user", "content": "Tell me about the weather in Paris and in Rome. " * 4}]
    prompt = "The weather in Paris is sunny, and the weather in Rome is"
    with tiny_api.client() as http:
        chat_ids = http.post("/tokenize", json={"messages": long_ask}).json()["tokens"]
        text_ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        replies = {
            route: http.post(route, json={**base(route), **body, "truncate_prompt_tokens": 8}).json()
            for route, body in (
                ("/v1/chat/completions", {"messages": long_ask}),
                ("/v1/completions", {"prompt": prompt}),
            )
        }
        as_ids = [
            http.post("/v1/completions", json={**base("/v1/completions"), "prompt": ids[-8:]}).json()
            for ids in (chat_ids, text_ids)
        ]
        whole = http.post("/v1/completions", json={**base("/v1/completions"), "prompt": prompt}).json()
    assert len(chat_ids) > 8 and len(text_ids) > 8
    for reply, expected in zip(replies.values(), as_ids):
        assert reply["usage"]["prompt_tokens"] == 8 and text_of(reply) == text_of(expected)
    assert text_of(whole) != text_of(replies["/v1/completions"])


@pytest.mark.parametrize("route", ROUTES)
def test_stop_reason_names_the_stop_string_or_token_that_ended_the_reply(tiny_api, route):
    """vLLM's stop_reason: the stop string, or the stop token's id, that ended a choice; null for the length."""
    body = {**base(route), "ignore_eos": True}
    with tiny_api.client() as http:
        free = http.post(route, json={**body, "return_token_ids": True}).json()["choices"][0]
        token = free["token_ids"][3]
        stop = text_of({"choices": [free]})[1:4]
        by_string = http.post(route, json={**body, "stop": stop}).json()["choices"][0]
        by_token = http.post(route, json={**body, "stop_token_ids": [token]}).json()["choices"][0]
        with http.stream("POST", route, json={**body, "stop_token_ids": [token], "stream": True}) as response:
            chunks = [e.json for e in events(response) if e.data and e.data != "[DONE]"]
    assert (free["finish_reason"], free["stop_reason"]) == ("length", None)
    assert (by_string["finish_reason"], by_string["stop_reason"]) == ("stop", stop)
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", token)
    ends = [c for chunk in chunks for c in chunk["choices"] if c["finish_reason"] is not None]
    assert [c["stop_reason"] for c in ends] == [token]
    assert not any("stop_reason" in c for chunk in chunks for c in chunk["choices"] if c["finish_reason"] is None)


@pytest.mark.parametrize("field", [{"max_tokens": 2}, {"n": 2}, {"min_p": 0.5}, {"repetition_penalty": 1.5}])
def test_the_native_apis_fields_are_its_own_and_another_is_a_400(tiny_api, field):
    """/generate's fields are this server's: one of another API's was ignored (max_tokens 2 generated 16)."""
    with tiny_api.client() as http:
        response = http.post("/generate", json={"prompt": "Hi", "max_new_tokens": 2, **field})
        assert response.status_code == 400, response.text
        (name,) = field
        assert response.json()["error"] == {
            "message": f"{name}: no such field here",
            "type": "invalid_request_error",
            "param": name,
            "code": None,
        }
