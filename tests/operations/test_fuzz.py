"""Property-based bodies for every route that takes one (generation, Responses, Messages, embeddings, scores,
tokens): a 4xx in the route's error shape (OpenAI's, or Anthropic's for Messages) or a correct result, never a 5xx.

Bodies mix the routes' own fields, with well-typed and hostile values, and junk beyond them: wrong types, missing
fields, unicode edge cases, extreme numbers, nested junk. Generation stays small (a valid ``max_tokens`` is at most 8,
and a null one ends at a 256-token window) so a few hundred examples run in seconds. The suite's examples are fixed
(``conftest.fuzzing``); ``scripts/fuzz_server.sh`` runs many more, randomly.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wsgi_infer import SamplingParams

from ..conftest import fuzz_examples, fuzzing, tiny_settings

pytestmark = pytest.mark.slow  # real processes

EXAMPLES = fuzz_examples(400)
PROBE = {"prompt": "The fuzzer's control prompt", "max_tokens": 12, "temperature": 0}

edge_text = st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "\ud7ff",
        "\ud800",
        "a\udfffb",
        "\ufeff",
        "\u202e",
        "e\u0301",
        "🦜" * 50,
        "\\u0000",
        "<tool_call>",
        "{{x}}",
        "%s%n",
    ]
)
surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)  # JSON escapes can spell them
text = st.one_of(st.text(max_size=40), surrogates, edge_text)
numbers = st.one_of(
    st.integers(-10, 10),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.5, -0.0, 1e308, -1e-308, 1e-40, 5e-324, 2**53 + 1, float("nan"), float("inf")]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, text)
junk = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4), max_leaves=8
)
small_tokens = st.one_of(st.integers(-2, 8), st.integers(10**6, 2**70), junk)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | junk, "content": text | junk}
    )
    | junk,
    max_size=3,
)
FIELDS = {
    "prompt": st.one_of(text, st.lists(st.integers(-5, 60000), max_size=6), st.lists(text, max_size=3), junk),
    "messages": messages,
    "max_tokens": small_tokens,
    "max_completion_tokens": small_tokens,
    "max_new_tokens": small_tokens,
    "n": st.one_of(st.integers(-1, 3), junk),
    "temperature": numbers | junk,
    "top_p": numbers | junk,
    "top_k": numbers | junk,
    "min_p": numbers | junk,
    "seed": numbers | junk,
    "stop": st.one_of(text, st.lists(text, max_size=6), junk),
    "logprobs": st.one_of(st.integers(-1, 25), st.booleans(), junk),
    "top_logprobs": st.one_of(st.integers(-1, 25), junk),
    "logit_bias": st.one_of(st.dictionaries(st.integers(-5, 70000).map(str), numbers, max_size=3), junk),
    "echo": st.booleans() | junk,
    "stream": st.booleans() | junk,
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])}), junk
    ),
    "structured_outputs": st.one_of(
        st.fixed_dictionaries({"regex": st.sampled_from(["[0-9]{1,3}", "(", "a*"])}),
        st.fixed_dictionaries({"choice": st.lists(text, max_size=3)}),
        junk,
    ),
    "tools": st.one_of(
        st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": junk}), max_size=2), junk
    ),
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | junk,
    "tokens": st.one_of(st.lists(st.integers(-3, 70000), max_size=6), junk),
    "model": st.one_of(st.none(), text, st.sampled_from(["tiny", "minilm"])),
    # the Responses API's
    "input": st.one_of(
        text,
        st.lists(text, max_size=3),
        st.lists(st.integers(-5, 60000), max_size=4),
        st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call_output"]) | junk}), max_size=2
        ),
        messages,
    ),
    "instructions": text | junk,
    "previous_response_id": text | junk,
    "max_output_tokens": small_tokens,
    "text": st.one_of(
        st.fixed_dictionaries(
            {"format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_schema"]) | junk, "schema": junk})}
        ),
        junk,
    ),
    "store": st.booleans() | junk,
    # Anthropic's Messages API's
    "system": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)),
    "stop_sequences": st.one_of(st.lists(text, max_size=5), junk),
    "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"]) | junk}), junk),
    # embeddings' and scores'
    "encoding_format": st.sampled_from(["float", "base64", "int8"]) | junk,
    "dimensions": small_tokens,
    "truncate_prompt_tokens": st.one_of(st.integers(-3, 600), junk),
    "text_1": st.one_of(text, st.lists(text, max_size=3), junk),
    "text_2": st.one_of(text, st.lists(text, max_size=3), junk),
    "query": text | junk,
    "documents": st.one_of(st.lists(text | st.fixed_dictionaries({"text": text | junk}), max_size=4), junk),
    "top_n": small_tokens,
    "return_documents": st.booleans() | junk,
}
# A valid body per route; most examples change some of its fields to hostile values (below), few enough that
# they get past validation often enough to reach tokenizers, grammars and the engines.
words = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)  # a valid text
user_turn = st.tuples(st.fixed_dictionaries({"role": st.just("user"), "content": words})).map(list)
texts = st.lists(words, min_size=1, max_size=3)
streamed = st.booleans()  # half of the generating routes' valid bodies stream
VALID = {
    "/v1/completions": st.fixed_dictionaries({"prompt": words, "max_tokens": st.just(4), "stream": streamed}),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": user_turn, "max_tokens": st.just(4), "stream": streamed}
    ),
    "/v1/responses": st.fixed_dictionaries({"input": words, "max_output_tokens": st.just(4), "stream": streamed}),
    "/v1/messages": st.fixed_dictionaries(
        {"model": st.just("tiny"), "messages": user_turn, "max_tokens": st.just(4), "stream": streamed}
    ),
    "/v1/messages/count_tokens": st.fixed_dictionaries({"model": st.just("tiny"), "messages": user_turn}),
    "/v1/embeddings": st.fixed_dictionaries({"model": st.just("minilm"), "input": words}),
    "/v1/score": st.fixed_dictionaries({"model": st.just("minilm"), "text_1": words, "text_2": texts}),
    "/v1/rerank": st.fixed_dictionaries({"model": st.just("minilm"), "query": words, "documents": texts}),
    "/v2/rerank": st.fixed_dictionaries({"model": st.just("minilm"), "query": words, "documents": texts}),
    "/generate": st.fixed_dictionaries({"prompt": words, "max_new_tokens": st.just(4)}),
    "/tokenize": st.fixed_dictionaries({"prompt": words}),
    "/detokenize": st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 49151), max_size=4)}),
}
# How each API's streams end: the last data line, or the last event's name.
STREAM_ENDS = {
    "/v1/responses": ("event: response.", ("completed", "incomplete", "failed")),
    "/v1/messages": ("event: ", ("message_stop", "error")),
}
SAMPLING = ["max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logit_bias", "stream"]
RERANK = ["query", "documents", "top_n", "return_documents"]
# Each route's own fields, which its examples change: up to three of them, and one of any route's.
OWN_FIELDS = {
    "/v1/completions": [*SAMPLING, "prompt", "echo", "logprobs", "response_format", "structured_outputs"],
    "/v1/chat/completions": [*SAMPLING, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools"],
    "/v1/responses": ["input", "instructions", "previous_response_id", "max_output_tokens", "text", "store", "tools"],
    "/v1/messages": ["messages", "system", "stop_sequences", "thinking", "max_tokens", "top_k", "tools", "stream"],
    "/v1/messages/count_tokens": ["messages", "system", "tools", "tool_choice"],
    "/v1/embeddings": ["input", "encoding_format", "dimensions", "truncate_prompt_tokens"],
    "/v1/score": ["text_1", "text_2", "truncate_prompt_tokens"],
    "/v1/rerank": RERANK,
    "/v2/rerank": RERANK,
    "/generate": ["prompt", "max_new_tokens", "stream", "temperature", "stop", "seed"],
    "/tokenize": ["prompt", "messages", "tools"],
    "/detokenize": ["tokens"],
}


def changes(route: str) -> st.SearchStrategy[dict]:
    own = st.dictionaries(st.sampled_from(OWN_FIELDS[route]), st.none(), max_size=3)
    keys = st.builds(
        lambda a, b: {**a, **b}, own, st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=1)
    )
    return keys.flatmap(lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}))


def bodies(route: str) -> st.SearchStrategy:
    """A valid body with some of its fields changed, or (one in four) junk instead of a body."""
    changed = st.builds(lambda base, c: {**base, **c}, VALID[route], changes(route))
    return st.integers(0, 3).flatmap(lambda draw: junk if draw == 0 else changed)


requests = st.sampled_from(sorted(VALID)).flatmap(lambda route: st.tuples(st.just(route), bodies(route)))


@pytest.fixture(scope="module")
def server(gunicorn_server, tiny_model_dirs, minilm_dir, tmp_path_factory):
    """The tiny Llama, the default, and all-MiniLM-L6-v2 for the embedding routes. The Llama's window is 256
    tokens: a null max_tokens means up to its end (as OpenAI's and vLLM's), a few seconds rather than minutes."""
    config = tmp_path_factory.mktemp("fuzzed") / "models.toml"
    tiny = f'[models.tiny]\npath = "{tiny_model_dirs["llama"]}"\nmax_model_len = 256\n'
    config.write_text(f'{tiny}\n[models.minilm]\npath = "{minilm_dir}"\n')
    settings = tiny_settings(tiny_model_dirs, models_config=config)
    del settings["model"]  # the file names both; the first is the default
    return gunicorn_server(settings)


def assert_well_formed(response: httpx.Response, route: str) -> None:
    assert response.status_code < 500, (route, response.status_code, response.text[:400])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        prefix, ends = STREAM_ENDS.get(route, ("data: ", ("[DONE]",)))
        lines = [line for line in response.text.splitlines() if line.startswith(prefix)]
        assert lines and lines[-1].removeprefix(prefix) in ends, response.text[-400:]
        return
    if response.headers.get("content-type", "").startswith("text/plain"):  # /generate streams plain text
        assert route == "/generate" and response.status_code == 200, (route, response.text[:400])
        return
    body = response.json()  # every answer is JSON, never an HTML error page
    if response.status_code >= 400 and route.startswith("/v1/messages"):  # Anthropic's shape
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    elif response.status_code >= 400:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in response.text


def test_hostile_bodies_get_json_answers_and_the_engine_stays_exact(server, tiny_llama):
    expected = tiny_llama.generate(PROBE["prompt"], SamplingParams(temperature=0, max_tokens=12))[0].text
    with server.client(timeout=60) as http:
        assert http.post("/v1/completions", json=PROBE).json()["choices"][0]["text"] == expected

        @fuzzing(EXAMPLES)
        @given(request=requests, ascii_only=st.booleans())
        def one_request(request: tuple[str, object], ascii_only: bool) -> None:
            route, body = request
            # NaN and Infinity as Python writes them; lone surrogates either escaped or as invalid UTF-8 bytes.
            content = json.dumps(body, allow_nan=True, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
            response = http.post(route, content=content, headers={"Content-Type": "application/json"})
            assert_well_formed(response, route)

        one_request()
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=PROBE).json()["choices"][0]["text"] == expected
    metrics = server.metrics("tiny")  # the generating model's: the encoder's blocks are 0 of 0
    assert metrics["wsgi_infer:kv_blocks_total"] > 0 and metrics["wsgi_infer:open_streams"] == 0
    assert metrics["wsgi_infer:kv_blocks_free"] == metrics["wsgi_infer:kv_blocks_total"]
