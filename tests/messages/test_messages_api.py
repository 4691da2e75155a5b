"""Anthropic's Messages API with the real anthropic SDK over the tiny engine, in this process (the fast tier): the
same generation as a chat completion, its events, stop sequences, tool use and results, token counts, errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from pydantic import BaseModel, ConfigDict

from wsgi_infer.engine.text.chat_template import chat_prompt_ids

from ..support.chat_templates import REPLY
from ..support.sse_client import events

if TYPE_CHECKING:  # imported where used: collecting the SDK costs every test process 2.6 s
    import anthropic

ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SYSTEM = "You answer in one short sentence."
GREEDY = {"temperature": 0}  # sampling fields older SDKs send; this one takes them as extra_body


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    unit: str


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The current weather",
    "input_schema": {
        "type": "object",
        "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def claude(tiny_api) -> anthropic.Anthropic:
    import anthropic
    import httpx2  # the anthropic SDK's own fork of httpx, whose WSGI transport it takes

    http = httpx2.Client(transport=httpx2.WSGITransport(app=tiny_api.app), base_url=tiny_api.url, timeout=60.0)
    return anthropic.Anthropic(base_url=tiny_api.url, api_key="unused", max_retries=0, http_client=http)


@pytest.fixture(scope="module")
def model(tiny_api) -> str:
    return tiny_api.manager.model_name


def test_a_message_is_the_chat_completion_of_the_same_conversation_streamed_or_not(tiny_api, claude, model):
    whole = claude.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=10, extra_body=GREEDY)
    with claude.messages.stream(model=model, system=SYSTEM, messages=ASK, max_tokens=10, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    with tiny_api.client() as http:
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "system", "content": SYSTEM}, *ASK], "max_tokens": 10, "temperature": 0},
        ).json()
    text = chat["choices"][0]["message"]["content"]
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == model
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == text
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 10
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert [b.text for b in streamed.content] == [text] and streamed.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == 10
    assert kinds[:2] == ["message_start", "content_block_start"]  # the SDK passes no pings on
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta", "text"}  # the SDK adds a text event per delta


def test_a_stop_sequence_ends_the_text_and_is_named(claude, model):
    free = claude.messages.create(model=model, messages=ASK, max_tokens=12, extra_body=GREEDY).content[0].text
    stop = free[3:6]
    reply = claude.messages.create(model=model, messages=ASK, max_tokens=12, extra_body=GREEDY, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == free[: free.find(stop)]
    with claude.messages.stream(
        model=model, messages=ASK, max_tokens=12, extra_body=GREEDY, stop_sequences=["never seen", stop]
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop


@pytest.mark.parametrize("streamed", [False, True])
def test_a_named_tool_is_used_once_then_its_result_answered(claude, model, streamed):
    request = dict(
        model=model,
        messages=ASK,
        max_tokens=60,
        extra_body=GREEDY,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    if streamed:
        with claude.messages.stream(**request) as stream:
            deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
            reply = stream.get_final_message()
        assert set(deltas) == {"input_json_delta"}
    else:
        reply = claude.messages.create(**request)
    assert reply.stop_reason == "tool_use"
    [use] = reply.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id
    WeatherArgs.model_validate(use.input)
    history = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees, sunny"}]},
    ]
    answer = claude.messages.create(
        model=model, messages=history, max_tokens=5, extra_body=GREEDY, tools=[WEATHER_TOOL]
    )
    assert answer.usage.output_tokens == 5 and answer.content[0].type in ("text", "tool_use")
    # a result answers a tool use of the message before it, as Anthropic requires
    import anthropic

    result, text = history[2]["content"][0], {"type": "text", "text": "Thanks."}
    broken = {
        f"unexpected tool_use_id found in tool_result blocks: {use.id}": [
            [history[0], history[2]],
            [*history, {"role": "assistant", "content": "Sunny."}, history[2]],
        ],
        f"ids were found without `tool_result` blocks immediately after: {use.id}": [
            [*history[:2], {"role": "user", "content": "Well?"}],
        ],
        "tool_result blocks must come first": [[*history[:2], {"role": "user", "content": [text, result]}]],
    }
    for says, conversations in broken.items():
        for conversation in conversations:
            with pytest.raises(anthropic.BadRequestError) as refused:
                claude.messages.create(model=model, messages=conversation, max_tokens=5, tools=[WEATHER_TOOL])
            assert says in refused.value.message
    claude.messages.create(  # a text after the results is fine
        model=model, messages=[*history[:2], {"role": "user", "content": [result, text]}], max_tokens=1
    )
    # the answer read the result: its prompt is the history counted, which the result's text lengthens
    counted = claude.messages.count_tokens(model=model, messages=history, tools=[WEATHER_TOOL]).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted
    history[-1]["content"][0]["content"] = ""
    assert counted > claude.messages.count_tokens(model=model, messages=history, tools=[WEATHER_TOOL]).input_tokens
    # and the call itself: its input, written longer, lengthens the prompt too
    history[1]["content"][0]["input"] = {"unit": "celsius, in the shade of the tallest tree in Paris"}
    longer = claude.messages.count_tokens(model=model, messages=history, tools=[WEATHER_TOOL]).input_tokens
    history[1]["content"][0]["input"] = {"unit": "celsius"}
    assert longer > claude.messages.count_tokens(model=model, messages=history, tools=[WEATHER_TOOL]).input_tokens


def test_a_tool_use_cut_by_a_stop_sequence_is_no_block_and_no_tool_use(claude, model):
    request = dict(model=model, messages=ASK, max_tokens=60, extra_body=GREEDY, tools=[WEATHER_TOOL])
    reply = claude.messages.create(**request, tool_choice={"type": "any"}, stop_sequences=['"unit"'])
    # its input is no object yet (a stream shows the part that came); nor is its markup text
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == '"unit"' and reply.content == []


def test_an_assistant_message_last_is_a_prefill_the_reply_continues(claude, model, tiny_api):
    messages = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    reply = claude.messages.create(model=model, messages=messages, max_tokens=6, extra_body=GREEDY)
    tokenizer = tiny_api.manager.default.tokenizer
    ids = chat_prompt_ids(tokenizer, messages, continue_final_message=True)
    assert tokenizer.decode(ids).endswith("The weather in Paris is")  # its turn not closed, no other opened
    with tiny_api.client() as http:
        same = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0}).json()
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(ids)
    assert reply.content[0].text == same["choices"][0]["text"]


def test_count_tokens_is_the_prompt_a_message_reads(claude, model, tiny_api):
    conversation = dict(model=model, system=SYSTEM, messages=ASK, tools=[WEATHER_TOOL])
    counted = claude.messages.count_tokens(**conversation).input_tokens
    reply = claude.messages.create(**conversation, max_tokens=1)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert counted > claude.messages.count_tokens(model=model, messages=ASK).input_tokens  # the tools count
    # consecutive turns of one role are one turn, as Anthropic combines them (Gemma's template refused two)
    apart = [*ASK, {"role": "user", "content": "In Celsius."}]
    together = [{"role": "user", "content": [{"type": "text", "text": m["content"]} for m in apart]}]
    assert len({claude.messages.count_tokens(model=model, messages=m).input_tokens for m in (apart, together)}) == 1


def test_the_sdk_raises_the_errors_it_knows(claude, model):
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-haiku-4-5", messages=ASK, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        claude.messages.create(model=model, messages=ASK, max_tokens=4, stop_sequences=[f"{i}" for i in range(65)])
    # the request's id, where the SDK reads it (request-id): as X-Request-Id has it
    message = claude.messages.with_raw_response.create(model=model, messages=ASK, max_tokens=1)
    assert message.parse()._request_id == message.headers["X-Request-Id"]
    assert missing.value.request_id == missing.value.response.headers["X-Request-Id"]


def test_raw_events_name_their_type_and_text_blocks_open_and_close(tiny_api, model):
    body = {"model": model, "messages": ASK, "max_tokens": 6, "temperature": 0, "stream": True}
    with tiny_api.client() as http:
        for _ in range(2):  # the second reads the prompt from the prefix cache
            with http.stream("POST", "/v1/messages", json=body) as reply:
                frames = [e for e in events(reply) if e.data]
    assert all(e.name == e.json["type"] for e in frames)
    assert [e.name for e in frames[:2]] == ["message_start", "ping"]
    blocks = [e.json for e in frames if e.name.startswith("content_block")]
    assert blocks[0]["content_block"] == {"type": "text", "text": ""}
    assert {b["index"] for b in blocks} == {0}
    delta = next(e.json for e in frames if e.name == "message_delta")
    assert (
        delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and delta["usage"]["output_tokens"] == 6
    )
    # message_start already counts the cached tokens apart, as Anthropic's does (it said none were)
    inputs = ("input_tokens", "cache_read_input_tokens")
    start = frames[0].json["message"]["usage"]
    assert [start[k] for k in inputs] == [delta["usage"][k] for k in inputs] and start["cache_read_input_tokens"] > 0


@pytest.mark.parametrize("name", ["output_config", "output_format"])  # the beta's name: ignored before
def test_an_output_format_constrains_the_text_to_its_schema(claude, model, name):
    form = {"type": "json_schema", "schema": {**WEATHER_TOOL["input_schema"]}}
    given = {"output_config": {"format": form}} if name == "output_config" else {"output_format": form}
    reply = claude.messages.create(model=model, messages=ASK, max_tokens=40, extra_body={**GREEDY, **given})
    assert reply.stop_reason == "end_turn"
    WeatherArgs.model_validate_json(reply.content[0].text)


def test_thinking_display_omitted_keeps_the_thinking_block_without_its_text(thinking_api):
    """Anthropic's ``display: "omitted"``: the block comes, its thought does not (it came whole, before)."""
    body = {
        "model": thinking_api.manager.model_name,
        "messages": [{"role": "user", "content": "Capital?"}],
        "max_tokens": 40,
        "temperature": 0,
        "structured_outputs": REPLY,  # a thought, then an answer
        "thinking": {"type": "adaptive", "display": "omitted"},
    }
    with thinking_api.client() as http:
        message = http.post("/v1/messages", json=body).json()
        with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as reply:
            frames = [e.json for e in events(reply) if e.data]
    thinking, text = message["content"]
    assert thinking == {"type": "thinking", "thinking": "", "signature": ""} and text["text"]
    starts = [f["content_block"]["type"] for f in frames if f["type"] == "content_block_start"]
    deltas = [f["delta"]["type"] for f in frames if f["type"] == "content_block_delta"]
    assert starts == ["thinking", "text"] and set(deltas) == {"text_delta"}


