"""Logprobs: each sampled token's, and the top ones', equal to transformers' reference distribution."""

from __future__ import annotations

import math

import pytest
import torch

from wsgi_infer import SamplingParams

from ..support.transformers_reference import load_hf_model


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
        # each top token's logprob is the reference's, and no token the reference ranks higher is left out
        assert [v for _, v in lp.top] == pytest.approx([reference[i, t].item() for t, _ in lp.top], abs=1e-3)
        assert lp.top[-1][1] >= reference[i].topk(3).values[-1].item() - 1e-3
