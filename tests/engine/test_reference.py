"""Greedy outputs equal transformers' greedy generate, token for token (CPU float32)."""

from __future__ import annotations

import json

import pytest
import torch

from wsgi_infer import LLM, SamplingParams

from ..conftest import TINY_ARCHITECTURES, assert_idle
from ..support.transformers_reference import reference_greedy, reference_prompt_logprobs

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog because", "1, 2, 3,"]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_models_match_transformers(arch, tiny_model_dirs):
    llm = LLM(model=str(tiny_model_dirs[arch]), dtype="float32", quantization="none", block_size=4)
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
    sharded = LLM(model=str(tmp_path), dtype="float32", quantization="none").generate(PROMPTS, params)
    single = LLM(model=str(source), dtype="float32", quantization="none").generate(PROMPTS, params)
    assert [o.token_ids for o in sharded] == [o.token_ids for o in single]


def test_prompt_logprobs_match_transformers_across_chunks_cache_and_batches(tiny_llama, tiny_model_dirs):
    """A 150-token prompt prefilled in 64-token chunks, next to another request, twice (the second
    time its blocks are cached: prompt logprobs must recompute them all)."""
    prompt = " ".join(f"word{i}" for i in range(60))
    ids = tiny_llama.engine.tokenize(prompt)
    assert len(ids) > 2 * 64
    expected = reference_prompt_logprobs(tiny_model_dirs["llama"], ids)
    score = SamplingParams(max_tokens=0, prompt_logprobs=2)
    for _ in range(2):
        scored, other = tiny_llama.generate([ids, "Hello"], [score, SamplingParams(temperature=0, max_tokens=8)])
        assert scored.finish_reason == "length" and scored.token_ids == [] and scored.text == ""
        assert [lp.token_id for lp in scored.prompt_logprobs] == ids[1:]
        got = torch.tensor([lp.logprob for lp in scored.prompt_logprobs])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob - 1e-5 for lp in scored.prompt_logprobs)
    generated = tiny_llama.generate(ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0))[0]
    assert len(generated.token_ids) == 3 and len(generated.prompt_logprobs) == len(ids) - 1
    assert_idle(tiny_llama)


def test_a_weight_the_checkpoint_lacks_is_refused_by_name(tiny_model_dirs, tmp_path):
    """A config that declares biases its checkpoint does not hold: a clear error, not unset memory."""
    source = tiny_model_dirs["llama"]
    for path in source.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj\.bias"):
        LLM(model=str(tmp_path), dtype="float32", quantization="none")


@pytest.mark.parametrize("arch", ["llama3", "phi3"])
def test_rope_tables_grow_as_positions_need_them_with_the_same_values(tiny_model_dirs, arch, monkeypatch):
    """Tables start at 4,096 positions and double on demand (a 131,072-position window is not built up front); a
    grown table equals one built whole, LongRoPE's long factors past the original context included."""
    from transformers import AutoConfig

    from wsgi_infer.engine.layers.rotary import RotaryEmbedding

    config = AutoConfig.from_pretrained(tiny_model_dirs[arch])
    grown = RotaryEmbedding(config, 65536)
    assert len(grown.cos) == 4096
    positions = torch.tensor([9000, 5, 4095, 4096])
    cos, sin = grown(positions)
    assert len(grown.cos) == 9001  # what the step needs, at least twice the last size
    monkeypatch.setattr(RotaryEmbedding, "FIRST_POSITIONS", 65536)
    whole = RotaryEmbedding(config, 65536)
    assert torch.equal(cos, whole.cos[positions].unsqueeze(1)) and torch.equal(sin, whole.sin[positions].unsqueeze(1))
