"""Continuous batching must not change what any request generates."""

from __future__ import annotations

import logging

import pytest

from wsgi_infer import LLM, SamplingParams

from ..conftest import assert_idle
from ..support.batch_runs import GREEDY, PROMPTS, run_alone, run_staggered


@pytest.fixture(scope="module")
def alone(tiny_llama) -> dict[str, list[int]]:
    return {f"r{i}": run_alone(tiny_llama, p) for i, p in enumerate(PROMPTS)}


def test_staggered_batch_equals_each_request_alone(tiny_llama, alone):
    tokens = run_staggered(tiny_llama, PROMPTS)
    assert tokens == alone
    assert_idle(tiny_llama)


def test_offline_batch_equals_each_request_alone(tiny_llama, alone):
    outputs = tiny_llama.generate(PROMPTS, GREEDY)
    assert {f"r{i}": o.token_ids for i, o in enumerate(outputs)} == alone
    # vLLM's prompt dicts are the same prompts (a bare KeyError before); anything else is a TypeError saying so
    ids = outputs[1].prompt_token_ids
    given = [{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}]
    assert [o.token_ids for o in tiny_llama.generate(given, GREEDY)] == [alone["r0"], alone["r1"]]
    with pytest.raises(TypeError, match="prompt_token_ids"):
        tiny_llama.generate({"prompt": PROMPTS[0], "multi_modal_data": {}}, GREEDY)
    assert_idle(tiny_llama)


