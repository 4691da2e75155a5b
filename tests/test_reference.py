"""Greedy outputs equal transformers' greedy generate, token for token (CPU float32)."""

from __future__ import annotations

import pytest
import torch

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.model_loader import load_hf_model

from .conftest import TINY_ARCHITECTURES, assert_idle

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because", "1, 2, 3,"]


def reference_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = load_hf_model(model_dir, torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_models_match_transformers(arch, tiny_model_dirs):
    llm = LLM(model=str(tiny_model_dirs[arch]), dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=20)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        expected = reference_greedy(tiny_model_dirs[arch], llm.engine.tokenize(prompt), 20)
        assert out.token_ids == expected, f"{arch}: {prompt!r}"
    assert_idle(llm)


def test_default_model_matches_transformers(default_llm, default_model_dir):
    prompt_ids = default_llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = default_llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.token_ids == reference_greedy(default_model_dir, prompt_ids, 24)
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] in default_llm.engine.eos_token_ids
    assert_idle(default_llm)


def test_sharded_checkpoint_loads_the_same_weights(tiny_model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    assert (tmp_path / "model.safetensors.index.json").is_file()
    params = SamplingParams(temperature=0, max_tokens=12)
    sharded = LLM(model=str(tmp_path), dtype="float32").generate(PROMPTS, params)
    single = LLM(model=str(source), dtype="float32").generate(PROMPTS, params)
    assert [o.token_ids for o in sharded] == [o.token_ids for o in single]
