"""The KV store under the prefix cache, in one process: what one engine writes, the next one (a restart) reads
instead of computing, with the same greedy tokens, and nothing of another model or setting is ever taken."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.kv_store import prefix_store
from wsgi_infer.engine.kv_store.directory import SUFFIX, DirectoryStore
from wsgi_infer.engine.scheduling.kv_cache_manager import chain_hash

from ..conftest import assert_idle
from ..support.server import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHARED = "In the old town by the river, the bakers rose before dawn to light their ovens, and " * 6
PROMPTS = [SHARED + "the first customer asked for", SHARED + "nobody could remember why", "A short one"]


def _engine(model: Path | None, store: Path, **settings) -> LLM:
    """The tiny model's exact float32 path (or, with no model, the shipped one on the kernels)."""
    exact = {"dtype": "float32", "quantization": "none", "block_size": 4} if model is not None else {}
    settings = {**exact, **settings}
    return LLM(model=str(model) if model else None, kv_store_dir=str(store), speculative="none", **settings)


def _run(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _restart(model: Path | None, store: Path, **settings) -> tuple[list[list[int]], LLM]:
    """A cold engine's tokens (its blocks written to the store, all of them: it waits at close), and a second
    engine on the same store."""
    cold = _engine(model, store, **settings)
    tokens = _run(cold, PROMPTS)
    cold.engine.close(wait=True)
    assert cold.engine.counters().store["bytes_written"] > 0
    return tokens, _engine(model, store, **settings)


@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_a_restart_reads_the_prefix_from_the_store_with_the_same_tokens(tiny_model_dirs, tmp_path, path):
    model = tiny_model_dirs["llama"] if path == "torch" else None
    cold_tokens, warm = _restart(model, tmp_path)
    assert warm.engine.runner.kernels is None if path == "torch" else warm.engine.runner.kernels is not None
    prompt_ids = warm.engine.tokenize(PROMPTS[0])
    assert _run(warm, PROMPTS[:1]) == cold_tokens[:1]  # alone
    counters = warm.engine.counters()
    bs = warm.engine.kv_cache.block_size
    assert counters.num_store_hit_tokens == (len(prompt_ids) - 1) // bs * bs  # every full block but the last token's
    assert counters.num_prefix_hit_tokens == 0 and counters.store["corrupt_blocks"] == 0
    assert counters.store[
        "bytes_read"
    ] == counters.num_store_hit_tokens // bs * warm.engine.store.blocks.payload_nbytes + (
        counters.num_store_hit_tokens // bs * 80  # each block's frame
    )
    assert _run(warm, PROMPTS) == cold_tokens  # a batch: one from memory now, one from the store, one from neither
    warm.engine.close()
    assert_idle(warm)


def test_sliding_layers_take_their_window_from_the_store(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["gemma3"]  # a sliding layer of 8 tokens, then a global one
    cold_tokens, warm = _restart(model, tmp_path)
    assert _run(warm, PROMPTS) == cold_tokens
    assert warm.engine.counters().num_store_hit_tokens > 8
    warm.engine.close()
    assert_idle(warm)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), SamplingParams(max_tokens=0, pooling="mean")],
    ids=["prompt_logprobs", "mean pooling"],
)
def test_a_request_that_computes_every_position_reads_no_block_and_writes_its_own(tiny_model_dirs, tmp_path, params):
    """Prompt logprobs and mean pooling need every prompt position computed: on a store holding the whole prompt,
    such a request reads nothing and gives what a cold engine gave; on an empty one, it writes its blocks like any
    other request."""
    model = tiny_model_dirs["llama"]
    cold = _engine(model, tmp_path)
    first = _computed(cold, PROMPTS[0], params)
    cold.engine.close(wait=True)
    assert cold.engine.counters().store["bytes_written"] > 0
    warm = _engine(model, tmp_path)
    again = _computed(warm, PROMPTS[0], params)
    counters = warm.engine.counters()
    assert counters.store["bytes_read"] == 0 and counters.num_store_hit_tokens == 0
    assert again == first and any(again)
    warm.engine.close(wait=True)


