"""Property-based sampling settings, on the engine itself: any SamplingParams that validates (every field at any
value its range allows, subnormal temperatures and extreme seeds included) either is refused by name when its
request is added, or decodes in a mixed batch to tokens of the vocabulary, within its max_tokens, and leaves the
engine idle. A fault here ends the engine thread and every stream of a worker (a temperature of 4.2e-105 did)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wsgi_infer import SamplingParams
from wsgi_infer.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, InvalidParameter

from ..conftest import assert_idle, fuzz_examples, fuzzing

pytestmark = pytest.mark.slow  # 24 s of examples

EXAMPLES = fuzz_examples(150)

token_ids = st.integers(0, 60_000)  # the tiny Llama's vocabulary is 49,152 tokens: some past it
words = st.text(max_size=12)
FIELDS = {
    "temperature": st.floats(0.0, 2.0),
    "top_k": st.integers(-1, 60_000),
    "top_p": st.floats(0.0, 1.0, exclude_min=True),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.none() | st.integers(-(2**70), 2**70),
    "repetition_penalty": st.floats(0.0, 10.0, exclude_min=True),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "stop": st.lists(words, max_size=3),
    "stop_token_ids": st.lists(token_ids, max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "max_tokens": st.integers(0, 6),
    "min_tokens": st.integers(0, 6),
    "logprobs": st.none() | st.integers(0, MAX_LOGPROBS),
    "prompt_logprobs": st.none() | st.integers(0, MAX_LOGPROBS),
    "skip_special_tokens": st.booleans(),
    "logit_bias": st.dictionaries(token_ids, st.floats(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS), max_size=4),
    "allowed_token_ids": st.none() | st.lists(token_ids, max_size=4),
    "bad_words": st.lists(words, max_size=3),
    "truncate_prompt_tokens": st.none() | st.integers(-1, 8),
}
sampling_params = st.fixed_dictionaries({}, optional=FIELDS)
prompts = st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 49_151), min_size=1, max_size=8))


def built(fields: dict) -> SamplingParams | None:
    try:
        return SamplingParams(**fields)
    except InvalidParameter as refused:  # by name: the API answers a 400 that points at a field it was given
        assert refused.param in fields, (refused.param, str(refused), fields)
        return None


# torch's float32 ops on the tiny Llama; the CPU kernels, speculating, on the default model (0.25 s an example)
@pytest.mark.parametrize("engine, share", [("tiny_llama", 1), ("packed_llm", 4)])
def test_every_valid_setting_decodes_within_the_vocabulary_or_is_refused_by_name(request, engine, share):
    llm = request.getfixturevalue(engine)
    vocab = llm.engine.hf_config.vocab_size

    @fuzzing(EXAMPLES // share)
    @given(batch=st.lists(st.tuples(prompts, sampling_params), min_size=1, max_size=3))
    def one_batch(batch: list[tuple[object, dict]]) -> None:
        requests = [(prompt, params) for prompt, fields in batch if (params := built(fields)) is not None]
        if not requests:
            return
        try:
            outputs = llm.generate([p for p, _ in requests], [params for _, params in requests])
        except InvalidParameter as refused:  # by name: a field one of the requests was given
            assert any(refused.param in fields for _, fields in batch), (refused.param, str(refused))
        except ValueError as refused:  # or the prompt (empty once truncated): no other error is an answer
            assert str(refused).startswith("prompt"), refused
        else:
            for output, (_, params) in zip(outputs, requests):
                assert all(0 <= t < vocab for t in output.token_ids), output.token_ids
                assert len(output.token_ids) <= params.max_tokens
        assert_idle(llm)

    one_batch()
