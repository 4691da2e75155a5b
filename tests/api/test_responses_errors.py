"""OpenAI's Responses API refusing what it cannot serve as asked, naming the fields and items as sent (not the chat
completion's it runs as), and taking what changes nothing, over the tiny engine in this process."""

from __future__ import annotations

import pytest

ASK = "What is the weather like in Paris today?"
CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}
USER = {"role": "user", "content": ASK}


@pytest.fixture(scope="module")
def model(tiny_api) -> str:
    return tiny_api.manager.model_name


# Function call histories in the chat completion's words before ("messages.2: an assistant message's tool calls ...",
# an index counting the instructions), or a parser's error naming no item.
BROKEN_CALLS = [
    ([USER, CALL, USER, OUTPUT], "input", "Function call outputs must follow their function calls"),
    ([USER, CALL, OUTPUT, OUTPUT], "input", "Duplicate function call output for call_id c1"),
    ([USER, {**CALL, "arguments": "not json"}, OUTPUT], "input.1", "arguments must be JSON text"),
]


@pytest.mark.parametrize(("items", "param", "says"), BROKEN_CALLS)
def test_a_broken_function_call_history_is_named_in_the_responses_words(tiny_api, model, items, param, says):
    with tiny_api.client() as http:
        body = {"model": model, "input": items, "instructions": "Be brief.", "max_output_tokens": 2}
        error = http.post("/v1/responses", json=body).json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert "messages" not in error["message"] and "tool_call" not in error["message"]


def test_an_earlier_replys_refusal_is_its_text(tiny_api, model):
    """A history from OpenAI's API may hold a refusal part: it was a 400 (chat reads a refusal as text)."""
    said = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot say."}]}
    with tiny_api.client() as http:
        reply = http.post("/v1/responses", json={"model": model, "input": [USER, said, USER], "max_output_tokens": 2})
        assert reply.status_code == 200, reply.text
        tokens = http.post("/v1/responses", json={"model": model, "input": [USER, USER], "max_output_tokens": 2})
    assert reply.json()["usage"]["input_tokens"] > tokens.json()["usage"]["input_tokens"]  # the model read it


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"input": "1," * 34_000, "max_output_tokens": 2}, "input"),  # a token a byte: past the window (65,536)
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ],
)
def test_a_conversation_past_the_window_names_the_fields_sent(tiny_api, model, change, param):
    """Not the chat completion's prompt and max_tokens, which the client never sent."""
    with tiny_api.client() as http:
        error = http.post("/v1/responses", json={"model": model, "input": ASK, **change}).json()["error"]
    assert error["param"] == param and "context window" in error["message"]
    assert "input (" in error["message"] and "max_output_tokens (" in error["message"], error["message"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"input": [{"type": []}]}, "input.0"),  # no key to look up: it was a 500 (found by the fuzzer)
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": []}]}]}, "input.0.content.0.text"),
        ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text"}]}]}, "input.0.summary.0.text"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        # the chat completion's names, which the client never sent, before
        ({"max_output_tokens": 10**6}, "max_output_tokens"),  # over the context window
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "text.format"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "integer"}}]}, "tools.0"),
        # ignored though they change the output, before
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"verbosity": "bogus"}}, "text.verbosity"),
        ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "context_management"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
        ({"reasoning": {"context": "all_turns"}}, "reasoning.context"),
        ({"reasoning": {"mode": "pro"}}, "reasoning.mode"),
        ({"reasoning": {"effort": "bogus"}}, "reasoning.effort"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),  # no schema: any JSON, before
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format"),
        # chat completions' (a shared set of parameters, extra_body), ignored before
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"stop": [" "]}, "stop"),
        ({"seed": 1}, "seed"),
        ({"messages": [{"role": "user", "content": "something else"}]}, "messages"),
    ],
)
def test_what_is_not_supported_is_a_400_naming_the_field(tiny_api, model, change, param):
    with tiny_api.client() as http:
        reply = http.post("/v1/responses", json={"model": model, "input": ASK, "max_output_tokens": 2, **change})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_the_values_of_those_fields_that_change_nothing_are_accepted(tiny_api, model):
    neutral = {
        "text": {"verbosity": "medium"},
        "context_management": [],
        "reasoning": {"context": "auto", "mode": "standard"},
    }
    with tiny_api.client() as http:
        reply = http.post("/v1/responses", json={"model": model, "input": ASK, "max_output_tokens": 2, **neutral})
    assert reply.status_code == 200, reply.text
