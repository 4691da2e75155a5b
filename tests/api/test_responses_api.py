"""OpenAI's Responses API with the real openai SDK over the tiny engine, in this process (the fast tier): the same
generation as a chat completion, typed and numbered events, structured text, function calls and their outputs,
stored responses continued by previous_response_id, resumed streams, refusals, and keys kept apart."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from ..plugins.server_fixtures import openai_client
from ..support.sse_client import events
from .weather_tool import UNIT

ASK = "What is the weather like in Paris today?"
UNIT_SCHEMA = {
    "type": "object",
    "properties": {"unit": UNIT},
    "required": ["unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": UNIT_SCHEMA}


class Unit(BaseModel):
    model_config = ConfigDict(extra="forbid")
    unit: Literal["celsius", "fahrenheit"]  # an enum: a random model's free string would run to the window


@pytest.fixture(scope="module")
def client(tiny_api) -> openai.OpenAI:
    return openai_client(tiny_api)


@pytest.fixture(scope="module")
def model(tiny_api) -> str:
    return tiny_api.manager.model_name


def test_a_response_is_the_chat_completion_of_the_same_conversation(client, model):
    response = client.responses.create(
        model=model, instructions="Be brief.", input=ASK, max_output_tokens=9, temperature=0
    )
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
        max_tokens=9,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == model
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.completed_at is None  # only a completed response has it
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert response.usage.output_tokens == 9 and response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    assert response.instructions == "Be brief." and response.store is True


def test_streamed_events_are_typed_numbered_and_build_the_response(client, model):
    request = dict(model=model, input=ASK, temperature=0, text={"format": _unit_format()})
    with client.responses.stream(**request) as stream:
        seen = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    kinds = [e.type for e in seen]
    opened = ["response.output_item.added", "response.content_part.added"]
    assert kinds[:4] == ["response.created", "response.in_progress", *opened]
    done = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:] == [*done, "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert final.status == "completed" and final.output_text == deltas and final.completed_at >= final.created_at
    Unit.model_validate_json(final.output_text)
    whole = client.responses.create(**request)
    assert whole.output_text == final.output_text and whole.usage.output_tokens == final.usage.output_tokens


def test_parse_returns_the_model_its_schema_forced(client, model):
    parsed = client.responses.parse(model=model, input=ASK, temperature=0, text_format=Unit, max_output_tokens=40)
    assert isinstance(parsed.output_parsed, Unit)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_function_call_then_its_output_continues_the_stored_conversation(client, model, streamed):
    request = dict(
        model=model,
        input=ASK,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    )
    if streamed:
        with client.responses.stream(**request) as stream:
            kinds = [e.type for e in stream]
            first = stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        first = client.responses.create(**request)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.status == "completed"
    Unit.model_validate_json(call.arguments)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 21})}
    follow_up = dict(model=model, tools=[WEATHER_TOOL], max_output_tokens=3, temperature=0)
    follow = client.responses.create(previous_response_id=first.id, input=[output], **follow_up)
    assert follow.previous_response_id == first.id
    # Its id begins with its conversation's 16 hex digits, which a proxy hashes to keep the chain on one host.
    assert follow.id[:21] == first.id[:21] and follow.id != first.id and len(follow.id) == len(first.id) == 37
    # The chained follow-up reads the first turn as if it were replayed by hand; the output alone answers no call,
    # which OpenAI refuses (as a follow-up that dropped the history would be).
    replayed_call = {k: getattr(call, k) for k in ("type", "call_id", "name", "arguments")}
    replayed = client.responses.create(input=[{"role": "user", "content": ASK}, replayed_call, output], **follow_up)
    assert follow.usage.input_tokens == replayed.usage.input_tokens
    refusals = {  # OpenAI's words
        f"No tool call found for function call output with call_id {call.call_id}.": [output],
        f"No tool output found for function call {call.call_id}.": [{"role": "user", "content": ASK}, replayed_call],
    }
    for message, conversation in refusals.items():
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(input=conversation, **follow_up)
        assert (refused.value.body["message"], refused.value.body["param"]) == (message, "input")
    with pytest.raises(openai.BadRequestError, match="No tool output found"):  # a chain that answers nothing
        client.responses.create(previous_response_id=first.id, input="And tomorrow?", **follow_up)


def test_a_call_cut_short_is_incomplete_streamed_or_not_and_its_response_continues(client, model):
    request = dict(model=model, input=ASK, tools=[WEATHER_TOOL], tool_choice="required", temperature=0)
    whole = client.responses.create(**request, max_output_tokens=60)
    assert [(item.type, item.status) for item in whole.output] == [("function_call", "completed")]
    for limit in range(whole.usage.output_tokens - 1, 0, -1):  # the longest cut that leaves its arguments unfinished
        cut = client.responses.create(**request, max_output_tokens=limit)
        if cut.output and cut.output[-1].status == "incomplete":
            break
    [call] = cut.output
    # a cut after its arguments' end (its wrapper's last tokens) left a call whole: completed, not this
    assert call.type == "function_call" and whole.output[0].arguments.startswith(call.arguments)
    assert call.arguments != whole.output[0].arguments
    with client.responses.stream(**request, max_output_tokens=limit) as stream:
        seen = list(stream)  # the SDK's final response wants a response.completed event
    streamed = seen[-1].response
    assert seen[-1].type == "response.incomplete" and "response.function_call_arguments.delta" in {e.type for e in seen}
    fields = ("type", "name", "arguments", "status")
    assert [[getattr(i, f) for f in fields] for i in streamed.output] == [[getattr(call, f) for f in fields]]
    for previous in (cut, streamed):  # stored without the unfinished call, whose arguments do not parse
        follow = client.responses.create(
            model=model, previous_response_id=previous.id, input="Again?", max_output_tokens=2
        )
        assert follow.status == "incomplete" and follow.output_text


def test_stored_responses_are_retrieved_deleted_and_not_kept_when_store_is_false(client, model):
    kept = client.responses.create(model=model, input=ASK, max_output_tokens=3)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    assert client.responses.delete(kept.id) is None  # the SDK returns nothing on success
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unstored = client.responses.create(model=model, input=ASK, max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as unknown:  # OpenAI's 400, which clients match by its code
        client.responses.create(model=model, input=ASK, previous_response_id=unstored.id)
    assert unknown.value.code == "previous_response_not_found" and unknown.value.param == "previous_response_id"


def test_a_stream_resumes_after_a_sequence_number(tiny_api, model):
    body = {"model": model, "input": ASK, "max_output_tokens": 8, "temperature": 0, "stream": True}
    with tiny_api.client() as http:
        with http.stream("POST", "/v1/responses", json=body) as reply:
            stream_id = reply.headers["X-Stream-Id"]
            whole = [e.json for e in events(reply) if e.data]
        resumed_url = f"/v1/responses/{whole[0]['response']['id']}?stream=true&starting_after=3"
        with http.stream("GET", resumed_url) as reply:
            resumed = [e.json for e in events(reply) if e.data]
        # a digit to str.isdigit, not to int(); and more digits than int() reads (or Redis's ids hold): each a 500
        for number in ("\u00b2", "9" * 5000, "9" * 25):
            for url in (resumed_url.replace("=3", f"={number}"), f"/v1/streams/{stream_id}?last_event_id={number}"):
                assert http.get(url).status_code == 400, url
            if number.isascii():
                assert http.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": number}).status_code == 400
        for after in ("--1", "-2", "+3", " 3"):  # a 500, and -2 read as -1, before
            error = http.get(resumed_url.replace("=3", f"={after}")).json()["error"]
            assert error["param"] == "starting_after", after
    assert stream_id == whole[0]["response"]["id"]
    assert resumed == whole[4:] and resumed[-1]["type"] == "response.incomplete"


def test_a_chat_stream_is_no_response_to_retrieve(tiny_api):
    """Its stream id is no response's: a 404 there (it was the chat's stream), its own route serves it still."""
    chat = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 2, "stream": True}
    with tiny_api.client() as http:
        with http.stream("POST", "/v1/chat/completions", json=chat) as reply:
            stream_id = reply.headers["X-Stream-Id"]
            list(events(reply))
        retrieved = http.get(f"/v1/responses/{stream_id}?stream=true")
        assert retrieved.status_code == 404 and retrieved.json()["error"]["param"] == "response_id"
        assert http.get(f"/v1/streams/{stream_id}").status_code == 200


def test_input_items_list_the_whole_conversation_before_each_response(client, model):
    """The openai SDK's input_items.list: a chained response's items are the earlier turns' inputs and outputs, then
    its own input, newest first unless asc, paged by limit and after."""
    first = client.responses.create(model=model, input=ASK, max_output_tokens=2)
    ask = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}]
    follow = client.responses.create(model=model, previous_response_id=first.id, input=ask, max_output_tokens=2)
    listed = client.responses.input_items.list(follow.id, order="asc")
    roles = [(item.type, item.role) for item in listed.data]
    assert roles == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert listed.data[0].content[0].text == ASK and listed.data[1].id == first.output[0].id
    assert listed.data[2].content[0].text == "And tomorrow?" and not listed.has_more
    newest = client.responses.input_items.list(follow.id, limit=2)
    assert [item.id for item in newest.data] == [item.id for item in listed.data[::-1][:2]] and newest.has_more
    rest = client.responses.input_items.list(follow.id, limit=2, after=newest.last_id)
    assert [item.id for item in rest.data] == [listed.data[0].id] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_" + "0" * 32)
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.responses.input_items.list(follow.id, limit=101)


def _unit_format() -> dict:
    return {"type": "json_schema", "name": "unit", "schema": UNIT_SCHEMA, "strict": True}


@pytest.mark.parametrize(
    "metadata",
    [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}],
    ids=["17 pairs", "a key of 65", "a value of 513"],
)
def test_metadata_is_held_to_openais_bounds(tiny_api, model, metadata):
    """16 pairs, keys of 64 characters, values of 512: a frame every event repeats (a stream's first events, past
    the backlog bound, were cut before its generation began)."""
    with tiny_api.client() as http:
        body = {"model": model, "input": ASK, "max_output_tokens": 2}
        refused = http.post("/v1/responses", json={**body, "metadata": metadata})
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("metadata"), refused.text
        largest = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
        assert http.post("/v1/responses", json={**body, "metadata": largest}).json()["metadata"] == largest
