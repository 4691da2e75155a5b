"""A thinking model's thought apart from its answer: the parser at every split of the text, and the chat API's
``reasoning_content`` and ``reasoning`` (in one reply and streamed) over a tiny model whose template thinks, with
the template's own variables from ``chat_template_kwargs``."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from wsgi_infer.engine.loading.model_loader import load_tokenizer
from wsgi_infer.engine.sampling.grammar import GrammarCompiler
from wsgi_infer.engine.sampling_params import StructuredOutput
from wsgi_infer.server.api.chat.reasoning import ReasoningParser
from wsgi_infer.server.api.chat.tools import ToolPlan

from ..plugins.server_fixtures import thinking_server
from ..support.chat_templates import OPENED_REPLY, OPENED_TEMPLATE, REPLY
from ..support.grammar_reference import accepts
from ..support.sse_client import events

CASES = {
    "<think>\nParis, surely.\n</think>\n\nParis is the capital.": ("Paris, surely.", "Paris is the capital."),
    "Paris.": ("", "Paris."),
    "  <think>a < b</think>": ("a < b", ""),
    "<think>cut short\n": ("cut short\n", ""),  # the length limit came first: all thought
    "<thi": ("", "<thi"),
    "<thinking> is a word": ("", "<thinking> is a word"),
    "Answer: <think>late</think>": ("", "Answer: <think>late</think>"),  # only a leading thought is one
}


def parse(pieces: list[str], opened: bool = False) -> tuple[str, str]:
    parser, reasoning, answer = ReasoningParser(opened), "", ""
    for piece in pieces:
        r, a = parser.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = parser.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize("text", CASES)
def test_every_split_of_a_reply_gives_the_same_thought_and_answer(text):
    """Streams cut text anywhere (a tag over several tokens): one cut at each position, and one per character."""
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:]]) == CASES[text], cut
    assert parse(list(text)) == CASES[text]


def test_a_reply_that_starts_inside_the_thought_the_prompt_opened():
    text = "\nSo: Paris.\n</think>\n\nParis."
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:]], opened=True) == ("So: Paris.", "Paris."), cut
    assert parse(["cut short"], opened=True) == ("cut short", "")


@pytest.fixture(scope="module")
def opened_api(tiny_model_dirs, tmp_path_factory):
    with thinking_server(tiny_model_dirs, tmp_path_factory.mktemp("opened") / "tiny", OPENED_TEMPLATE) as server:
        yield server


@pytest.mark.parametrize("api, reply", [("thinking_api", REPLY), ("opened_api", OPENED_REPLY)])
def test_the_thought_is_reasoning_content_in_a_reply_and_in_its_chunks(request, api, reply):
    """Whether the reply opens its thought or the prompt did."""
    thinking_api = request.getfixturevalue(api)
    body = {"messages": [{"role": "user", "content": "Capital?"}], "temperature": 0, "structured_outputs": reply}
    with thinking_api.client() as http:
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            deltas = [e.json["choices"][0]["delta"] for e in events(r) if e.data and e.data != "[DONE]"]
    assert (
        re.fullmatch("[a-z]{2,12}", message["reasoning_content"])
        and message["reasoning"] == message["reasoning_content"]
    )
    assert re.fullmatch("[A-Z][a-z]{2,12}", message["content"])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)  # vLLM's name, and the other
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert not any("think>" in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)


def test_chat_template_kwargs_reach_the_template_and_its_own_arguments_are_refused(thinking_api):
    ask = {"messages": [{"role": "user", "content": "Capital?"}], "return_token_strs": True}
    with thinking_api.client() as http:
        thinking = http.post("/tokenize", json=ask).json()
        quiet = http.post("/tokenize", json={**ask, "chat_template_kwargs": {"enable_thinking": False}}).json()
        refused = http.post(
            "/v1/chat/completions", json={"messages": ask["messages"], "chat_template_kwargs": {"tokenize": False}}
        )
    assert "think" not in "".join(thinking["token_strs"])
    assert "".join(quiet["token_strs"]).replace("Ċ", "\n").endswith("<think>\n\n</think>\n\n")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


@pytest.fixture(scope="module")
def grammars(tiny_model_dirs) -> tuple[GrammarCompiler, object]:
    tokenizer = load_tokenizer(tiny_model_dirs["llama"])
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer)), tokenizer


@pytest.mark.parametrize(
    "spec, answer, wrong",
    [
        (
            StructuredOutput("json", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
            '{"a": 3}',
            '{"b": 3}',
        ),
        (StructuredOutput("regex", "[A-Z][a-z]+/[0-9]"), "Paris/7", "paris/7"),
        (StructuredOutput("choice", ["yes", "no"]), "no", "maybe"),
        (
            ToolPlan([{"name": "f", "parameters": {"type": "object"}}], "required", False).constraint(),
            '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
            "I will call f.",
        ),
    ],
    ids=["json", "regex", "choice", "tool call"],
)
def test_a_thinking_models_constraint_holds_after_its_free_thought(grammars, spec, answer, wrong):
    """The thought may hold anything (even a partial tag); the answer after it, or alone, is what the constraint
    allows, and nothing else."""
    spec = replace(spec, after_thought=True)
    thought = '<think>\nNo, wait: </thi is no end. {"b": 1}\n</think>\n\n'
    assert accepts(*grammars, spec, thought + answer) and accepts(*grammars, spec, answer)
    assert not accepts(*grammars, spec, thought + wrong) and not accepts(*grammars, spec, wrong)


@pytest.mark.parametrize("api, reply", [("thinking_api", REPLY), ("opened_api", OPENED_REPLY)])
def test_the_thought_is_a_thinking_block_of_a_message_and_of_its_events(request, api, reply):
    """Anthropic's Messages API: the thought in its own block before the text, streamed as thinking deltas."""
    thinking_api = request.getfixturevalue(api)
    body = {
        "model": thinking_api.manager.model_name,
        "messages": [{"role": "user", "content": "Capital?"}],
        "max_tokens": 40,
        "temperature": 0,
        "structured_outputs": reply,  # one of the chat completion's fields this route takes too
    }
    with thinking_api.client() as http:
        message = http.post("/v1/messages", json=body).json()
        with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
            frames = [e.json for e in events(r) if e.data]
    thinking, text = message["content"]
    assert thinking["type"] == "thinking" and re.fullmatch("[a-z]{2,12}", thinking["thinking"])
    assert text["type"] == "text" and re.fullmatch("[A-Z][a-z]{2,12}", text["text"])
    starts = [f["content_block"]["type"] for f in frames if f["type"] == "content_block_start"]
    deltas = [f["delta"] for f in frames if f["type"] == "content_block_delta"]
    assert starts == ["thinking", "text"]
    assert "".join(d.get("thinking", "") for d in deltas) == thinking["thinking"]
    assert "".join(d.get("text", "") for d in deltas) == text["text"]