def test_the_sdk_lists_and_retrieves_the_models(claude, model):
    """GET /v1/models in a shape both SDKs read: Anthropic's fields beside OpenAI's."""
    page = claude.models.list()
    (listed,) = page.data
    assert (listed.id, listed.type, listed.display_name, listed.lifecycle) == (model, "model", model, "active")
    assert listed.created_at.tzinfo is not None and listed.created_at.timestamp() > 0
    assert (page.has_more, page.first_id, page.last_id) == (False, model, model)
    assert not page.has_next_page()
    retrieved = claude.models.retrieve(model)
    assert (retrieved.id, retrieved.created_at, retrieved.max_input_tokens) == (
        model,
        listed.created_at,
        listed.max_input_tokens,
    )
    assert retrieved.max_input_tokens > 0


def test_the_model_list_pages_as_anthropic_s():
    from werkzeug.datastructures import MultiDict

    from wsgi_infer.server.api.openai.routes import _model_page
    from wsgi_infer.server.errors import APIError

    data = [{"id": name} for name in "abcde"]

    def ids(**args) -> tuple[list[str], bool]:
        page = _model_page(data, MultiDict(args))
        return [model["id"] for model in page["data"]], page["has_more"]

    assert ids() == (list("abcde"), False)  # OpenAI's clients read the list whole
    assert ids(limit="2") == (["a", "b"], True)
    assert ids(limit="2", after_id="b") == (["c", "d"], True)
    assert ids(limit="2", before_id="d") == (["b", "c"], True)
    assert ids(after_id="d") == (["e"], False)
    for bad in ({"limit": "0"}, {"limit": "x"}, {"limit": "9" * 5000}, {"after_id": "z"}):
        with pytest.raises(APIError):
            ids(**bad)
