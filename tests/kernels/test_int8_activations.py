"""The activations of packed multiplies (``activations``): 8-bit, as llama.cpp's q8 rows, or the exact path's 16 bits.
Either way a row's result is the same alone and in any batch (test_packed_mm holds the kernels to their products)."""

from __future__ import annotations

import logging

import pytest

from wsgi_infer import LLM, SamplingParams

from ..conftest import assert_idle
from ..support.batch_runs import PROMPTS, run_alone, run_staggered


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_model_on_int8_activations_says_so_and_batches_equal_each_request_alone(tiny_model_dirs, arch, caplog):
    """The setting reaches every packed multiply (the fused decoder's too), is logged as not exact, and keeps a
    row's result independent of its batch; the exact path gives other logits."""
    with caplog.at_level(logging.INFO, logger="wsgi_infer.engine.model_runner"):
        llm = LLM(model=str(tiny_model_dirs[arch]), block_size=4, max_num_batched_tokens=64, activations="int8")
    assert llm.engine.runner.kernels.planes == 1 and llm.engine.runner.model.fused_decoder is not None
    assert "8-bit activations" in caplog.text and "not exact" in caplog.text
    alone = {f"r{i}": run_alone(llm, p) for i, p in enumerate(PROMPTS)}
    assert run_staggered(llm, PROMPTS) == alone
    assert_idle(llm)
    exact = LLM(model=str(tiny_model_dirs[arch]), block_size=4, max_num_batched_tokens=64, activations="int16")
    assert exact.engine.runner.kernels.planes == 2
    layers = LLM(model=str(tiny_model_dirs[arch]), block_size=4, max_num_batched_tokens=64, activations="int8")
    layers.engine.runner.model.fused_decoder = None  # the layers' loop, whose multiplies read the setting
    read = SamplingParams(max_tokens=0, prompt_logprobs=0)
    eight, sixteen, loop = (m.generate(PROMPTS[4], read)[0].prompt_logprobs for m in (llm, exact, layers))
    assert eight != sixteen and eight == loop  # the fused decoder's multiplies are 8-bit as well
