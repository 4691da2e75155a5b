"""Sampling parameters: stop strings, seeds, penalties, filters, logprobs, validation, and vLLM's min_tokens (no end
of sequence, stop token or stop string before it; speculation held off until it is reached)."""

from __future__ import annotations

import math

import pytest
import torch

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.sampling.filters import in_bits, kept_floor, largest
from wsgi_infer.engine.sampling.sampler import apply_penalties, sample_token, uniform_draw
from wsgi_infer.engine.sampling_params import InvalidParameter, StructuredOutput

from ..conftest import assert_idle
from ..support.transformers_reference import load_hf_model

PROMPT = "Once upon a time, in a land far away, there lived a"


def stream_pieces(llm, prompt, params) -> tuple[list[str], str]:
    engine = llm.engine
    engine.add_request("s", prompt, params)
    pieces, reason = [], None
    while engine.has_unfinished():
        for delta in engine.step():
            pieces.append(delta.text)
            reason = delta.finish_reason or reason
    return pieces, reason


def test_stop_string_truncates_and_is_not_returned(packed_llm):
    free = packed_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].text
    words = free.split()
    assert len(words) > 4, free
    stop = " " + words[3]  # a stop string in the middle of the free output, spanning tokens
    cut = free.index(stop)
    pieces, reason = stream_pieces(
        packed_llm, PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "zzzz-never"])
    )
    assert "".join(pieces) == free[:cut]
    assert reason == "stop"
    assert all(stop not in p for p in pieces)
    assert_idle(packed_llm)


def test_possible_stop_prefix_is_released_when_ruled_out(packed_llm):
    free = packed_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].text
    # A stop string that starts like the output but never completes: all text still arrives.
    stop = free[:3] + "\u2603never"
    out = packed_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert out.text == free and out.finish_reason == "length"


def test_stop_token_ids(tiny_llama):
    free = tiny_llama.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    target = free.token_ids[5]
    first = free.token_ids.index(target)
    out = tiny_llama.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[target])
    )[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop"


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


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_llama):
    greedy = tiny_llama.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=16, ignore_eos=True),
        # 0 beside a float32 tensor: it once dropped every token, and the draw fell past the vocabulary
        SamplingParams(temperature=1.5, top_p=1e-280, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.5, min_p=1.0, max_tokens=16, ignore_eos=True),
    ):
        assert tiny_llama.generate(PROMPT, params)[0].token_ids == greedy, params


@pytest.mark.parametrize("temperature", [1e-30, 1e-40, 5e-324])
def test_a_temperature_near_zero_draws_the_largest_logit(tiny_llama, temperature):
    # logits / 1e-40 overflows float32: the draw once landed past the vocabulary and the engine thread died.
    assert sample_token(torch.tensor([0.5, 2.0, -3.0]), SamplingParams(temperature=temperature), 7, 0) == 1
    tied = {
        sample_token(torch.tensor([2.0, -1.0, 2.0]), SamplingParams(temperature=temperature), 7, p) for p in range(40)
    }
    assert tied == {0, 2}  # the largest ones share the draw, as they do at every temperature
    greedy = tiny_llama.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, ignore_eos=True)
    assert tiny_llama.generate(PROMPT, params)[0].token_ids == greedy


