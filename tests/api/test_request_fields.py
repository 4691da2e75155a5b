"""The OpenAI API's request fields over the tiny engine, in this process (the fast tier): requests refused by the
field at fault (400s naming it), and fields honoured as OpenAI and vLLM do (stop fields, a continued final
message, max_completion_tokens of 0, a refusal sent back)."""

from __future__ import annotations

import pytest

from wsgi_infer.engine.sampling_params import SamplingParams
from wsgi_infer.engine.text.chat_template import chat_prompt_ids
from wsgi_infer.server.api.chat.schemas import ChatCompletionRequest
from wsgi_infer.server.api.messages.schemas import MessagesRequest
from wsgi_infer.server.api.responses.schemas import input_messages

from .weather_tool import ASK, TOOLS

PARAMETERS = "tools.0.function.parameters"
BAD_PROPERTY = {"type": "object", "properties": {"x": {"type": "strin"}}}  # refused by the grammar's compiler


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "logprobs": True}, "logprobs"),
        ({"tools": TOOLS, "structured_outputs": {"regex": "a"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]}, PARAMETERS),
        # not an object: the call's parser read past a number's end into the markup (arguments '1}\n</tool_call>')
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}]}, PARAMETERS),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_PROPERTY}}]}, "tools"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(tiny_api, fields, param):
    with tiny_api.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [  # values pydantic's lax mode took (as 1, True), and fields that were ignored though they change the output
        ("/v1/completions", {"prompt": [True]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2.0]]}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "Hi", "stop": ""}, "stop"),
        ("/v1/completions", {"prompt": "Hi", "priority": True}, "priority"),
        ("/v1/completions", {"prompt": "Hi", "cache_salt": 7}, "cache_salt"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0"),
        ("/v1/chat/completions", {"messages": [*ASK, {"role": "assistant", "content": None}]}, "messages.1"),
        ("/v1/chat/completions", {"messages": ASK, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": ASK, "tools": TOOLS * 2}, "tools"),
        ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "bogus"}, "reasoning_effort"),
        ("/v1/chat/completions", {"messages": ASK, "verbosity": "high"}, "verbosity"),  # only medium, the default
        ("/v1/chat/completions", {"messages": ASK, "verbosity": "bogus"}, "verbosity"),
        ("/v1/chat/completions", {"messages": [{**ASK[0], "name": 5}]}, "messages.0.name"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [*ASK, {"role": "assistant", "content": "It"}], "continue_final_message": True}
            | {"add_generation_prompt": True},  # vLLM's 400: the second was ignored
            "add_generation_prompt",
        ),
        ("/v1/completions", {"prompt": "Hi", "messages": ASK}, "messages"),  # chat's, ignored by the prompt
        ("/v1/completions", {"prompt": "Hi", "tools": TOOLS}, "tools"),
        ("/tokenize", {"prompt": "Hi", "messages": ASK}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages.0.content.0.text",
        ),
    ],
)
def test_what_would_be_taken_for_something_else_is_a_400_naming_the_field(tiny_api, route, fields, param):
    with tiny_api.client() as http:
        response = http.post(route, json={"max_tokens": 2, **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "medium", "high", "xhigh", "max"])
