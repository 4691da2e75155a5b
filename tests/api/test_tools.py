"""Tool calling without a server: the grammar accepts exactly the calls it should, the parser
splits any cut of the text the same way, and conversations reach templates in the right shape."""

from __future__ import annotations

import json

import pytest

from wsgi_infer.server.api.chat.schemas import ChatCompletionRequest
from wsgi_infer.server.api.chat.tool_formats import HERMES, LLAMA3_JSON, tool_format_of
from wsgi_infer.server.api.chat.tools import ToolCallParser, ToolPlan, call_text
from wsgi_infer.server.errors import APIError

from ..support.chat_templates import PHI4_TEMPLATE
from ..support.grammar_reference import accepts

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
TWO_CALLS = call_text("get_weather", '{"city":"Paris","days":2}') + "\n" + call_text("get_time", "{}")


@pytest.mark.parametrize(
    ("mode", "parallel", "text", "accepted"),
    [
        ("required", True, call_text("get_weather", '{"city":"Paris","days":2}'), True),
        ("required", True, TWO_CALLS, True),
        ("required", False, TWO_CALLS, False),
        ("required", True, call_text("get_weather", '{"city":"Paris","days":9}'), False),  # maximum 7
        ("required", True, call_text("get_weather", '{"city":"Paris"}'), False),  # days is required
        ("required", True, call_text("get_weather", '{"city": "Paris", "days": 2}'), False),  # compact JSON only
        ("required", True, "Sunny in Paris.", False),
        ("get_time", True, call_text("get_time", "{}"), True),
        ("get_time", True, call_text("get_weather", '{"city":"Paris","days":2}'), False),
        ("auto", True, "Sunny in Paris.", True),
        ("auto", True, TWO_CALLS, True),
        ("auto", True, "<tool_call>\nnot json\n</tool_call>", False),
    ],
)
def test_the_grammar_allows_exactly_valid_calls(tiny_llama, mode, parallel, text, accepted):
    engine, plan = tiny_llama.engine, ToolPlan([WEATHER, TIME], mode, parallel)
    assert accepts(engine.grammars, engine.tokenizer, plan.constraint(), text) is accepted


def test_parameters_without_a_type_are_an_objects(tiny_llama):
    """As a call's arguments are: a schema of properties alone let the model write a number, which the parser read
    past into the call's closing markup."""
    engine, plan = tiny_llama.engine, ToolPlan([{"name": "f", "parameters": {"minimum": 0}}], "required", False)
    assert accepts(engine.grammars, engine.tokenizer, plan.constraint(), call_text("f", '{"x":1}'))
    assert not accepts(engine.grammars, engine.tokenizer, plan.constraint(), call_text("f", "1"))


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_any_cut_of_the_text_gives_the_same_calls_and_arguments_one_entry_per_call(piece):
    parser, streamed = ToolCallParser(), {}
    for start in range(0, len(TWO_CALLS), piece):
        delta = parser.feed(TWO_CALLS[start : start + piece])
        assert "content" not in delta
        indices = [part["index"] for part in delta.get("tool_calls", [])]
        assert len(indices) == len(set(indices))  # one entry per call and chunk, as OpenAI streams them
        for part in delta.get("tool_calls", []):
            entry = streamed.setdefault(part["index"], {"name": part["function"].get("name"), "arguments": ""})
            entry["arguments"] += part["function"]["arguments"]
    assert parser.finish() == {}
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [
        ("get_weather", '{"city":"Paris","days":2}', True),
        ("get_time", "{}", True),
    ]
    assert [(s["name"], s["arguments"]) for s in streamed.values()] == [(c.name, c.arguments) for c in parser.calls]
    assert parser.content is None


def test_text_that_only_starts_like_a_call_is_content():
    parser = ToolCallParser()
    assert parser.feed("<tool") == {}  # could still become a call
    assert parser.feed("kit") == {"content": "<toolkit"}
    assert parser.feed(" is here") == {"content": " is here"}
    held = ToolCallParser()
    assert held.feed("<tool_c") == {}
    assert held.finish() == {"content": "<tool_c"}  # the choice ended: it was text after all


def test_a_cut_call_is_not_reported_complete():
    parser = ToolCallParser()
    parser.feed(call_text("get_weather", '{"city":"Pa')[: -len("\n</tool_call>")])
    assert [c.complete for c in parser.calls] == [False]


# Arguments with a brace, a bracket and an escaped quote inside strings, and nesting: the call ends where its
# object does, not at the first "}}".
NESTED = '{"city":"Pa}ris \\"x\\"","days":2,"extra":{"a":[1,{"b":"]"}]}}'
LLAMA3_CALL = LLAMA3_JSON.call("get_weather", NESTED)


LLAMA3_TEMPLATE_LINE = (  # as Llama 3.1 and 3.2's chat template words it
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
)


def test_the_call_format_is_the_chat_templates(tiny_llama):
    llama3 = f"... {LLAMA3_TEMPLATE_LINE} Do not use variables."
    assert tool_format_of(llama3) is LLAMA3_JSON
    assert tool_format_of(tiny_llama.engine.tokenizer.chat_template) is HERMES and tool_format_of(None) is HERMES
    assert LLAMA3_JSON.call("get_time", "{}") == '{"name": "get_time", "parameters": {}}'


