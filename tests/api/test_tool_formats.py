"""Mistral's and Phi-4-mini's tool calls: a list opened by a special token, which the grammar asks for as that token
and the parser reads in the reply's text. A tiny model with each family's special tokens and chat template, served
in this process."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from wsgi_infer.server.api.chat.tool_formats import MISTRAL, PHI4_MINI, ToolFormat, tool_format_of
from wsgi_infer.server.api.chat.tools import ToolCallParser

from ..conftest import save_tiny_model, tiny_settings
from ..support.chat_templates import MISTRAL_TEMPLATE, PHI4_TEMPLATE
from ..support.in_process import InProcessServer
from ..support.sse_client import events
from .weather_tool import UNIT

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The current {name[4:]}",
            "parameters": {
                "type": "object",
                "properties": {"unit": UNIT},
                "required": ["unit"],
                "additionalProperties": False,
            },
        },
    }
    for name in ("get_weather", "get_time")
]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
FAMILIES = {
    "mistral": (MISTRAL_TEMPLATE, ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[INST]", "[/INST]"]),
    "phi4_mini": (PHI4_TEMPLATE, ["<|tool_call|>", "<|/tool_call|>", "<|tool|>", "<|/tool|>", "<|end|>"]),
}


def test_each_familys_template_picks_its_format():
    assert tool_format_of(MISTRAL_TEMPLATE) is MISTRAL
    assert tool_format_of(PHI4_TEMPLATE) is PHI4_MINI


@pytest.mark.parametrize("fmt", [MISTRAL, PHI4_MINI], ids=lambda f: f.name)
def test_a_list_of_calls_fed_piece_by_piece_gives_each_call(fmt: ToolFormat):
    calls = [fmt.call("get_weather", '{"unit":"celsius"}'), fmt.call("get_time", '{"unit":"fahrenheit"}')]
    text = fmt.begin + fmt.separator.join(calls) + fmt.end
    parser, entries = ToolCallParser(fmt), []
    for at in range(0, len(text), 3):
        entries += parser.feed(text[at : at + 3]).get("tool_calls", [])
    entries += parser.finish().get("tool_calls", [])
    assert [e["function"]["name"] for e in entries if "id" in e] == ["get_weather", "get_time"]
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [
        ("get_weather", '{"unit":"celsius"}', True),
        ("get_time", '{"unit":"fahrenheit"}', True),
    ]
    assert parser.content is None and all(len(c.id) == (9 if fmt is MISTRAL else 29) for c in parser.calls)
    plain, head = ToolCallParser(fmt), fmt.begin[:5]  # text that starts as a call would, then does not
    assert plain.feed(head) == {} and plain.feed("S] are here") == {"content": head + "S] are here"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tiny_model_dirs, tmp_path_factory):
    """The family's format and the tiny Llama with its special tokens and template, served in this process."""
    template, tokens = FAMILIES[request.param]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = template
    directory = save_tiny_model("llama", tokenizer, tmp_path_factory.mktemp(request.param))
    with InProcessServer(tiny_settings(tiny_model_dirs, model=directory)) as server:
        yield tool_format_of(template), server, tokenizer


def chat(server, **fields) -> dict:
    body = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80, **fields}
    with server.client() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_required_calls_are_the_familys_list_with_its_own_tokens(family, parsed_texts):
    fmt, server, _ = family
    choice = chat(server, tool_choice="required")
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls and all(json.loads(c["function"]["arguments"])["unit"] in UNIT["enum"] for c in calls)
    listed = fmt.separator.join(fmt.call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
    assert parsed_texts[-1] == fmt.begin + listed + fmt.end  # the special tokens were written, and kept

    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 80}
    with server.client() as http, http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [e.json for e in events(r) if e.data and e.data != "[DONE]"]
    entries = [entry for chunk in chunks for entry in chunk["choices"][0]["delta"].get("tool_calls") or []]
    streamed = {}
    for entry in entries:
        call = streamed.setdefault(entry["index"], {"name": entry["function"].get("name"), "arguments": ""})
        call["arguments"] += entry["function"].get("arguments", "")
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]


def test_a_named_function_is_the_one_call_in_the_list(family, parsed_texts):
    fmt, server, _ = family
    choice = chat(server, tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert parsed_texts[-1] == fmt.begin + fmt.call("get_time", call["function"]["arguments"]) + fmt.end


def test_auto_calls_when_the_model_writes_the_token_and_answers_in_text_when_not(family, parsed_texts):
    fmt, server, tokenizer = family
    opening = str(tokenizer.convert_tokens_to_ids(fmt.special[0]))
    calling = chat(server, logit_bias={opening: 100})
    assert calling["finish_reason"] == "tool_calls" and calling["message"]["tool_calls"]
    answering = chat(server, logit_bias={opening: -100}, max_tokens=8)
    assert answering["message"].get("tool_calls") is None and answering["message"]["content"]
    assert not parsed_texts[-1].startswith(fmt.special[0])


def test_the_calls_go_back_through_the_template_with_their_ids(family):
    fmt, server, tokenizer = family
    calls = chat(server, tool_choice="required")["message"]["tool_calls"]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": '{"unit": "celsius", "value": 21}'} for c in calls]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls}, *results]
    answer = chat(server, messages=history, tool_choice="none", max_tokens=4)
    assert answer["message"]["content"] is not None and answer["finish_reason"] == "length"
    # Mistral's template writes the calls back with their ids (Phi-4's writes none): the prompt is transformers'
    # rendering of the history, the arguments as objects, as its documentation has them.
    with server.client() as http:
        rendered = http.post("/tokenize", json={"messages": history, "tools": TOOLS})
    assert rendered.status_code == 200, rendered.text
    if fmt is MISTRAL:
        objects = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in calls
        ]
        reference = [*ASK, {"role": "assistant", "content": "", "tool_calls": objects}, *results]
        expected = tokenizer.apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True, return_dict=False)
        assert rendered.json()["tokens"] == expected
        prompt = tokenizer.decode(expected)
        assert all(f'"id": "{c["id"]}"' in prompt and c["function"]["name"] in prompt for c in calls), prompt


def test_a_format_whose_token_the_model_lacks_is_a_400_naming_it(tiny_model_dirs, tmp_path):
    """Mistral's template over a tokenizer without [TOOL_CALLS]: the request is refused, not served unconstrained."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tokenizer.chat_template = MISTRAL_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_model_dirs["llama"] / name).read_bytes())
    with InProcessServer(tiny_settings(tiny_model_dirs, model=tmp_path)) as server, server.client() as http:
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 8}
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "'[TOOL_CALLS]' is not one of this model's tokens" in response.json()["error"]["message"]