def kept(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> list[bool]:
    bits = in_bits(logits, 1.0)
    return (bits >= kept_floor(bits, top_k, top_p, min_p)).tolist()


def test_each_filter_keeps_the_right_tokens():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert kept(logits, top_k=2) == [True, True, False, False, False]
    probs = logits.softmax(-1)  # ~ [0.64, 0.24, 0.09, 0.03, 0.01]
    assert probs[0] < 0.7 < probs[:2].sum()
    assert kept(logits, top_p=0.7) == [True, True, False, False, False]
    assert kept(logits, min_p=0.1) == [True, True, True, False, False]  # 0.09 / 0.64 > 0.1 > 0.03 / 0.64
    # The nucleus of what top-k kept: the first two hold 0.870 of all, 0.881 of the top four.
    assert kept(logits, top_p=0.875) == [True, True, True, False, False]
    assert kept(logits, top_k=4, top_p=0.875) == [True, True, False, False, False]
    assert kept(logits, top_p=0.99, min_p=0.1) == [True, True, True, False, False]
    # Ties with the last token kept are kept, in either filter: no sort order chooses between equal tokens.
    assert kept(torch.tensor([1.0, 3.0, 1.0, 1.0, 3.0]), top_k=3) == [True] * 5
    assert kept(torch.tensor([1.0, 0.0, 1.0, 1.0]), top_p=0.3) == [True, False, True, True]
    banned = torch.tensor([0.0, float("-inf"), -1.0, float("-inf")])
    assert kept(banned, top_p=0.999) == [True, False, True, False]


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0])
def test_the_nucleus_is_the_fewest_most_likely_tokens_covering_top_p(scale):
    # Against a float64 sort of the whole row: only the tokens that could reach the nucleus are sorted.
    torch.manual_seed(int(scale * 10))
    checked = 0
    for top_p in (0.05, 0.5, 0.9, 0.99):
        for _ in range(5):
            logits = torch.randn(4099) * scale
            probs, order = logits.double().softmax(-1).sort(descending=True)
            before = probs.cumsum(0) - probs
            if (before - top_p).abs().min() < 1e-5:
                continue  # a boundary that float32's rounding decides
            expected = torch.zeros(4099, dtype=torch.bool).scatter(0, order, before < top_p)
            assert kept(logits, top_p=top_p) == expected.tolist(), (scale, top_p)
            checked += 1
    assert checked >= 15


