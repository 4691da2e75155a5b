"""Calls and constraints the grammar forces whatever the weights, over the tiny engine in this process (the fast
tier): a named or required tool's call, one cut short, a JSON schema or a choice, tools beside a response format,
and a Llama 3 template's calls in its own JSON."""

from __future__ import annotations

import json
import shutil

import pytest

from ..conftest import tiny_settings
from ..support.in_process import InProcessServer
from ..support.sse_client import events
from .weather_tool import ASK, TOOLS, UNIT

NEWLINE = 198  # the token of "\n" in the tiny models' (SmolLM2's) vocabulary
LESS_THAN = 44  # of "<", the first of "<tool_call>"'s


@pytest.mark.parametrize("parallel", [False, True, None])
def test_a_named_tool_is_called_once_with_arguments_its_schema_allows(tiny_api, parallel):
    """Exactly one call of the named function, whatever parallel_tool_calls says (as OpenAI and vLLM do: clients
    that take structured output through a forced function rely on it)."""
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        **({"parallel_tool_calls": parallel} if parallel is not None else {}),
        "max_tokens": 80,
        "logit_bias": {NEWLINE: 100},  # a newline after a call would open another, where one is allowed
        "temperature": 0,
    }
    with tiny_api.client() as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [e.json for e in events(r) if e.data and e.data != "[DONE]"]
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["unit"] in UNIT["enum"]
    parts = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls") or []]
    assert {p["index"] for p in parts} == {0} and parts[0]["function"]["name"] == "get_weather"
    assert "".join(p["function"].get("arguments") or "" for p in parts) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("limit", "finish", "arguments"),
    [
        ({"max_tokens": 2}, "length", None),  # cut before the call's name: no call, and its markup is no content
        ({"stop": ['"unit"']}, "stop", "{"),  # a stop string in the arguments: a call begun, not made
    ],
)
def test_a_call_cut_short_is_not_called_and_reads_the_same_streamed_or_not(tiny_api, limit, finish, arguments):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0, **limit}
    with tiny_api.client() as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [e.json for e in events(r) if e.data and e.data != "[DONE]"]
    [choice] = whole["choices"]
    assert choice["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] == finish  # not "tool_calls"
    assert choice["message"]["content"] is None and not any(c["choices"][0]["delta"].get("content") for c in chunks)
    calls = [c["function"]["arguments"] for c in choice["message"].get("tool_calls", [])]
    parts = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls") or []]
    streamed = "".join(p["function"].get("arguments") or "" for p in parts) if parts else None
    assert calls == ([] if arguments is None else [arguments]) and streamed == arguments


def test_a_json_object_with_a_schema_follows_the_schema(tiny_api):
    """response_format {"type": "json_object", "schema": ...}: the form llama-server honours, which instructor's
    JSON_SCHEMA mode sends; the schema is not dropped for free JSON."""
    schema = {"type": "object", "properties": {"unit": UNIT}, "required": ["unit"], "additionalProperties": False}
    body = {"messages": ASK, "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}}
    with tiny_api.client() as http:
        reply = http.post(
            "/v1/chat/completions", json={**body, "response_format": {**body["response_format"], "schema": schema}}
        )
        refused = http.post(
            "/v1/chat/completions", json={**body, "response_format": {"type": "text", "schema": schema}}
        )
    assert set(json.loads(reply.json()["choices"][0]["message"]["content"])) == {"unit"}
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"


def test_a_choice_constraint_holds_streamed_and_not(tiny_api):
    body = {"prompt": "Yes or no?", "max_tokens": 10, "structured_outputs": {"choice": ["yes", "no", "maybe"]}}
    with tiny_api.client() as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            streamed = "".join(e.json["choices"][0]["text"] for e in events(r) if e.data and e.data != "[DONE]")
    assert whole["text"] in ("yes", "no", "maybe") and whole["finish_reason"] == "stop"
    assert streamed in ("yes", "no", "maybe")


@pytest.mark.parametrize(("bias", "way"), [({}, "answer"), ({NEWLINE: 100}, "answer"), ({LESS_THAN: 100}, "call")])
def test_tools_beside_a_response_format_give_a_call_or_an_answer_in_the_schema(tiny_api, bias, way):
    """As OpenAI takes them (openai-agents sends both for an agent with tools and an output type): a reply that
    calls nothing follows the schema. The tiny random model answers unless a bias starts a call; each way is
    checked."""
    schema = {"type": "object", "properties": {"unit": UNIT}, "required": ["unit"], "additionalProperties": False}
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        "logit_bias": bias,
        "max_tokens": 200,  # room for the whitespace JSON allows
        "temperature": 0,
    }
    with tiny_api.client() as http:
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert ("call" if message.get("tool_calls") else "answer") == way, message
    if way == "call":
        assert json.loads(message["tool_calls"][0]["function"]["arguments"])["unit"] in UNIT["enum"]
    else:
        assert json.loads(message["content"])["unit"] in UNIT["enum"]


# A chat template that asks for tool calls as Llama 3.1 and 3.2's does (its rendering kept short).
LLAMA3_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nGiven the following functions, please respond with a JSON for a function call "
    'with its proper arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}. Do not use variables.\n\n'
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def llama3_style_api(tiny_model_dirs, tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama3-style")
    shutil.copytree(tiny_model_dirs["llama"], directory, dirs_exist_ok=True)
    (directory / "chat_template.jinja").write_text(LLAMA3_STYLE_TEMPLATE)
    with InProcessServer(tiny_settings(tiny_model_dirs, model=directory)) as server:
        yield server


def test_a_llama3_template_gets_its_calls_in_llama3s_json(llama3_style_api, parsed_texts):
    """The call the grammar forces is Llama 3's ``{"name": ..., "parameters": ...}``, and it comes back as a call."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "temperature": 0}
    with llama3_style_api.client() as http:
        whole = http.post("/v1/chat/completions", json=body).json()
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["unit"] in UNIT["enum"]
    assert parsed_texts[-1] == f'{{"name": "get_weather", "parameters": {call["function"]["arguments"]}}}'