def test_a_writer_too_far_behind_drops_blocks_and_counts_them(tiny_model_dirs, tmp_path, monkeypatch):
    """Blocks wait for the writer up to MAX_PENDING_BYTES (256 MiB); past that, they are dropped and counted, not
    queued without bound. Here the bound is one block and the writer is held: the prompt's first full block waits,
    every other one is dropped; let go, the writer writes the one."""
    monkeypatch.setattr(prefix_store, "MAX_PENDING_BYTES", 0)
    held, put = threading.Event(), DirectoryStore.put
    monkeypatch.setattr(DirectoryStore, "put", lambda *args: held.wait(60) and put(*args))
    llm = _engine(tiny_model_dirs["llama"], tmp_path)
    _run(llm, PROMPTS[:1])
    full_blocks = len(_prompt_block_keys(llm, PROMPTS[0]))
    assert full_blocks > 8 and llm.engine.counters().store["dropped_blocks"] == full_blocks - 1
    held.set()
    llm.engine.close(wait=True)
    (namespace,) = tmp_path.iterdir()
    assert [p.name for p in namespace.iterdir()] == [f"{_prompt_block_keys(llm, PROMPTS[0])[0].hex()}{SUFFIX}"]


def _computed(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list, list[float] | None]:
    """A request's prompt logprobs and its embedding, from the engine's deltas."""
    llm.engine.add_request("r", llm.engine.tokenize(prompt), params)
    logprobs, embedding = [], None
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            logprobs += [(p.token_id, p.logprob) for p in delta.prompt_logprobs or []]
            embedding = delta.embedding if delta.embedding is not None else embedding
    return logprobs, embedding


def _prompt_block_keys(llm: LLM, prompt: str) -> list[bytes]:
    """The names of a prompt's full blocks in the store, first to last: each its prefix's hash chain (as the files'
    modification times would give them, but never tied)."""
    ids, size, keys = llm.engine.tokenize(prompt), llm.engine.kv_cache.block_size, []
    for start in range(0, len(ids) - size + 1, size):
        keys.append(chain_hash(keys[-1] if keys else b"", ids[start : start + size]))
    return keys


def test_a_full_store_removes_a_prompts_blocks_from_its_last_and_keeps_a_prefix_in_use(tiny_model_dirs, tmp_path):
    """A hit reads a prompt's blocks from its first on, but a full store removed them by age, the first first: what
    it kept could never be read (the KV store probe: no prompt hit after a restart); and a prefix served from memory
    was no use of the store's copy, which went first."""
    llm = _engine(tiny_model_dirs["llama"], tmp_path)
    stories = [f"Story {n}: the mountain road wound past farms and mills toward the pass, " * 6 for n in (1, 2)]
    first, story = _prompt_block_keys(llm, PROMPTS[0]), _prompt_block_keys(llm, stories[0])
    block_bytes = llm.engine.store.blocks.payload_nbytes + 80  # and its frame
    llm.engine.store.store.limit_bytes = (len(first) + len(story) - 1) * block_bytes  # full with the story
    for prompt in (PROMPTS[0], stories[0], PROMPTS[0], stories[1]):  # the third is read from memory alone
        _run(llm, [prompt])
    llm.engine.close(wait=True)
    (namespace,) = tmp_path.iterdir()
    kept = {bytes.fromhex(p.stem) for p in namespace.iterdir()}
    readable = next((i for i, key in enumerate(first) if key not in kept), len(first))
    assert readable > len(first) // 2 and not kept & set(first[readable:])  # kept from its first block on
    assert not kept & set(story)  # used before the shared part, read again from memory, was: removed first


