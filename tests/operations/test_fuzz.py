"""Property-based bodies for every route: an OpenAI-shaped 4xx or a correct result, never a 5xx.

Bodies mix the routes' own fields, with well-typed and hostile values, and
junk beyond them: wrong types, missing fields, unicode edge cases, extreme
numbers, nested junk. Generation stays small (a valid ``max_tokens`` is at
most 8) so a few hundred examples run in seconds. ``derandomize`` fixes the
examples, so the suite is the same on every run; ``scripts/fuzz_server.sh``
runs many more, randomly.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wsgi_infer import SamplingParams

pytestmark = pytest.mark.slow  # real processes

EXAMPLES = int(os.environ.get("WSGI_INFER_FUZZ_EXAMPLES", "200"))
RANDOM = os.environ.get("WSGI_INFER_FUZZ_RANDOM") == "1"
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
    st.sampled_from([0.5, -0.0, 1e308, -1e-308, 2**53 + 1, float("nan"), float("inf")]),
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
    "model": st.one_of(st.none(), text),
}
# A valid body per route, around hostile text; most examples also change up to three fields,
# so they get past validation often enough to reach tokenizers, grammars and the engine.
VALID = {
    "/v1/completions": st.fixed_dictionaries({"prompt": text, "max_tokens": st.just(4)}),
    "/v1/chat/completions": st.fixed_dictionaries(
        {
            "messages": st.tuples(st.fixed_dictionaries({"role": st.just("user"), "content": text})).map(list),
            "max_tokens": st.just(4),
        }
    ),
    "/generate": st.fixed_dictionaries({"prompt": text, "max_new_tokens": st.just(4)}),
    "/tokenize": st.fixed_dictionaries({"prompt": text}),
    "/detokenize": st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 49151), max_size=4)}),
}
changes = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=3).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys})
)
requests = st.sampled_from(sorted(VALID)).flatmap(
    lambda route: st.tuples(
        st.just(route), st.one_of(st.builds(lambda base, c: {**base, **c}, VALID[route], changes), junk)
    )
)


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def assert_well_formed(response: httpx.Response, route: str) -> None:
    assert response.status_code < 500, (route, response.status_code, response.text[:400])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", response.text[-400:]
        return
    if response.headers.get("content-type", "").startswith("text/plain"):  # /generate streams plain text
        assert route == "/generate" and response.status_code == 200, (route, response.text[:400])
        return
    body = response.json()  # every answer is JSON, never an HTML error page
    if response.status_code >= 400:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert "Traceback" not in body["error"]["message"]


def test_hostile_bodies_get_json_answers_and_the_engine_stays_exact(server, tiny_llama):
    expected = tiny_llama.generate(PROBE["prompt"], SamplingParams(temperature=0, max_tokens=12))[0].text
    with server.client(timeout=60) as http:
        assert http.post("/v1/completions", json=PROBE).json()["choices"][0]["text"] == expected

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=not RANDOM,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
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
    metrics = server.metrics()
    assert metrics["wsgi_infer:open_streams"] == 0
    assert metrics["wsgi_infer:kv_blocks_free"] == metrics["wsgi_infer:kv_blocks_total"]
