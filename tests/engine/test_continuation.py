"""A request continued from the tokens it had generated elsewhere (a stream whose host died, issue 65): the engine
computes them again with the prompt, and the rest of its tokens and text is the uninterrupted run's."""

from __future__ import annotations

import re

import pytest

from wsgi_infer import SamplingParams
from wsgi_infer.engine.sampling_params import StructuredOutput

from ..conftest import assert_idle

PROMPT = "Once upon a time, in a land far away, there lived a"


def run(engine, prompt_ids: list[int], params: SamplingParams, generated: list[int] = ()) -> list[tuple[int, str]]:
    """Each new token with the text released with it (speculation is off: one token per delta), then the finish."""
    engine.add_request("r", prompt_ids, params, generated)
    steps = []
    while engine.has_unfinished():
        for delta in engine.step():
            steps += [(token, "") for token in delta.token_ids[:-1]] + [(delta.token_ids[-1], delta.text)]
            finish = delta.finish_reason
    return steps + [(-1, finish)]


def assert_continues(engine, prompt_ids: list[int], params: SamplingParams, whole: list, cuts) -> None:
    """Continued from each cut of the uninterrupted run ``whole``, the request gives the rest of it."""
    for cut in cuts:
        generated = [token for token, _ in whole[:cut]]
        assert run(engine, prompt_ids, params, generated) == whole[cut:], cut


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_continued_request_gives_the_uninterrupted_runs_tokens_and_text(tiny_llama, sampled):
    engine = tiny_llama.engine
    prompt_ids = engine.tokenize(PROMPT)
    params = SamplingParams(temperature=1.0 if sampled else 0.0, seed=5, max_tokens=24, ignore_eos=True)
    whole = run(engine, prompt_ids, params)
    assert_continues(engine, prompt_ids, params, whole, (1, 9, 23))
    assert_idle(tiny_llama)


def test_a_continuation_holds_back_and_matches_a_stop_string_as_the_uninterrupted_run(packed_llm):
    """Cut inside a stop string's held-back text: the continuation releases or swallows it as the run did."""
    engine = packed_llm.engine
    prompt_ids = engine.tokenize(PROMPT)
    free = run(engine, prompt_ids, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = "".join(piece for _, piece in free[:-1])
    stop = text[text.index(" ", 20) : text.index(" ", 20) + 6]  # spans tokens, somewhere in the middle
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    whole = run(engine, prompt_ids, params)
    assert whole[-1] == (-1, "stop") and stop not in "".join(piece for _, piece in whole[:-1])
    # Tokens whose text was held back, before the one that matched (its delta ends the run: nothing to continue)
    held = [i for i, (_, piece) in enumerate(whole[:-2]) if not piece]
    assert held, whole
    assert_continues(engine, prompt_ids, params, whole, {held[0], held[-1] + 1, len(whole) - 2})
    assert_idle(packed_llm)


def test_a_continuation_keeps_to_the_grammar_from_where_it_was(tiny_llama):
    engine = tiny_llama.engine
    prompt_ids = engine.tokenize(PROMPT)
    pattern = "[a-z]{2,6}( [a-z]{2,6}){4,8}[.]"
    spec = StructuredOutput("regex", pattern)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_output=spec)
    whole = run(engine, prompt_ids, params)
    assert whole[-1] == (-1, "stop") and re.fullmatch(pattern, "".join(piece for _, piece in whole[:-1])), whole
    assert_continues(engine, prompt_ids, params, whole, (1, len(whole) // 2, len(whole) - 2))
    assert_idle(tiny_llama)
