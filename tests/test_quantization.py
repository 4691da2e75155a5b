"""Weight-only int8 for small batches: close to the full-precision layer, exact for large ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wsgi_infer import LLM, EngineConfig, SamplingParams
from wsgi_infer.engine.layers.quantization import INT8_MAX_ROWS, Int8Linear

from .conftest import assert_idle


def test_int8_linear_small_batches_approximate_large_batches_exact():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).to(torch.bfloat16)
    quantized = Int8Linear(linear)
    small = torch.randn(INT8_MAX_ROWS, 64, dtype=torch.bfloat16)
    error = (quantized(small).float() - linear(small).float()).abs().max()
    assert 0 < error < 0.05 * linear(small).float().abs().max()  # really int8, and close
    large = torch.randn(INT8_MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    assert torch.equal(quantized(large), linear(large))


def test_int8_default_model_still_answers(default_model_dir):
    llm = LLM(model=None, device="cpu", dtype="bfloat16", quantization="int8")  # int8 is for the CPU
    assert isinstance(llm.engine.runner.model.lm_head, Int8Linear)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=16)
    )[0]
    assert "Paris" in out.text
    assert_idle(llm)


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
