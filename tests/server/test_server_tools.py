"""Tool calling over HTTP with the real openai client: calls, results, streamed deltas."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ConfigDict, Field

pytestmark = pytest.mark.slow  # the default model


@pytest.fixture(scope="module")
def client(packed_client):  # no test here compares an offline engine's output: the fast path serves them
    return packed_client


@pytest.fixture(scope="module")
def model(packed_model) -> str:
    return packed_model


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=40)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class TimeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timezone: str = Field(max_length=40)


def tool(name: str, description: str, args: type[BaseModel]) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": args.model_json_schema()},
    }


TOOLS = [
    tool("get_weather", "The current weather in a city", WeatherArgs),
    tool("get_time", "The current time in a timezone", TimeArgs),
]
ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_a_required_call_then_its_result_then_a_text_answer(client, model):
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=120,
        parallel_tool_calls=False,  # one call: greedy calls of this model may go on until the limit on some CPUs
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")  # not parallel
    for call in calls:
        ARGS[call.function.name].model_validate_json(call.function.arguments)

    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *(
            {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}
            for c in calls
        ),
    ]
    answer = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
    # the answer's prompt holds the call and its result, as the server renders the history
    root = str(client.base_url).rstrip("/").removesuffix("/v1")  # vLLM's /tokenize and /detokenize
    chat = {"messages": history, "tools": TOOLS, "tool_choice": "none"}
    rendered = client.post(f"{root}/tokenize", body=chat, cast_to=object)
    text = client.post(f"{root}/detokenize", body={"tokens": rendered["tokens"]}, cast_to=object)["prompt"]
    assert '"sky": "sunny"' in text and calls[0].function.name in text, text
    assert answer.usage.prompt_tokens == rendered["count"]


def test_a_named_function_is_the_one_called(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    TimeArgs.model_validate_json(call.function.arguments)


def test_streamed_tool_call_deltas_reassemble_into_the_same_calls(client, model):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    kwargs["parallel_tool_calls"] = False  # one call, bounded (as above)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or []:
            if part.index not in calls:  # the first delta of a call names it
                assert part.id and part.function.name and part.type == "function"
                calls[part.index] = {"name": part.function.name, "arguments": ""}
            else:
                assert part.id is None and part.function.name is None
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    for c in calls.values():
        json.loads(c["arguments"])


def test_auto_may_answer_in_text(client, model):
    """With auto, text that is not a call is plain content, streamed as it comes ("<", the first token of
    "<tool_call>", is barred so that the reply is text whatever the model prefers)."""
    kwargs = dict(
        model=model, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS, temperature=0, max_tokens=30
    )
    response = client.chat.completions.create(**kwargs, logit_bias={"44": -100}).choices[0]
    assert not response.message.tool_calls and response.finish_reason in ("stop", "length")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kwargs, logit_bias={"44": -100}, stream=True)
    )
    assert streamed == response.message.content and streamed