@pytest.mark.parametrize(
    ("mode", "text", "accepted"),
    [
        ("required", LLAMA3_JSON.call("get_weather", '{"city":"Paris","days":2}'), True),
        ("required", call_text("get_weather", '{"city":"Paris","days":2}'), False),  # Hermes' wrapper
        ("required", LLAMA3_JSON.call("get_time", "{}") + "; " + LLAMA3_JSON.call("get_time", "{}"), False),
        ("get_time", LLAMA3_JSON.call("get_time", "{}"), True),
        ("auto", "Sunny in Paris.", True),
        ("auto", LLAMA3_JSON.call("get_time", "{}"), True),
        ("auto", '{"name": "get_time"}', False),  # a call's start, then no call
    ],
)
def test_llama3s_grammar_allows_exactly_one_valid_call(tiny_llama, mode, text, accepted):
    engine, plan = tiny_llama.engine, ToolPlan([WEATHER, TIME], mode, True, LLAMA3_JSON)
    assert accepts(engine.grammars, engine.tokenizer, plan.constraint(), text) is accepted


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_any_cut_of_a_llama3_call_gives_its_arguments_to_where_its_object_ends(piece):
    parser, streamed = ToolCallParser(LLAMA3_JSON), ""
    for start in range(0, len(LLAMA3_CALL), piece):
        delta = parser.feed(LLAMA3_CALL[start : start + piece])
        assert "content" not in delta and len(delta.get("tool_calls", [])) <= 1
        streamed += "".join(part["function"]["arguments"] for part in delta.get("tool_calls", []))
    assert parser.finish() == {} and streamed == NESTED
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [("get_weather", NESTED, True)]
    cut = ToolCallParser(LLAMA3_JSON)
    cut.feed(LLAMA3_CALL[:-2])
    assert [c.complete for c in cut.calls] == [False]
    text = ToolCallParser(LLAMA3_JSON)
    assert text.feed('{"na') == {} and text.feed("p") == {"content": '{"nap'}


def conversation(chat_template: str | None, **fields):
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
    request = ChatCompletionRequest.model_validate({"messages": history, "tools": tools, **fields})
    request.render_with(chat_template)
    return request.conversation()


def test_tool_messages_answer_each_call_of_the_assistant_message_before_them():
    """OpenAI's rule: a broken history is a 400 naming the message, not rendered as if the model had asked."""
    user = {"role": "user", "content": "Time?"}
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    asks = {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "c2"}]}

    def answer(call_id: str | None) -> dict:
        return {"role": "tool", "content": "12:00", **({"tool_call_id": call_id} if call_id else {})}

    def refusal(*messages: dict) -> tuple[str | None, str]:
        with pytest.raises(APIError) as refused:
            ChatCompletionRequest.model_validate({"messages": list(messages)}).conversation()
        return refused.value.param, refused.value.message

    first = "messages.1: a tool message must answer a tool call of the assistant message before it"
    assert refusal(user, answer("c1")) == ("messages.1.tool_call_id", first)
    assert "names no unanswered tool call" in refusal(user, asks, answer("c3"))[1]
    assert "names no unanswered tool call" in refusal(user, asks, answer("c1"), answer("c1"))[1]
    assert refusal(user, asks, answer(None))[1] == "messages.2: a tool message needs the tool_call_id it answers"
    unanswered = "messages.1: an assistant message's tool calls must each be answered by a tool message after it"
    assert refusal(user, asks, answer("c1"), user) == ("messages.1.tool_calls", f"{unanswered}; none answers c2")
    assert refusal(user, asks, answer("c2")) == ("messages.1.tool_calls", f"{unanswered}; none answers c1")
    assert refusal(user, asks, user, answer("c1"))[0] == "messages.1.tool_calls"  # late: something came between
    for whole in ([user, asks, answer("c2"), answer("c1"), user], [user, asks]):  # any order; calls not yet answered
        ChatCompletionRequest.model_validate({"messages": whole}).conversation()


def test_templates_that_take_tools_get_them_and_structured_calls():
    messages, tools = conversation("{{ tools | tojson }}")
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    call = {"type": "function", "id": "c1", "function": {"name": "get_time", "arguments": {}}}
    assert messages[1]["tool_calls"] == [call]
    assert messages[2] == {"role": "tool", "content": "12:00", "tool_call_id": "c1"}


def test_other_templates_get_our_prompt_and_calls_as_text():
    messages, tools = conversation(None)
    assert tools is None
    assert messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == call_text("get_time", "{}")
    assert messages[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    none_messages, _ = conversation(None, tool_choice="none")
    assert none_messages[0]["role"] == "user", "tool_choice none: no tool prompt"
    assert json.loads(messages[0]["content"].split("\n")[1])["name"] == "get_weather"


def test_phi4_minis_template_gets_the_tools_in_its_system_message(tiny_llama):
    """Its template ignores a ``tools`` list: passed one, the tools would silently not reach the model."""
    ask = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [{"type": "function", "function": WEATHER}]}
    request = ChatCompletionRequest.model_validate(ask)
    request.render_with(PHI4_TEMPLATE)
    messages, tools = request.conversation()
    assert tools is None and messages[0]["role"] == "system" and json.loads(messages[0]["tools"]) == [WEATHER]
    prompt = tiny_llama.engine.tokenizer.apply_chat_template(messages, chat_template=PHI4_TEMPLATE, tokenize=False)
    assert f"<|tool|>{json.dumps([WEATHER])}<|/tool|>" in prompt
    system = [{"role": "system", "content": "Be brief."}, *ask["messages"]]
    own_request = ChatCompletionRequest.model_validate({**ask, "messages": system})
    own_request.render_with(PHI4_TEMPLATE)
    own, _ = own_request.conversation()
    assert own[0] == {"role": "system", "content": "Be brief.", "tools": json.dumps([WEATHER])}
