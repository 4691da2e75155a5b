"""Repetition, presence and frequency penalties: their arithmetic on the logits, finite whatever the penalty, and
less repetition in the output."""

from __future__ import annotations

import pytest
import torch

from wsgi_infer import SamplingParams
from wsgi_infer.engine.sampling.sampler import apply_penalties

from ..conftest import assert_idle
from .story_prompt import PROMPT


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