@pytest.mark.parametrize("length", [1, 31, 32, 33, 100, 257, 4096 + 5])
def test_largest_reads_the_chunks_that_hold_them(length):
    torch.manual_seed(length)
    last_largest = torch.randn(length).index_fill_(0, torch.tensor([length - 1]), 9.0)  # in the tail, if any
    for values in (torch.randn(length), torch.randint(0, 4, (length,)).float(), last_largest):  # ties; the tail
        for n in sorted(n for n in {1, 2, 7, length // 8, length // 2, length} if 0 < n <= length):
            top, indices = largest(values, n)
            assert torch.equal(top, values.topk(n).values), (length, n)
            assert torch.equal(values[indices], top) and indices.unique().numel() == n, (length, n)


REFERENCE_ROWS = [
    [2.0, 0.5, 1.5, -1.0, 0.0, float("-inf"), -40.0, 1.5],
    [0.0, 1.0, -0.5, 2.0, 0.3, 0.3, -3.0, float("-inf")],
]


def reference_distribution(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float):
    """In float64, by whole sorts, as the filters are defined (ties with the last token kept are kept)."""
    probs = (torch.tensor(logits, dtype=torch.float64) / temperature).softmax(-1)
    if top_k:
        probs = torch.where(probs >= probs.sort(descending=True).values[top_k - 1], probs, 0.0)
        probs /= probs.sum()
    if top_p < 1.0:
        ordered = probs.sort(descending=True).values
        last = ordered[max(int(((ordered.cumsum(0) - ordered) < top_p).sum()), 1) - 1]
        probs = torch.where(probs >= last, probs, 0.0)
        probs /= probs.sum()
    probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (1.3, 5, 0.9, 0.0), (0.8, 0, 1.0, 0.1)]
)
def test_the_draws_follow_the_filtered_distribution(temperature, top_k, top_p, min_p):
    """20,000 seeded draws of each row (the counts are the same every run) against a float64 reference: each
    token's share within 4 standard deviations, and a token the filters drop (or banned, -inf) never drawn."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    runs = 20_000
    for logits in REFERENCE_ROWS:
        expected = reference_distribution(logits, temperature, top_k, top_p, min_p)
        counts = torch.bincount(
            torch.tensor([sample_token(torch.tensor(logits), params, seed, 5) for seed in range(runs)]),
            minlength=len(logits),
        )
        for token, (count, p) in enumerate(zip(counts.tolist(), expected.tolist())):
            if p == 0.0:
                assert count == 0, (token, logits)
            else:
                assert abs(count / runs - p) <= 4 * math.sqrt(p * (1 - p) / runs) + 1e-9, (token, count, p)


def test_penalty_arithmetic(tiny_llama):
    engine = tiny_llama.engine
    engine.add_request(
        "p", [5, 6, 7], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    )
    seq = engine.scheduler.waiting[0]
    seq.token_ids += [7, 7, 9]  # outputs: 7 twice, 9 once
    logits = torch.zeros(12)
    logits[5], logits[6], logits[7], logits[9] = 4.0, -4.0, 2.0, 1.0
    apply_penalties(logits, seq)
    # repetition over prompt+output (positive / 2, negative * 2), then presence + frequency * count on outputs.
    assert logits[5].item() == 2.0
    assert logits[6].item() == -8.0
    assert logits[7].item() == pytest.approx(1.0 - 0.5 - 0.25 * 2)
    assert logits[9].item() == pytest.approx(0.5 - 0.5 - 0.25)
    assert logits[0].item() == 0.0
    engine.abort("p")
    assert_idle(tiny_llama)


def test_a_repetition_penalty_near_zero_keeps_the_logits_finite(tiny_llama):
    engine = tiny_llama.engine
    engine.add_request("p", [5, 6], SamplingParams(repetition_penalty=1e-147))
    logits = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0, 4.0, -4.0])
    apply_penalties(logits, engine.scheduler.waiting[0])
    assert logits[5].item() == torch.finfo(torch.float32).max and torch.isfinite(logits).all()  # was inf: NaN drawn
    engine.abort("p")
    output = tiny_llama.generate(PROMPT, SamplingParams(repetition_penalty=1e-147, max_tokens=4, seed=1))[0]
    assert len(output.token_ids) == 4 and max(output.token_ids) < engine.hf_config.vocab_size
    assert_idle(tiny_llama)


def test_penalties_reduce_repetition(packed_llm):
    prompt = "Repeat after me: yes yes yes yes yes yes yes yes"
    plain = packed_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids
    penalized = packed_llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0)
    )[0].token_ids
    assert max(penalized.count(t) for t in set(penalized)) < max(plain.count(t) for t in set(plain))


def test_logprobs_match_the_reference_distribution(default_llm, default_model_dir):
    prompt_ids = default_llm.engine.tokenize("The capital of France is")
    out = default_llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    model = load_hf_model(default_model_dir, torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out.token_ids])).logits[0].float()
    reference = logits[len(prompt_ids) - 1 : -1].log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(reference[i, lp.token_id].item(), abs=1e-3)
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy: the sampled token is the most likely
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert all(v <= 0 and math.isfinite(v) for _, v in lp.top)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"max_tokens": -1}, "max_tokens"),  # 0 is valid: it scores the prompt only
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logit_bias": {5: -100.5}}, "logit_bias"),
        ({"logit_bias": {-5: 1}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": 1, "structured_output": StructuredOutput("regex", "a+")}, "min_tokens"),
        ({"min_tokens": None}, "min_tokens"),
        # types the ranges could not tell: a later step crashed on each (its batch lost), or took it for another
        ({"repetition_penalty": None}, "repetition_penalty"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": None}, "top_k"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop": None}, "stop"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"structured_output": "json"}, "structured_output"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidParameter, match=field) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param == field


@pytest.mark.parametrize("params", ["x", {}, [{}]])
def test_generate_takes_sampling_params_only(tiny_llama, params):
    with pytest.raises(ValueError, match="give one SamplingParams"):
        tiny_llama.generate("Hi", params)  # a string was a list of params, a dict the defaults


def test_request_over_the_context_window_is_refused(tiny_llama):
    limit = tiny_llama.engine.max_model_len
    with pytest.raises(ValueError, match=rf"prompt \(3 tokens\) \+ max_tokens \({limit}\).*{limit}"):
        tiny_llama.engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=limit))
    with pytest.raises(ValueError, match="empty"):
        tiny_llama.engine.add_request("y", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        tiny_llama.engine.add_request("z", [10**9], SamplingParams())
    assert_idle(tiny_llama)


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
    stop = " " + free.text.split()[3]  # the stop string of test_sampling's stop test: in the first few tokens
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
