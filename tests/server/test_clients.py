"""The client libraries people point at OpenAI-compatible servers, as their docs use them, against a real server:
instructor (JSON_SCHEMA and TOOLS modes) and langchain-openai (streamed tool calls, structured output). The tiny
model's weights are random, so what it writes is what the grammar lets through: each test shows that the
library's own parsing and validation accept it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # imported where used: collecting langchain costs every test process 2 s
    from langchain_openai import ChatOpenAI

pytestmark = pytest.mark.slow  # a real server

ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Weather(BaseModel):
    """The current weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(pattern="^[A-Za-z]{1,12}$")
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


@pytest.fixture(scope="module")
def sdk(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(sdk) -> str:
    return sdk.models.list().data[0].id


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_gets_a_valid_model_in_both_modes(sdk, model, mode):
    """JSON_SCHEMA sends response_format json_object with a schema; TOOLS forces one named function."""
    import instructor

    client = instructor.from_openai(sdk, mode=instructor.Mode[mode])
    weather = client.chat.completions.create(
        model=model, messages=ASK, response_model=Weather, max_tokens=60, temperature=0, max_retries=0
    )
    assert isinstance(weather, Weather)


def chat(tiny_server, model: str) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{tiny_server.url}/v1", api_key="unused", model=model, temperature=0, max_tokens=60, max_retries=0
    )


def test_langchain_streams_one_valid_call_of_a_bound_tool(tiny_server, model):
    bound = chat(tiny_server, model).bind_tools([Weather], tool_choice="Weather")
    merged = None
    for chunk in bound.stream(ASK):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and not merged.invalid_tool_calls
    [call] = merged.tool_calls
    assert call["name"] == "Weather" and call["id"]
    Weather.model_validate(call["args"])


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output_in_each_method_that_sends_the_schema(tiny_server, model, method):
    """(json_mode sends no schema: any JSON object is a right answer, which a random model's is not held to.)"""
    structured = chat(tiny_server, model).with_structured_output(Weather, method=method)
    assert isinstance(structured.invoke(ASK), Weather)


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    unit: Literal["celsius", "fahrenheit"]


def test_openai_agents_default_model_runs_a_tool_then_answers_in_its_output_type(tiny_server, model):
    """openai-agents' default model speaks the Responses API, sending the tools beside the output type's schema:
    a forced call of the agent's tool, its output sent back, then a reply that calls nothing follows the schema.
    The tool is offered until it has run (its is_enabled), and the agent's reset_tool_choice (the default) drops the
    forced choice after it, so the second turn can only answer: a random model could otherwise call on and on."""
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool(is_enabled=lambda context, agent: not calls)
    def get_weather(city: Literal["Paris", "Lyon"]) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "21 degrees, sunny"

    client = openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        output_type=Verdict,
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=200, temperature=0),
        reset_tool_choice=True,
    )
    result = Runner.run_sync(agent, ASK[0]["content"], max_turns=2, run_config=RunConfig(tracing_disabled=True))
    assert isinstance(result.final_output, Verdict)
    assert len(calls) == 1 and calls[0] in {"Paris", "Lyon"}
    # Two model calls: the forced tool call, then the answer in the schema.
    assert [[item.type for item in r.output] for r in result.raw_responses] == [["function_call"], ["message"]]