def test_prefix_cache_hit_keeps_output(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    shared = "Once upon a time, in a land far away, there lived a king who"
    prompts = [shared + " ruled", shared + " loved"]
    cached = LLM(model=model, dtype="float32", quantization="none", block_size=4)
    with_cache = [cached.generate(p, GREEDY)[0].token_ids for p in prompts]  # second reuses the first's blocks
    shared_blocks = len(cached.engine.tokenize(shared)) // 4
    assert cached.engine.kv_cache.num_prefix_hit_blocks >= shared_blocks
    uncached = LLM(model=model, dtype="float32", quantization="none", block_size=4, enable_prefix_caching=False)
    assert with_cache == [uncached.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert uncached.engine.kv_cache.num_prefix_hit_blocks == 0
    assert_idle(cached)


def test_preemption_keeps_outputs(tiny_model_dirs, alone):
    # 24 blocks of 4 tokens cannot hold five growing sequences: some must be preempted.
    llm = LLM(
        model=str(tiny_model_dirs["llama"]),
        dtype="float32",
        quantization="none",
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=64,
    )
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.counters().num_preemptions == llm.engine.scheduler.num_preemptions > 0  # what metrics read
    assert {f"r{i}": o.token_ids for i, o in enumerate(outputs)} == alone
    assert_idle(llm)


def test_the_context_window_is_clamped_to_what_the_kv_cache_holds(tiny_model_dirs, caplog):
    """A 65,536-token window over a 32-token cache: clamped at start, with a warning, so that a request leaving
    max_tokens open fills the cache instead of being refused."""
    with caplog.at_level(logging.WARNING, logger="wsgi_infer.engine.model_runner"):
        llm = LLM(model=str(tiny_model_dirs["llama"]), quantization="none", block_size=4, num_kv_blocks=8)
    assert llm.engine.max_model_len == 32
    assert "max_model_len 65536 is more than the KV cache holds: clamped to 32 tokens" in caplog.text
    prompt = [5, 6, 7]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out.token_ids) == 32 - len(prompt) and out.finish_reason == "length"
    assert_idle(llm)
    with caplog.at_level(logging.WARNING, logger="wsgi_infer.engine.model_runner"):  # one asked past the model's
        llm = LLM(model=str(tiny_model_dirs["llama"]), quantization="none", max_model_len=10**6)  # was unsaid
    assert "max_model_len 1000000 is past the model's 65536 positions: clamped to them" in caplog.text


def test_a_model_whose_tokens_take_more_than_32_kb_gets_room_for_8192_of_them_by_default(tiny_model_dirs, tmp_path):
    """256 MiB, or 8,192 tokens where a token's keys and values take more (a Llama 3.2 3B's 112 KiB a token: 2,290
    tokens in 256 MiB, less than 16 streams of 165), which the server's memory budget counts before the load."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from wsgi_infer.engine.loading.model_loader import load_tokenizer
    from wsgi_infer.server.engine_client.residency import footprint

    tokenizer = load_tokenizer(tiny_model_dirs["llama"])
    wide = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    wide.num_attention_heads = wide.num_key_value_heads = 4
    wide.max_position_embeddings = 65536  # clamped to what the cache holds
    wide.head_dim = 256  # 2 layers x 4 heads x 256 x (keys, values) x 4 bytes (float32): 16 KiB a token
    AutoModelForCausalLM.from_config(wide).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", quantization="none")
    group = llm.engine.runner.kv_groups[0]
    assert group.num_blocks * llm.engine.config.block_size == 16384  # 256 MiB
    assert footprint(tmp_path, None) - footprint(tmp_path, 0) == 256 << 20  # in halves, 8 KiB a token: 256 MiB
    wide.head_dim = 2048  # 128 KiB a token, 64 in halves
    AutoModelForCausalLM.from_config(wide).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", quantization="none")
    assert llm.engine.runner.kv_groups[0].num_blocks * llm.engine.config.block_size == 8192
    assert llm.engine.max_model_len == 8192
    assert footprint(tmp_path, None) - footprint(tmp_path, 0) == 8192 * (64 << 10)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
    assert_idle(llm)


def test_chunked_prefill_never_stalls_decodes(tiny_model_dirs):
    budget = 16
    llm = LLM(
        model=str(tiny_model_dirs["llama"]),
        dtype="float32",
        quantization="none",
        block_size=4,
        max_num_batched_tokens=budget,
    )
    engine = llm.engine
    engine.add_request("decoder", "Hello", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()  # prefill of the short prompt
    long_prompt = list(range(100, 200))  # 100 tokens: needs several chunks
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    steps_until_long_starts = 0
    while True:
        deltas = {d.request_id for d in engine.step()}
        steps_until_long_starts += 1
        assert "decoder" in deltas, "a running decode missed a step during a chunked prefill"
        if "long" in deltas:
            break
    assert steps_until_long_starts >= 100 // budget
    while engine.has_unfinished():
        engine.step()
    assert_idle(llm)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: a pool for its sliding layer, one for its global
def test_abort_frees_everything_at_once(tiny_model_dirs, arch):
    llm = LLM(model=str(tiny_model_dirs[arch]), block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"a{i}", prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.counters().num_free_blocks < engine.counters().num_total_blocks
    for i in range(len(PROMPTS)):
        assert engine.abort(f"a{i}")
    assert not engine.abort("a0")
    assert not engine.has_unfinished()
    assert_idle(llm)
    assert all(pool.num_free_blocks == pool.num_blocks for pool in engine.kv_cache.pools)


@pytest.mark.parametrize("arch", ["qwen3", "smollm3", "llama3", "gemma3", "phi3", "mistral"])
def test_each_architecture_is_batch_invariant_through_chunks_the_prefix_cache_and_preemption(tiny_model_dirs, arch):
    """Alone (and again from the prefix cache), then staggered, then all at once in 16-token chunks
    through 24 blocks of 4 tokens (preempted, but Mistral's sequences hold their window only): the same tokens
    every way."""
    llm = LLM(
        model=str(tiny_model_dirs[arch]),
        dtype="float32",
        quantization="none",
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=16,
    )
    alone = {f"r{i}": run_alone(llm, p) for i, p in enumerate(PROMPTS)}
    assert run_alone(llm, PROMPTS[-1]) == alone[f"r{len(PROMPTS) - 1}"]  # again, from its cached blocks
    assert llm.engine.kv_cache.num_prefix_hit_blocks > 0
    assert run_staggered(llm, PROMPTS) == alone
    outputs = llm.generate(PROMPTS, GREEDY)
    assert (llm.engine.scheduler.num_preemptions > 0) is (arch != "mistral")
    assert {f"r{i}": o.token_ids for i, o in enumerate(outputs)} == alone
    assert_idle(llm)


def test_blocks_behind_every_layers_window_go_back_to_the_pool(tiny_model_dirs):
    """Mistral's layers all slide (8 tokens here): decoding, a sequence of 81 tokens holds the blocks of its last
    8 tokens and the one being written (3 of 4 tokens), not 21, so 8 blocks serve it whole, and it gives the
    same tokens as with every block kept. (Speculation would add a draft's blocks to that: off here.)"""
    settings = dict(dtype="float32", quantization="none", block_size=4, max_num_batched_tokens=16, speculative="none")
    windowed = LLM(model=str(tiny_model_dirs["mistral"]), num_kv_blocks=8, **settings)
    engine, params = windowed.engine, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("long", PROMPTS[-1], params)
    held, tokens = [], []
    for _ in range(200):  # bounded: a sequence that cannot be scheduled must fail the test, not hang it
        tokens += [t for d in engine.step() for t in d.token_ids]
        counters = engine.counters()
        held.append(counters.num_total_blocks - counters.num_free_blocks)
        if not engine.has_unfinished():
            break
    assert len(tokens) == 60
    assert len(engine.tokenize(PROMPTS[-1])) + 60 > 8 * 4 and max(held[-40:]) <= 8 // 4 + 1
    assert engine.scheduler.num_preemptions == 0
    kept = LLM(model=str(tiny_model_dirs["mistral"]), num_kv_blocks=64, **settings)
    assert tokens == kept.generate(PROMPTS[-1], params)[0].token_ids
    assert_idle(windowed)


@pytest.mark.parametrize("quantization", ["none", "int4"])  # torch's attention; the kernels' fused step
def test_sliding_layers_keep_their_window_and_global_layers_every_block(tiny_model_dirs, quantization):
    """Gemma 3's tiny config: a sliding layer (8 tokens) and a global one, each in a pool of its own. Decoding
    60 tokens after a long prompt, the global pool holds every block of the sequence and the sliding pool the
    blocks of its last 8 tokens and the one being written (3 of 4 tokens); the tokens are those of a cache with
    room for every block in both (which holds them all in the sliding pool too)."""
    settings = dict(block_size=4, max_num_batched_tokens=16, speculative="none", quantization=quantization)
    llm = LLM(model=str(tiny_model_dirs["gemma3"]), kv_cache_memory_bytes=1 << 20, max_num_seqs=1, **settings)
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    global_pool, sliding_pool = engine.kv_cache.pools
    assert [g.window for g in engine.kv_cache.groups] == [0, 8]
    assert sliding_pool.num_blocks == 1 * (2 + 2) + 16 // 4 < global_pool.num_blocks  # one sequence's reads
    engine.add_request("long", PROMPTS[-1], params)
    held, tokens = [], []
    for _ in range(200):  # bounded: a sequence that cannot be scheduled must fail the test, not hang it
        tokens += [t for d in engine.step() for t in d.token_ids]
        seq = engine.scheduler.running[0] if engine.scheduler.running else None
        if seq is not None:
            held.append([pool.num_blocks - pool.num_free_blocks for pool in (global_pool, sliding_pool)])
            assert held[-1][0] == -(-seq.num_computed_tokens // 4)  # every block of what it computed
        if not engine.has_unfinished():
            break
    assert len(tokens) == 60 and max(sliding for _, sliding in held[-40:]) <= 8 // 4 + 1
    everything = LLM(model=str(tiny_model_dirs["gemma3"]), num_kv_blocks=64, **settings)
    assert tokens == everything.generate(PROMPTS[-1], params)[0].token_ids
    assert_idle(llm)


def test_a_sliding_pool_smaller_than_the_global_one_bounds_the_context_window(tiny_model_dirs):
    """Gemma 3's pools in a small cache: the sliding one (5 blocks, under a window and a chunk) smaller than the
    global one (6). The window was clamped to the global pool's 24 tokens, so a prompt of 23 waited for a sixth
    sliding block for ever, first in the queue (Gemma 3 270M in 8 MiB: a 460-token prompt hung every request)."""
    settings = dict(block_size=4, max_num_batched_tokens=32, speculative="none", quantization="none", max_num_seqs=1)
    layer_block = LLM(
        model=str(tiny_model_dirs["gemma3"]), num_kv_blocks=1, **settings
    ).engine.runner._layer_block_bytes()
    llm = LLM(model=str(tiny_model_dirs["gemma3"]), kv_cache_memory_bytes=layer_block * 11, **settings)
    assert [pool.num_blocks for pool in llm.engine.kv_cache.pools] == [6, 5]
    assert llm.engine.max_model_len == 20
    engine = llm.engine
    engine.add_request(
        "whole", list(range(5, 5 + engine.max_model_len - 1)), SamplingParams(temperature=0, max_tokens=1)
    )
    for _ in range(20):  # bounded: a sequence that cannot be scheduled must fail the test, not hang it
        if not any(d.finish_reason for d in engine.step()) and engine.has_unfinished():
            continue
        break
    assert not engine.has_unfinished()
    assert_idle(llm)