def test_thinking_disabled_reaches_the_template(thinking_api):
    ask = {"model": thinking_api.manager.model_name, "messages": [{"role": "user", "content": "Capital?"}]}
    with thinking_api.client() as http:
        thinking = http.post("/v1/messages/count_tokens", json=ask).json()["input_tokens"]
        quiet = http.post("/v1/messages/count_tokens", json={**ask, "thinking": {"type": "disabled"}}).json()
    assert quiet["input_tokens"] > thinking  # the template closed an empty thought


def test_reasoning_effort_none_turns_the_thought_off_as_the_templates_variable_does(thinking_api):
    """OpenAI's chat field, as the Responses API's reasoning.effort and Anthropic's thinking disabled do."""
    ask = {"messages": [{"role": "user", "content": "Capital?"}]}

    def tokens(**fields) -> list[int]:
        with thinking_api.client() as http:
            return http.post("/tokenize", json={**ask, **fields}).json()["tokens"]

    quiet = tokens(chat_template_kwargs={"enable_thinking": False})
    assert tokens(reasoning_effort="none") == quiet != tokens(reasoning_effort="high") == tokens()
    assert tokens(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == tokens()  # its own say
    with thinking_api.client() as http:
        responses = [
            http.post("/v1/responses", json={"input": "Capital?", "max_output_tokens": 1, **fields}).json()
            for fields in ({"reasoning": {"effort": "none"}}, {})
        ]
    assert [r["usage"]["input_tokens"] for r in responses] == [len(quiet), len(tokens())]


# Qwen3's way: an assistant's thought sent back is rendered where the template wants it (its turns after the last
# user message, between tool calls); ours renders every one it is given
INTERLEAVED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content is string %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_assistants_thought_sent_back_reaches_a_template_that_renders_it(tiny_model_dirs, tmp_path):
    """Under either name, vLLM's reasoning or reasoning_content, as a Responses API reasoning item before the
    assistant's message, and as an Anthropic thinking block; before, each was ignored."""
    turns = [{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": "Paris."}]
    sent = [
        [turns[0], {**turns[1], **extra}] for extra in ({}, {"reasoning_content": "France"}, {"reasoning": "France"})
    ]
    with thinking_server(tiny_model_dirs, tmp_path / "tiny", INTERLEAVED_TEMPLATE) as server, server.client() as http:
        plain, by_content, by_reasoning = (http.post("/tokenize", json={"messages": m}).json()["tokens"] for m in sent)
        reply = http.post("/v1/chat/completions", json={"messages": sent[2], "max_tokens": 1}).json()
        thought = {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "France"}],
        }
        items = [turns[0], thought, {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]}]
        response = http.post("/v1/responses", json={"input": items, "max_output_tokens": 1}).json()
        blocks = [{"type": "thinking", "thinking": "France", "signature": ""}, {"type": "text", "text": "Paris."}]
        anthropic = [turns[0], {"role": "assistant", "content": blocks}, {"role": "user", "content": "And?"}]
        counted = http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": anthropic}).json()
        without = http.post(
            "/v1/messages/count_tokens", json={"model": "tiny", "messages": [turns[0], turns[1], anthropic[2]]}
        ).json()
    assert by_content == by_reasoning and len(by_content) > len(plain)
    assert reply["usage"]["prompt_tokens"] == response["usage"]["input_tokens"] == len(by_reasoning)
    assert counted["input_tokens"] - without["input_tokens"] == len(by_reasoning) - len(plain)  # a thinking block


