"""Constrained decoding and logit bias in the engine (offline API).

Schemas are pydantic models: the constraint is the model's JSON Schema, and
the output must validate against the model itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from enum import StrEnum
from typing import Annotated

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from wsgi_infer.engine.kernels.cpu import load_cpu_kernels
from wsgi_infer.engine.sampling.grammar import apply_grammar_masks
from wsgi_infer.engine.sampling_params import InvalidParameter, SamplingParams, StructuredOutput

from ..conftest import assert_idle
from ..support.grammar_reference import assert_masks_as_the_python_binding


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict clients send


class Person(Strict):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    favourite: Color
    hobbies: list[Annotated[str, Field(max_length=16)]] = Field(max_length=3)  # bounded: greedy text may repeat


class Item(Strict):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    quantity: int = Field(ge=1, le=9)


class Order(Strict):
    items: list[Item] = Field(min_length=1, max_length=2)
    paid: bool
    note: str | None = Field(default=None, max_length=16)


class Flag(Strict):
    enabled: bool
    level: int = Field(ge=-5, le=5)


SCHEMAS = [Person, Order]  # Flag: the random-model test


def constrained(schema: type[BaseModel], **overrides) -> SamplingParams:
    spec = StructuredOutput("json", schema.model_json_schema())
    return SamplingParams(**{"temperature": 0, "max_tokens": 160, "structured_output": spec, **overrides})


def test_greedy_json_validates_alone_and_unchanged_in_a_mixed_batch(packed_llm):
    prompts = [
        packed_llm.apply_chat_template([{"role": "user", "content": f"Give me an example {s.__name__} as JSON."}])
        for s in SCHEMAS
    ]
    plain = ["The capital of France is", "def fibonacci(n):"]
    plain_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [packed_llm.generate(p, constrained(s))[0] for p, s in zip(prompts, SCHEMAS)]
    plain_alone = [packed_llm.generate(p, plain_params)[0].token_ids for p in plain]
    for out, schema in zip(alone, SCHEMAS):
        assert out.finish_reason == "stop", out.text
        schema.model_validate_json(out.text)
    mixed = packed_llm.generate(
        [plain[0], *prompts, plain[1]], [plain_params, *(constrained(s) for s in SCHEMAS), plain_params]
    )
    assert [o.token_ids for o in mixed[1:-1]] == [o.token_ids for o in alone]
    assert [mixed[0].token_ids, mixed[-1].token_ids] == plain_alone
    assert_idle(packed_llm)


def test_sampled_json_from_a_random_model_always_validates(tiny_llama):
    """A random-weight model wants anything: only the mask keeps it valid."""
    params = [constrained(Flag, temperature=1.0, seed=seed, max_tokens=60) for seed in range(6)]
    outputs = tiny_llama.generate(["Anything"] * len(params), params)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        Flag.model_validate_json(out.text)
    assert len({o.text for o in outputs}) > 1, "sampling should vary within the constraint"
    assert_idle(tiny_llama)


@pytest.mark.parametrize(
    ("kind", "value", "check"),
    [
        ("regex", r"[0-9]{3}-[a-z]{2,4}", lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)),
        ("choice", ["alpha", "beta gamma", "délta"], lambda text: text in ("alpha", "beta gamma", "délta")),
        # past llguidance's parser items a row (2,000) as a rule of alternatives: each ended "stop" on "opt"
        (
            "choice",
            [f"opt{i}" for i in range(2500)],
            lambda text: re.fullmatch(r"opt\d+", text) and int(text[3:]) < 2500,
        ),
        ("grammar", 'root ::= "a" [0-9] [0-9]? "b"', lambda text: re.fullmatch(r"a[0-9]{1,2}b", text)),  # GBNF: a 500
        (
            "grammar",
            'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/',
            lambda text: re.fullmatch(r"\(\d\d?(,\d\d?)*\)", text),
        ),
        (
            "json",
            json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}),
            lambda text: isinstance(v := json.loads(text), list) and len(v) <= 2 and {type(b) for b in v} <= {bool},
        ),
    ],
)
def test_regex_choice_lark_and_schema_text_constrain_a_random_model(tiny_llama, kind, value, check):
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_output=StructuredOutput(kind, value))
        for s in range(3)
    ]
    for out in tiny_llama.generate(["Anything"] * 3, params):
        assert check(out.text), (kind, out.text)
    assert_idle(tiny_llama)


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        ("json", {"type": "strin"}),
        ("json", "{not json"),
        ("regex", "[a-"),
        ("grammar", "start: undefined_rule"),
        ("grammar", 'root ::= "a" ('),  # GBNF that does not parse
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_by_name(tiny_llama, kind, value):
    with pytest.raises(InvalidParameter) as refused:
        tiny_llama.generate("x", SamplingParams(structured_output=StructuredOutput(kind, value)))
    assert refused.value.param == "structured_outputs"
    assert_idle(tiny_llama)


def test_the_masks_are_what_llguidances_python_binding_computes(tiny_llama):
    """Our matchers call llguidance's C interface (no GIL held): at every step of random walks through four kinds of
    constraint, the mask our batch rows get is the one its Python binding computes, and both stop together."""
    specs = [
        StructuredOutput("json", Person.model_json_schema()),
        StructuredOutput("regex", "[0-9]{1,3}-[a-z]+"),
        StructuredOutput("choice", ["red", "green", "blue sky"]),
        StructuredOutput("grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
    ]
    engine, kernels = tiny_llama.engine, load_cpu_kernels()
    assert kernels is not None, "the masks' kernel is not tested here"
    for unpacking in (kernels, None):  # the kernels' (a packed model's sampler), and torch's (CUDA, no compiler)
        assert_masks_as_the_python_binding(engine.grammars, engine.tokenizer, specs, kernels=unpacking)


def test_a_matcher_in_error_allows_the_end_of_sequence_alone_and_a_mask_of_another_size_is_refused(tiny_llama):
    """As llguidance's Python binding does; the engine stops a request whose token its grammar refused."""
    engine, vocab = tiny_llama.engine, tiny_llama.engine.grammars.vocab_size
    matcher = engine.grammars.matcher(StructuredOutput("regex", "[0-9]+"))
    (letter,) = engine.tokenizer.encode("x", add_special_tokens=False)
    assert not matcher.consume_token(letter) and matcher.is_error()
    fine = engine.grammars.matcher(StructuredOutput("regex", "[0-9]+"))
    digits = torch.zeros(1, vocab)
    apply_grammar_masks(digits, [0], [fine])
    assert (digits[0] == 0).sum() > 1
    for filling in (load_cpu_kernels(), None):  # the rows filled on the steps' threads, and one after another
        logits = torch.zeros(3, vocab)
        apply_grammar_masks(logits, [0, 2], [matcher, fine], filling)
        assert (logits[0] == 0).nonzero().flatten().tolist() == [engine.tokenizer.eos_token_id]
        assert torch.equal(logits[2], digits[0]) and torch.equal(logits[1], torch.zeros(vocab))
    fresh, wider = (
        engine.grammars.matcher(StructuredOutput("regex", "[0-9]+")),
        torch.zeros(vocab // 32 + 2, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="mask of"):
        fresh.fill_mask(wider.data_ptr(), wider.numel() * 4)


def test_logit_bias_bans_and_forces_tokens(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = tiny_llama.generate("Hello", greedy)[0].token_ids[0]
    banned = tiny_llama.generate("Hello", replace(greedy, logit_bias={first: -100}))[0]
    assert first not in banned.token_ids
    forced = tiny_llama.generate("Hello", replace(greedy, logit_bias={42: 100}))[0]
    assert forced.token_ids == [42] * 6
    with pytest.raises(InvalidParameter) as refused:
        tiny_llama.generate("Hello", SamplingParams(logit_bias={10**7: 1.0}))
    assert refused.value.param == "logit_bias"
    with pytest.raises(InvalidParameter):
        SamplingParams(logit_bias={1: 101})
    assert_idle(tiny_llama)


@pytest.mark.parametrize("indent", [None, 2])
def test_added_tokens_written_in_angle_brackets_are_handed_to_llguidance_as_special(indent):
    """As its Python binding takes them; only the added tokens' list changes, however long it is (here 1.5 MB
    indented: past the first window read) and however the file is written."""
    from wsgi_infer.engine.text.llguidance_c import _angle_bracketed_tokens_special

    added = [{"id": i, "content": f"<tag{i}>", "special": False} for i in range(20_000)]
    added += [{"id": 20_000, "content": "plain", "special": False}, {"id": 20_001, "content": "<s>", "special": True}]
    spec = {"version": "1.0", "added_tokens": added, "model": {"vocab": {"é<x>": 0, '"added_tokens":': 1}}}
    marked = json.loads(_angle_bracketed_tokens_special(json.dumps(spec, indent=indent).encode()))
    assert [t["special"] for t in marked["added_tokens"]] == [True] * 20_000 + [False, True]
    assert marked["model"] == spec["model"] and marked["version"] == "1.0"
    assert _angle_bracketed_tokens_special(b'{"model": {}}') == b'{"model": {}}'