def test_a_store_smaller_than_one_prompt_keeps_its_first_blocks(tiny_model_dirs, tmp_path):
    """Full while a prompt's blocks were written, the store removed them by their writing, the first first, before
    they were marked used: it kept the last two, which no hit can read (the KV store probe: a hit of 0 after a
    restart, and every request writing and evicting all its blocks)."""
    llm = _engine(tiny_model_dirs["llama"], tmp_path)
    first = _prompt_block_keys(llm, PROMPTS[0])
    llm.engine.store.store.limit_bytes = 3 * (llm.engine.store.blocks.payload_nbytes + 80)  # and its frame
    _run(llm, [PROMPTS[0]])
    llm.engine.close(wait=True)
    (namespace,) = tmp_path.iterdir()
    kept = {bytes.fromhex(p.stem) for p in namespace.iterdir()}
    assert len(first) > 10 and set(first[:2]) <= kept, sorted(first.index(k) for k in kept)  # 7/8 of 3 blocks


def test_another_model_or_setting_never_takes_a_block(tiny_model_dirs, tmp_path):
    _restart(tiny_model_dirs["llama"], tmp_path)[1].engine.close()
    others = [
        _engine(tiny_model_dirs["qwen2"], tmp_path),  # another model, the same tokenizer: the same hash chains
        _engine(tiny_model_dirs["llama"], tmp_path, quantization="int8"),  # the same model packed: other values
        _engine(tiny_model_dirs["llama"], tmp_path, dtype="bfloat16"),
    ]
    for other in others:
        _run(other, PROMPTS[:1])
        counters = other.engine.counters()
        assert counters.num_store_hit_tokens == 0 and counters.store["bytes_read"] == 0
        other.engine.close()
    assert len(set(os.listdir(tmp_path))) == 4  # a namespace each


def test_corrupt_and_truncated_blocks_are_misses_removed_and_counted(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    cold_tokens, warm = _restart(model, tmp_path)
    (namespace,) = tmp_path.iterdir()
    blocks = [namespace / f"{key.hex()}{SUFFIX}" for key in _prompt_block_keys(warm, PROMPTS[0])]  # in prompt order
    flipped, truncated = blocks[3], blocks[6]
    original = flipped.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x40
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    assert _run(warm, PROMPTS[:1]) == cold_tokens[:1]
    counters = warm.engine.counters()
    assert counters.num_store_hit_tokens == 3 * 4  # up to the flipped block, whose read is a miss
    assert counters.store["corrupt_blocks"] == 1
    warm.engine.close(wait=True)  # it removed the flipped block, computed it again and wrote it whole
    assert flipped.read_bytes() == original  # (the truncated one was there: not written)
    again = _engine(model, tmp_path)
    assert _run(again, PROMPTS[:1]) == cold_tokens[:1]
    counters = again.engine.counters()
    assert counters.store["corrupt_blocks"] == 1 and counters.num_store_hit_tokens == 6 * 4
    again.engine.close(wait=True)
    assert truncated.stat().st_size == blocks[0].stat().st_size  # removed, computed, written whole


def test_a_directory_and_a_redis_together_are_refused():
    from wsgi_infer.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_store_dir and kv_store_url"):
        EngineConfig(model=None, kv_store_dir="/tmp/kv", kv_store_url="redis://127.0.0.1:6379/0")


def test_the_offline_api_hands_its_last_steps_blocks_to_the_store(tiny_model_dirs, tmp_path):
    """Noted blocks were written at the next step's start: a prompt read in the last step (one token asked for, or a
    long prompt's last chunk) was never written by ``LLM.generate``, which has no next step."""
    llm = _engine(tiny_model_dirs["llama"], tmp_path)
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))
    store = llm.engine.store
    wait_until(lambda: store._written_bytes == store._queued_bytes, "the writer has written what it was handed")
    (namespace,) = tmp_path.iterdir()
    assert len(list(namespace.glob(f"*{SUFFIX}"))) == len(_prompt_block_keys(llm, PROMPTS[0])) > 10
    llm.engine.close()
