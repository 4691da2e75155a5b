"""Temperature and the filters (top_k, top_p, min_p): each keeps the right tokens, ties included, the extremes
are greedy, and the draws follow the filtered distribution of a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from wsgi_infer import SamplingParams
from wsgi_infer.engine.sampling.filters import in_bits, kept_floor, largest
from wsgi_infer.engine.sampling.sampler import sample_token

from .story_prompt import PROMPT


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
