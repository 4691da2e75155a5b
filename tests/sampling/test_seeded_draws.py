"""Seeds: a seeded request draws the same tokens whatever the batch beside it, and from its own first tokens given
as a prompt; each draw is uniform, a function of the seed and the position."""

from __future__ import annotations

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.sampling.sampler import uniform_draw

from ..conftest import assert_idle
from .story_prompt import PROMPT


def test_same_seed_same_output_whatever_the_batch(tiny_llama):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = tiny_llama.generate(PROMPT, seeded)[0].token_ids
    companions = [SamplingParams(temperature=0.9, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    batch = tiny_llama.generate(
        ["Hi", PROMPT, "Other text here", PROMPT], [companions[0], seeded, companions[1], companions[2]]
    )
    assert batch[1].token_ids == alone
    other_seed = tiny_llama.generate(
        PROMPT, SamplingParams(temperature=1.0, seed=4321, max_tokens=24, ignore_eos=True)
    )[0]
    assert other_seed.token_ids != alone
    assert_idle(tiny_llama)


def test_a_seeded_generation_continued_from_its_own_first_tokens_draws_the_same_rest(tiny_llama):
    """What a stream continued on another host relies on (issue 65): the prompt and the first tokens given as a
    prompt, the same seed, the rest is the uninterrupted run's; a draw depends on the seed and the position."""
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=30, ignore_eos=True)
    whole = tiny_llama.generate(PROMPT, seeded)[0].token_ids
    prompt_ids = tiny_llama.engine.tokenize(PROMPT)
    for cut in (1, 11, 29):
        rest = SamplingParams(temperature=1.0, seed=99, max_tokens=30 - cut, ignore_eos=True)
        assert tiny_llama.generate([prompt_ids + whole[:cut]], rest)[0].token_ids == whole[cut:], cut


def test_the_uniform_draws_are_uniform_and_a_function_of_seed_and_position():
    draws = [uniform_draw(seed, position) for seed in range(100) for position in range(100)]
    assert all(0.0 <= d < 1.0 for d in draws) and len(set(draws)) == len(draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01  # mean of 10,000: standard error 0.003
    deciles = [sum(int(10 * d) == i for d in draws) for i in range(10)]
    assert min(deciles) > 900 and max(deciles) < 1100, deciles  # about 1,000 each (standard deviation 30)
    assert uniform_draw(7, 3) == uniform_draw(7, 3) != uniform_draw(7, 4)


def test_unseeded_requests_draw_their_seeds_from_the_engines_seed(tiny_model_dirs):
    """WSGI_INFER_SEED (``seed``) seeds the sequence a new engine draws unseeded requests' seeds from: two engines
    of one seed give their k-th unseeded request the same output, and in one engine the requests differ."""
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", quantization="none", seed=5)
        runs.append([llm.generate(PROMPT, params)[0].token_ids for _ in range(2)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def test_engines_of_no_seed_draw_their_own(tiny_model_dirs):
    """Unset (the default), each engine draws from the OS's entropy: two workers, or a model loaded again, do not
    repeat each other's samples (they did when the default was 0)."""
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    firsts = [
        LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", quantization="none").generate(PROMPT, params)[0]
        for _ in range(2)
    ]
    assert firsts[0].token_ids != firsts[1].token_ids
