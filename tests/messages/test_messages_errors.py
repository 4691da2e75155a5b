"""Anthropic's Messages API refusing what Anthropic's refuses, in Anthropic's shape and words, naming the block at
fault by its place in the request, over the tiny engine in this process."""

from __future__ import annotations

import pytest

ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SYSTEM = "You answer in one short sentence."
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
USE = {"type": "tool_use", "id": "a", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "a", "content": "Sunny"}


def turns(uses: list[dict], results: list[dict]) -> dict:
    """A conversation whose assistant turn holds ``uses`` and whose next user turn ``results``."""
    used = {"role": "assistant", "content": uses}
    return {"tools": [TOOL], "messages": [*ASK, used, {"role": "user", "content": results}]}


FORMAT = {"type": "json_schema", "schema": {"type": "object"}}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
# Tool turns the chat template would have shown wrong, or whose error named the chat completion's fields (a message
# index counting the system prompt and each result, "tool_call_id", "tools.0.function.name").
BROKEN_TOOL_TURNS = [
    ({**turns([USE], [RESULT, RESULT]), "system": SYSTEM}, "messages.2.content: each tool_use must have a single"),
    (turns([USE, USE], [RESULT]), "messages.1.content: tool_use ids must be unique"),
    (turns([{**USE, "id": ""}], [{**RESULT, "tool_use_id": ""}]), "messages.1.content.0: String should have at least"),
    (turns([USE], [{**RESULT, "content": [IMAGE]}]), "tool_result content blocks of type 'image' are not supported"),
    ({"tools": [{**TOOL, "name": "bad name!"}]}, "tools.0: String should match pattern"),
    ({"tools": [{**TOOL, "input_schema": {"type": "integer"}}]}, 'type "object", not "integer"'),
    (
        {"messages": [*ASK, {"role": "assistant", "content": "The weather is "}]},  # a prefill ending in a space
        "messages.1: final assistant content cannot end with trailing whitespace",
    ),
]


@pytest.fixture(scope="module")
def model(tiny_api) -> str:
    return tiny_api.manager.model_name


# Conversations with no message to answer (each was a 500) and a user message with no content, which Anthropic refuses
# (with a system prompt, it was dropped and the reply read the system prompt alone).
EMPTY = [
    {"messages": [{"role": "user", "content": []}]},
    {"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm."}]}]},
    {"system": [], "messages": [{"role": "user", "content": []}]},
    {"system": SYSTEM, "messages": [{"role": "user", "content": []}]},
]


@pytest.mark.parametrize(
    ("change", "status", "kind", "names"),
    [
        *((change, 400, None, "messages") for change in EMPTY),
        ({"max_tokens": 0}, 400, None, "max_tokens"),  # at least 1, as Anthropic's API has it: it was an empty 200
        ({"output_config": {"effort": "most"}}, 400, None, "effort"),  # not one of Anthropic's: it was ignored
        ({"thinking": {"type": "adaptive", "display": "none"}}, 400, None, "display"),
        ({"stop_sequences": [""]}, 400, None, "stop_sequences"),  # it named the chat completion's stop
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"model": None}, 400, "invalid_request_error", "model"),  # required, as Anthropic's API has it
        ({"model": "claude-sonnet-4-5"}, 404, "not_found_error", "claude-sonnet-4-5"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, None, "'image'"),
        ({"messages": [{"role": "user", "content": [{"type": {}}]}]}, 400, None, "type {}"),  # it was a 500
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, None, "built-in tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, None, "thinking budgets"),
        ({"tool_choice": {"type": "tool"}}, 400, None, "needs a name"),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, 400, None, "MCP"),
        ({"container": "container_011"}, 400, None, "code execution containers"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, 400, None, "context_management"),
        ({"output_config": {"format": FORMAT}, "output_format": FORMAT}, 400, None, "send one of them"),
        ({"temperature": -1}, 400, None, "temperature"),
        ({"temperature": 1.5}, 400, None, "temperature"),  # Anthropic's range is 0 to 1: it was taken
        *((change, 400, None, names) for change, names in BROKEN_TOOL_TURNS),
    ],
)
def test_bad_requests_get_anthropic_shaped_errors(tiny_api, model, change, status, kind, names):
    body = {"model": model, "messages": ASK, "max_tokens": 4, **change}
    with tiny_api.client() as http:
        reply = http.post("/v1/messages", json={k: v for k, v in body.items() if v is not None})
    assert reply.status_code == status
    error = reply.json()
    assert error["type"] == "error" and names in error["error"]["message"]
    assert error["error"]["type"] == (kind or "invalid_request_error")


@pytest.mark.parametrize("body", EMPTY)
def test_count_tokens_refuses_a_conversation_with_nothing_to_count(tiny_api, model, body):
    with tiny_api.client() as http:
        reply = http.post("/v1/messages/count_tokens", json={"model": model, **body})
    assert reply.status_code == 400 and "messages" in reply.json()["error"]["message"]


def test_tool_results_in_consecutive_user_messages_are_one_turn(tiny_api, model):
    """As Anthropic's API joins consecutive messages of one role: a message per result (as converters from OpenAI's
    tool message per call write them) was a 400 blaming the assistant's message; a use left unanswered still is."""
    results = [RESULT, {**RESULT, "tool_use_id": "b", "content": "Rain"}]
    joined = turns([USE, {**USE, "id": "b"}], results)
    split = [{"role": "user", "content": [result]} for result in results]
    bodies = [joined, {**joined, "messages": [*joined["messages"][:-1], *split]}]
    bodies.append({**joined, "messages": [*joined["messages"][:-1], split[0], {"role": "user", "content": "Well?"}]})
    with tiny_api.client() as http:
        counts = [http.post("/v1/messages/count_tokens", json={"model": model, **body}) for body in bodies]
    assert counts[0].status_code == counts[1].status_code == 200 and counts[0].json() == counts[1].json()
    assert counts[2].status_code == 400, counts[2].text
    assert counts[2].json()["error"]["message"].startswith("messages.1: `tool_use` ids were found without"), counts[2]
