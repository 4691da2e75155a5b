"""Constraints no text can complete: refused with a 400 naming their field where compiling shows it (a ``$ref`` or
``allOf`` loop, a grammar whose start allows nothing), else ended with ``finish_reason: "error"`` and a warning once
the matcher allows no token (an error in Anthropic's Messages, a failed response in OpenAI's Responses), never a
"stop" on text that breaks them."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest

from wsgi_infer.engine.outputs import CONSTRAINT_FAILED, CONSTRAINT_FAILED_MESSAGE
from wsgi_infer.engine.sampling_params import InvalidParameter, SamplingParams, StructuredOutput
from wsgi_infer.server.api.responses.events import ResponseBuilder
from wsgi_infer.server.engine_client.identity import ResponseIdentity
from wsgi_infer.server.engine_client.streams import RequestStream

from ..api.weather_tool import ASK
from ..conftest import assert_idle
from ..support.sse_client import events

A_B_LOOP = {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    "type": "object",
    "properties": {"x": {"$ref": "#/$defs/a"}},
    "required": ["x"],
}
SELF_LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
LOOPING_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}]
# A grammar that starts, then allows nothing: only generation finds it.
DEAD_END = 'start: "ab" loop\nloop: loop'


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(
    ("route", "fields", "param", "says"),
    [
        ("chat", {"response_format": json_schema(A_B_LOOP)}, "response_format", "/properties/x"),
        ("completions", {"response_format": json_schema(A_B_LOOP)}, "response_format", "/properties/x"),
        ("completions", {"structured_outputs": {"json": SELF_LOOP}}, "structured_outputs", "no finite value"),
        ("completions", {"guided_json": {"allOf": [{"$ref": "#"}]}}, "guided_json", "no finite value"),
        ("completions", {"structured_outputs": {"grammar": "start: start"}}, "structured_outputs", "unsatisfiable"),
        ("chat", {"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", "unsatisfiable"),
        ("completions", {"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs", "unsat"),
        ("chat", {"tools": LOOPING_TOOL, "tool_choice": "required"}, "tools", "no finite value"),
    ],
)
def test_a_constraint_shown_unsatisfiable_when_compiled_is_a_400_naming_its_field(tiny_api, route, fields, param, says):
    """Before, each was a 200 whose choice ended "stop": on ``{"x":`` (EOS let through), or on nothing at all."""
    prompt = {"messages": ASK} if route == "chat" else {"prompt": "Anything"}
    body = {**prompt, "max_tokens": 16, "temperature": 0, **fields}
    with tiny_api.client() as http:
        reply = http.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"], error


REFUSED = [
    StructuredOutput("json", A_B_LOOP),
    StructuredOutput("json", {"properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": SELF_LOOP["$defs"]}),
    StructuredOutput("json", {"anyOf": [{"$ref": "#"}, {"oneOf": [{"$ref": "#"}]}]}),
    StructuredOutput("grammar", 'start: "{" %json {"$ref": "#"} "}"'),
    StructuredOutput("grammar", "start: start", after_thought=True),  # a thinking model's: after a free thought
    # every value holds another: nested until the tokens ran out, ending "length"
    StructuredOutput("json", {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}),
    StructuredOutput("json", {"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
    StructuredOutput("json", {"type": "array", "prefixItems": [{"type": "null"}, {"$ref": "#"}], "minItems": 2}),
]


def test_loops_and_empty_languages_are_refused_and_recursion_that_ends_is_not(tiny_llama):
    """Each refused (before, none was); schemas that recur through values that may end still compile and hold."""
    for spec in REFUSED:
        with pytest.raises(InvalidParameter) as refused:
            tiny_llama.engine.grammars.compile(spec)
        assert refused.value.param == "structured_outputs"
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}}}
    nested = {
        "$ref": "#/$defs/n",
        "$defs": {"n": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}}]}},
    }
    linked = {
        "type": "object",
        "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
        "required": ["next"],
    }
    for ends in (
        {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},
        {"type": "array", "prefixItems": [{"type": "null"}, {"$ref": "#"}], "minItems": 1},  # [null] ends it
        {"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # null ends it
    ):
        tiny_llama.engine.grammars.compile(StructuredOutput("json", ends))
    for schema in (tree, nested, linked):
        constraint = StructuredOutput("json", schema)
        outs = tiny_llama.generate(
            ["Anything"] * 3, [SamplingParams(seed=s, structured_output=constraint) for s in range(3)]
        )
        for out in outs:
            assert out.finish_reason in ("stop", "length"), out
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), schema)
    assert_idle(tiny_llama)


def test_a_grammar_no_token_can_continue_ends_with_error_and_a_warning_not_stop(tiny_llama, caplog):
    """The matcher allows nothing after "ab": the mask lets EOS alone through, as llguidance's binding does, and
    before, that EOS ended the choice "stop" with nothing logged."""
    params = SamplingParams(temperature=0, max_tokens=16, structured_output=StructuredOutput("grammar", DEAD_END))
    with caplog.at_level(logging.WARNING, logger="wsgi_infer"):
        [out] = tiny_llama.generate(["Anything"], params)
    assert (out.text, out.finish_reason) == ("ab", "error")
    assert any("cannot be completed" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert_idle(tiny_llama)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_the_api_ends_such_a_choice_with_finish_reason_error_streamed_and_not(tiny_api, route):
    body = {"max_tokens": 16, "temperature": 0, "structured_outputs": {"grammar": DEAD_END}}
    body |= {"messages": ASK} if route == "chat" else {"prompt": "Anything"}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    with tiny_api.client() as http:
        whole = http.post(path, json=body).json()["choices"][0]
        with http.stream("POST", path, json={**body, "stream": True}) as r:
            chunks = [e.json for e in events(r) if e.data and e.data != "[DONE]"]
    text = whole["message"]["content"] if route == "chat" else whole["text"]
    assert (text, whole["finish_reason"]) == ("ab", "error")
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "error"


def test_the_messages_api_ends_it_with_an_error_streamed_and_not(tiny_api):
    """Anthropic's stop reasons have none for it: an invalid_request_error, not an ``end_turn`` on broken text."""
    body = {"model": tiny_api.manager.model_name, "messages": ASK, "max_tokens": 16, "temperature": 0}
    body["structured_outputs"] = {"grammar": DEAD_END}
    with tiny_api.client() as http:
        whole = http.post("/v1/messages", json=body)
        with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
            streamed = [e for e in events(r) if e.data]
    assert whole.status_code == 400 and "constraint" in whole.json()["error"]["message"], whole.text
    assert streamed[-1].name == "error" and streamed[-1].json["error"]["type"] == "invalid_request_error"
    assert not any(e.name == "message_delta" for e in streamed)  # no stop_reason given


def test_a_response_whose_constraint_fails_is_failed_not_completed():
    stream = RequestStream.__new__(RequestStream)
    stream.prompt_tokens, stream.completion_tokens, stream.cached_tokens = 3, 2, {}
    builder = ResponseBuilder({"id": "resp_x", "status": "in_progress", "output": []}, ResponseIdentity(7, 0))
    builder.feed({"delta": {"content": "ab"}, "finish_reason": CONSTRAINT_FAILED})
    last = builder.finish(stream)[-1]
    assert "response.failed" in last and builder.response["status"] == "failed"
    assert builder.response["error"] == {"code": "constraint_failed", "message": CONSTRAINT_FAILED_MESSAGE}