# gpt-oss's way: the template reads reasoning_effort (its "Reasoning: high" line); some read a message's name
NAMED_TEMPLATE = (
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name is defined %} ({{ m.name }}){% endif %}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_reasoning_effort_and_a_messages_name_reach_the_template_as_vllm_passes_them(tiny_model_dirs, tmp_path):
    """Before, reasoning_effort other than none and a message's name were dropped: the same prompt for any."""
    ask = [{"role": "user", "content": "Capital?", "name": "ada"}]
    with thinking_server(tiny_model_dirs, tmp_path / "tiny", NAMED_TEMPLATE) as server, server.client() as http:

        def prompt(**fields) -> list[int]:
            return http.post("/tokenize", json={"model": "tiny", **fields}).json()["tokens"]

        high = prompt(messages=ask, reasoning_effort="high")
        own = prompt(messages=ask, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
        unnamed = [{"role": "user", "content": "Capital?"}]
        plain, low = prompt(messages=unnamed), prompt(messages=unnamed, reasoning_effort="low")
        effort = {"input": "Capital?", "max_output_tokens": 1, "reasoning": {"effort": "low"}}
        response = http.post("/v1/responses", json=effort).json()
        decode = server.manager.default.tokenizer.decode
    assert decode(high).startswith("Reasoning: high") and "user (ada)" in decode(high)
    assert decode(own).startswith("Reasoning: low")  # the request's own variable has its say
    assert not decode(plain).startswith("Reasoning") and "(ada)" not in decode(plain)
    assert response["usage"]["input_tokens"] == len(low)