def test_openais_reasoning_efforts_and_its_default_verbosity_are_accepted(tiny_api, effort):
    body = {"messages": ASK, "max_tokens": 2, "reasoning_effort": effort, "verbosity": "medium"}
    with tiny_api.client() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [  # booleans pydantic's lax mode took from "yes", "no", 0 and 1 (store "no": nothing stored, and no error)
        ("/v1/chat/completions", {"messages": ASK, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ("/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
        ("/v1/responses", {"input": "Hi", "store": "no"}, "store"),
        ("/v1/responses", {"input": "Hi", "parallel_tool_calls": 0}, "parallel_tool_calls"),
        ("/tokenize", {"prompt": "Hi", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"messages": ASK, "return_token_strs": "yes"}, "return_token_strs"),
        (
            "/v1/chat/completions",
            {
                "messages": ASK,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}},
            },
            "strict",
        ),
        (
            "/v1/messages",
            {
                "messages": ASK,
                "max_tokens": 2,
                "tools": [],
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1},
            },
            "disable_parallel_tool_use",
        ),
    ],
)
def test_a_boolean_is_true_or_false_not_a_word_or_a_number(tiny_api, route, body, field):
    with tiny_api.client() as http:
        limit = (
            {"max_output_tokens": 2} if route == "/v1/responses" else {} if route == "/tokenize" else {"max_tokens": 2}
        )
        response = http.post(route, json={"model": tiny_api.manager.model_name, **limit, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]  # Anthropic's names the field in its message: its errors have no param
        assert error["param"].split(".")[-1] == field if "param" in error else field in error["message"], error


def test_vllms_stop_fields_are_honoured(tiny_api, tiny_llama):
    """stop_token_ids and include_stop_str_in_output were accepted and ignored (unknown fields): a vLLM client's
    stop token ran on to the length limit. Five stop strings, OpenAI's limit 4, are vLLM's to take."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ids = tiny_llama.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    token = ids.token_ids[4]
    with tiny_api.client() as http:
        stopped = http.post("/v1/completions", json={**body, "stop_token_ids": [token]}).json()
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = text[3:6]
        stops = [*"☃☄★☂", stop]  # never in the text
        cut, kept = (
            http.post("/v1/completions", json={**body, "stop": stops, "include_stop_str_in_output": include}).json()
            for include in (False, True)
        )
    assert stopped["usage"]["completion_tokens"] == ids.token_ids.index(token) + 1
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert len(stop) == 3 and cut["choices"][0]["text"] == text[: text.find(stop)]
    assert kept["choices"][0]["text"] == text[: text.find(stop) + 3]


def test_continue_final_message_continues_the_assistants_last_message(tiny_api):
    messages = [*ASK, {"role": "assistant", "content": "It is"}]
    tokenizer = tiny_api.manager.default.tokenizer
    ids = chat_prompt_ids(tokenizer, messages, continue_final_message=True)
    assert tokenizer.decode(ids).endswith("It is")  # its turn not closed, no other opened
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "continue_final_message": True}
    with tiny_api.client() as http:
        reply = http.post("/v1/chat/completions", json=body).json()
        same = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0}).json()
        refused = http.post("/v1/chat/completions", json={**body, "messages": ASK})
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_max_completion_tokens_of_0_scores_the_prompt_as_max_tokens_0_does(tiny_api):
    body = {"messages": ASK, "max_completion_tokens": 0, "max_tokens": 3, "logprobs": True}
    with tiny_api.client() as http:
        reply = http.post("/v1/chat/completions", json=body).json()
    assert reply["usage"]["completion_tokens"] == 0 and reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias.five"),
    ],
)
def test_a_bad_constraint_or_bias_is_a_400_naming_the_field(tiny_api, fields, param):
    with tiny_api.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_an_assistant_refusal_sent_back_reads_as_its_text(tiny_api):
    """OpenAI's replies carry a refusal apart from content; a client sends the conversation back as it got it."""
    said = "I cannot help with that."
    turns = [*ASK, None, {"role": "user", "content": "Why not?"}]
    with tiny_api.client() as http:
        ids = [
            http.post("/tokenize", json={"messages": [*turns[:1], assistant, *turns[2:]]}).json()["tokens"]
            for assistant in (
                {"role": "assistant", "content": None, "refusal": said},
                {"role": "assistant", "content": said},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": said}]},  # as a content part
            )
        ]
        empty = http.post("/tokenize", json={"messages": [*turns[:1], {"role": "assistant"}, *turns[2:]]})
        refusing = [{"type": "refusal", "refusal": said}]
        users = http.post("/tokenize", json={"messages": [{"role": "user", "content": refusing}]})
    assert ids[0] == ids[1] == ids[2]
    assert users.status_code == 400 and "'refusal'" in users.json()["error"]["message"]  # an assistant's alone
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages.1"


def test_a_developer_message_is_the_system_message_where_the_template_knows_no_developer():
    """OpenAI's developer role replaces system; SmolLM2's template, which knows no such role, put its own default
    system prompt before it. A template that knows the role (gpt-oss's) gets it as sent."""
    developer = {"role": "developer", "content": "Be terse.", "name": "ops"}
    for template, role in (("{{ messages }}", "system"), ("{% if m.role == 'developer' %}{% endif %}", "developer")):
        request = ChatCompletionRequest.model_validate({"messages": [developer, *ASK]})
        request.render_with(template)
        messages, _ = request.conversation()
        assert messages[0] == {**developer, "role": role}


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them():
    """A prompt split into parts (a document, then its question) kept its words apart; they ran together."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    message = {"role": "user", "content": parts}
    anthropic = MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [message]})
    system = MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": ASK, "system": parts})
    responses = input_messages([{"role": "user", "content": [{**p, "type": "input_text"} for p in parts]}])
    said = [chat.conversation()[0][0], anthropic.as_chat().messages[0].model_dump(), responses[0]]
    assert [m["content"] for m in said] == ["Hello\nworld"] * 3
    assert system.as_chat().messages[0].content == "Hello\nworld"
