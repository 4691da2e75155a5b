"""The OpenAI API's shapes over the tiny engine, in this process (the fast tier): requests refused by the field
at fault, chat chunks and usage, and calls and constraints the grammar forces whatever the weights."""

from __future__ import annotations

import json
import shutil

import pytest

from wsgi_infer.engine.outputs import RequestDelta, TokenLogprob
from wsgi_infer.engine.sampling_params import SamplingParams
from wsgi_infer.engine.text.chat_template import chat_prompt_ids
from wsgi_infer.server.api.openai.completion_formatter import CompletionFormatter
from wsgi_infer.server.engine_client.streams import ChoiceDelta, RequestStream

from ..conftest import tiny_settings
from ..support.in_process import InProcessServer
from ..support.sse_client import events

ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
NEWLINE = 198  # the token of "\n" in the tiny models' (SmolLM2's) vocabulary
LESS_THAN = 44  # of "<", the first of "<tool_call>"'s
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather",
            "parameters": {
                "type": "object",
                "properties": {"unit": UNIT},
                "required": ["unit"],
                "additionalProperties": False,
            },
        },
    }
]


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


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "logprobs": True}, "logprobs"),
        ({"tools": TOOLS, "structured_outputs": {"regex": "a"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]}, "tools"),
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
    ],
)
def test_what_would_be_taken_for_something_else_is_a_400_naming_the_field(tiny_api, route, fields, param):
    with tiny_api.client() as http:
        response = http.post(route, json={"max_tokens": 2, **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_vllms_stop_fields_are_honoured(tiny_api, tiny_llama):
    """stop_token_ids and include_stop_str_in_output were accepted and ignored (unknown fields): a vLLM client's
    stop token ran on to the length limit."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ids = tiny_llama.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    token = ids.token_ids[4]
    with tiny_api.client() as http:
        stopped = http.post("/v1/completions", json={**body, "stop_token_ids": [token]}).json()
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = text[3:6]
        cut, kept = (
            http.post("/v1/completions", json={**body, "stop": [stop], "include_stop_str_in_output": include}).json()
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
        ({"logit_bias": {"five": 1}}, "logit_bias.five.[key]"),
    ],
)
def test_a_bad_constraint_or_bias_is_a_400_naming_the_field(tiny_api, fields, param):
    with tiny_api.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


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
            )
        ]
        empty = http.post("/tokenize", json={"messages": [*turns[:1], {"role": "assistant"}, *turns[2:]]})
    assert ids[0] == ids[1]
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages.1"
