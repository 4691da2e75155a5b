"""vLLM's min_tokens: no end of sequence, stop token or stop string before it; speculation held off until it is
reached."""

from __future__ import annotations

from wsgi_infer import LLM, SamplingParams

from ..conftest import assert_idle
from .story_prompt import PROMPT

SHORT = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
PASSAGE = "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. All that glitters is not gold. "
REPEAT = [{"role": "user", "content": PASSAGE * 2 + "\nRepeat the passage above, once."}]


def test_no_end_of_sequence_before_min_tokens_and_the_batch_beside_it_unchanged(packed_llm):
    eos = packed_llm.engine.eos_token_ids
    free = packed_llm.chat(SHORT, SamplingParams(temperature=0, max_tokens=64))[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] in eos  # the case: a reply that ends early
    least = len(free.token_ids) + 6
    prompt = packed_llm.apply_chat_template(SHORT)
    beside = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    greedy, sampled, other = packed_llm.generate(
        [prompt, prompt, PROMPT],
        [
            SamplingParams(temperature=0, max_tokens=64, min_tokens=least),
            SamplingParams(temperature=1.0, seed=7, max_tokens=64, min_tokens=least),
            beside,
        ],
    )
    for held in (greedy, sampled):
        assert len(held.token_ids) > least or held.finish_reason == "length", held
        assert not eos & set(held.token_ids[:least]), held.token_ids
    # greedy: the same tokens up to where the end was barred, then another
    assert greedy.token_ids[: len(free.token_ids) - 1] == free.token_ids[:-1]
    assert other.token_ids == packed_llm.generate(PROMPT, beside)[0].token_ids
    assert_idle(packed_llm)


def test_a_stop_token_before_min_tokens_is_barred(tiny_llama):
    free = tiny_llama.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    target = free.token_ids[3]
    first = free.token_ids.index(target)
    least = first + 2
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[target], min_tokens=least)
    out = tiny_llama.generate(PROMPT, params)[0]
    assert out.token_ids[:first] == free.token_ids[:first]
    assert target not in out.token_ids[:least] and len(out.token_ids) > least
    assert out.finish_reason == "length" or out.token_ids[-1] == target
    assert_idle(tiny_llama)


def test_a_stop_string_counts_only_after_the_text_of_min_tokens(packed_llm):
    free = packed_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop = " " + free.text.split()[3]  # test_stop_strings_and_tokens' stop string: in the first few tokens
    cut = free.text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    assert packed_llm.generate(PROMPT, params)[0].text == free.text[:cut]
    held = packed_llm.generate(PROMPT, SamplingParams(**{**vars(params), "min_tokens": 40}))[0]
    assert (held.text, held.finish_reason) == (free.text, "length")


def test_speculation_waits_for_min_tokens_and_changes_no_token(packed_llm):
    """A draft's tokens are the model's own argmax, which bars nothing: a request short of min_tokens drafts none."""
    free = packed_llm.chat(REPEAT, SamplingParams(temperature=0, max_tokens=80))[0]
    assert free.finish_reason == "stop"  # the passage copied (drafts), then the end, which min_tokens bars below
    params = SamplingParams(temperature=0, max_tokens=80, min_tokens=len(free.token_ids) + 10)
    drafts = packed_llm.engine.spec.drafts
    speculated = packed_llm.chat(REPEAT, params)[0]
    assert packed_llm.engine.spec.drafts > drafts  # drafts verified past min_tokens: the passage repeats
    assert speculated.token_ids == LLM(model=None, speculative="none").chat(REPEAT, params)[0].token_ids
    assert len(speculated.token_ids) > params.min_tokens or speculated.finish_reason == "length"
