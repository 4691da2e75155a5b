"""What each model must answer: its greedy texts, structured outputs, tool calls and embeddings, taken from a
server before the load (the model's own, alone, when the soak serves several)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from .streams import Failed, choice_text, prompt_field

MAX_LENGTH = 1000
SPECIAL_TOKEN = re.compile(r"<[^<>\s]+>")  # how a special token decodes alone; the text skips it
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
COMPLETION_PROMPTS = (
    "The quick brown fox",
    "Once upon a time",
    "In 1999,",
    "def main():",
    "Paris is",
    "The recipe for bread",
    "Dear committee,",
    "Water boils at",
)
CHAT_PROMPTS = ("What is the capital of France?", "Tell me a story.", "Write a haiku about rain.", "Explain TCP.")
EMBED_INPUTS = (
    "The cat sat on the mat.",
    "A server streams tokens as they are generated.",
    "Paris is the capital of France.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Tokens",
    "Continuous batching shares each step between requests of different lengths, and a paged cache holds them.",
)
UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": UNIT},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# Requests whose whole answer is compared with the reference's: (kind, path, body without the model).
FIXED_BODIES = (
    (
        "structured",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
            "max_tokens": 48,
            "temperature": 0,
        },
    ),
    (
        "tools",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "max_tokens": 48,
            "temperature": 0,
        },
    ),
)


@dataclass
class Reference:
    """One prompt's greedy output of the longest length, with each token's text."""

    model: str
    api: str  # "completion" or "chat"
    prompt: str
    text: str
    pieces: list[str]  # each token decoded alone, special tokens included
    prefixes: list[str] = field(init=False)  # prefixes[k]: the text of the first k tokens
    limit: int = field(init=False)  # lengths up to this have an exactly known text

    def __post_init__(self) -> None:
        self.prefixes, self.limit = [""], len(self.pieces)
        for k, piece in enumerate(self.pieces):
            text = self.prefixes[-1]
            if self.text.startswith(text + piece):
                text += piece
            elif "\ufffd" in piece or not SPECIAL_TOKEN.fullmatch(piece):
                # A character split over tokens decodes to U+FFFD token by token: the text of
                # lengths from here on is not known exactly.
                self.limit = k
                break
            # else a special token (with ignore_eos the model writes <|im_end|> and such): no text
            self.prefixes.append(text)

    def expected(self, length: int) -> str:
        """The text of ``length`` tokens: the server holds back a trailing undecodable piece."""
        k = length
        while k > 0 and self.prefixes[k].endswith("\ufffd"):
            k -= 1
        return self.prefixes[k]

    def body(self, length: int, stream: bool) -> dict:
        body = {"model": self.model, **prompt_field(self.api, self.prompt), "max_tokens": length}
        body.update(temperature=0, ignore_eos=True)
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body


def mismatch(ref: Reference, length: int, text: str, usage: dict | None) -> Failed:
    expected = ref.expected(length)
    at = next((i for i, (a, b) in enumerate(zip(text, expected)) if a != b), min(len(text), len(expected)))
    return Failed(
        "mismatch",
        f"{ref.model} {ref.api} {ref.prompt!r} max_tokens={length} usage={usage}: {len(text)} chars against "
        f"{len(expected)}, first difference at {at}: {text[at : at + 40]!r} != {expected[at : at + 40]!r}",
    )


def answer_of(body: dict) -> dict:
    """What a fixed request's answer must repeat: the message (a tool call's id left out) and why it ended."""
    [choice] = body["choices"]
    message = {key: value for key, value in choice["message"].items() if key != "tool_calls"}
    calls = [call["function"] for call in choice["message"].get("tool_calls") or []]
    return {"message": message, "calls": calls, "finish_reason": choice["finish_reason"]}


@dataclass
class FixedRequest:
    kind: str
    path: str
    body: dict
    expected: dict  # answer_of the reference's answer


@dataclass
class ModelReferences:
    """One model's references: by route for a generating model, by input for an embedding model."""

    name: str
    task: str  # "generate" or "embed"
    max_model_len: int
    greedy: dict[str, list[Reference]] = field(default_factory=dict)
    fixed: list[FixedRequest] = field(default_factory=list)
    embeddings: dict[str, list[float]] = field(default_factory=dict)


def greedy_references(http: httpx.Client, model: str, max_model_len: int, parallel: int) -> dict[str, list[Reference]]:
    """Every prompt's reference, ``parallel`` at a time (greedy output does not depend on the batch)."""

    def one(api: str, prompt: str) -> Reference:
        count = http.post("/tokenize", json={"model": model, **prompt_field(api, prompt)}).json()["count"]
        body = {"model": model, **prompt_field(api, prompt), "max_tokens": min(MAX_LENGTH, max_model_len - count)}
        body.update(temperature=0, ignore_eos=True, logprobs=0 if api == "completion" else True)
        response = http.post(PATHS[api], json=body, timeout=600)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        if api == "completion":
            pieces = choice["logprobs"]["tokens"]
        else:
            pieces = [entry["token"] for entry in choice["logprobs"]["content"]]
        return Reference(model, api, prompt, choice_text(api, choice, streamed=False), pieces)

    jobs = [("completion", p) for p in COMPLETION_PROMPTS] + [("chat", p) for p in CHAT_PROMPTS]
    with ThreadPoolExecutor(parallel) as pool:
        refs = list(pool.map(lambda job: one(*job), jobs))
    return {api: [r for r in refs if r.api == api and r.limit > 0] for api in PATHS}


def model_references(http: httpx.Client, described: dict, parallel: int) -> ModelReferences:
    """``described`` (the model in /v1/models) answering every reference request, ``parallel`` at a time."""
    name, task, max_model_len = described["id"], described["task"], described["max_model_len"]
    refs = ModelReferences(name, task, max_model_len)
    if task == "embed":
        for text in EMBED_INPUTS:  # one at a time: the client's batches must not change them
            response = http.post("/v1/embeddings", json={"model": name, "input": [text]}, timeout=600)
            refs.embeddings[text] = response.raise_for_status().json()["data"][0]["embedding"]
        return refs
    refs.greedy = greedy_references(http, name, max_model_len, parallel)
    for kind, path, body in FIXED_BODIES:
        body = {"model": name, **body}
        response = http.post(path, json=body, timeout=600)
        refs.fixed.append(FixedRequest(kind, path, body, answer_of(response.raise_for_status().json())))
    return refs


def bad_requests(model: ModelReferences) -> list[tuple[str, str, dict | bytes | None, int]]:
    """(method, path, body, status) to a generating model: each must be answered with that status and an OpenAI
    error object."""
    name = model.name
    return [
        ("POST", "/v1/completions", {"model": name, "prompt": "x", "max_tokens": -1}, 400),
        ("POST", "/v1/completions", {"model": name, "prompt": "x", "temperature": "hot"}, 400),
        ("POST", "/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
        ("POST", "/v1/chat/completions", {"model": name, "messages": "not a list"}, 400),
        ("POST", "/v1/completions", {"model": name, "prompt": "x", "n": 0}, 400),
        ("POST", "/v1/completions", {"model": name, "prompt": "x", "max_tokens": model.max_model_len}, 400),
        ("POST", "/v1/completions", {"model": name, "prompt": "x", "best_of": 3}, 400),
        ("POST", "/v1/embeddings", {"model": name, "input": "x", "encoding_format": "hex"}, 400),
        ("POST", "/v1/completions", b"{not json", 400),
        ("GET", "/v1/streams/no-such-stream", None, 404),
    ]
