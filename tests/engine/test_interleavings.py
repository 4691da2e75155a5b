"""Random interleavings of adds, aborts and steps on an engine with too little KV cache for them (so chunked
prefill, the prefix cache, preemption and speculation all run, in whatever order the draw puts them): every request
that ends on its own generates what it generates alone (greedy, or sampled with its seed), and the engine ends
idle with every block free."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from wsgi_infer import LLM, SamplingParams

from ..conftest import assert_idle, fuzz_examples, fuzzing
from ..support.batch_runs import PROMPTS

pytestmark = pytest.mark.slow  # 10 s of examples

EXAMPLES = fuzz_examples(60)
# The texts, and token prompts sharing a 13-token prefix (three blocks and a part) in three ways.
SHARED = list(range(40, 53))
POOL = [*PROMPTS, SHARED, [*SHARED, 7, 8, 9, 10], [*SHARED[:8], 99]]

add = st.tuples(
    st.just("add"),
    st.integers(0, len(POOL) - 1),
    st.integers(1, 40),  # max_tokens: 5 requests of 40 want twice the cache
    st.none() | st.integers(0, 3),  # greedy, or sampled with this seed
)
operations = st.lists(
    st.one_of(add, add, st.tuples(st.just("abort"), st.integers(0, 20)), st.tuples(st.just("step"), st.integers(1, 6))),
    max_size=40,
)


def params(max_tokens: int, seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def cramped(tiny_model_dirs) -> LLM:
    """96 tokens of KV cache in blocks of 4, 16 tokens a step: a few requests already preempt each other."""
    return LLM(
        model=str(tiny_model_dirs["llama"]),
        dtype="float32",
        quantization="none",
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=16,
    )


def test_any_interleaving_gives_each_finished_request_its_tokens_alone_and_ends_idle(cramped):
    engine, alone, drafts = cramped.engine, {}, [0]  # drafts verified in the interleavings' steps (not the references')

    def reference(key: tuple[int, int, int | None]) -> list[int]:
        if key not in alone:
            alone[key] = cramped.generate(POOL[key[0]], params(*key[1:]))[0].token_ids
        return alone[key]

    @fuzzing(EXAMPLES)
    @given(ops=operations)
    # one that preempts for certain (five requests want 3 times the cache) and shares a prefix, beside the draws
    @example(ops=[("add", 4, 40, None), ("add", 5, 40, 1), ("step", 3), ("add", 6, 40, None), *[("add", 1, 40, 2)] * 2])
    def interleaving(ops: list[tuple]) -> None:
        keys, tokens, aborted, finished = {}, {}, set(), set()

        def step() -> None:
            before = engine.counters().num_spec_drafts
            for delta in engine.step():
                tokens[delta.request_id] += delta.token_ids
                if delta.finish_reason:
                    finished.add(delta.request_id)
            drafts[0] += engine.counters().num_spec_drafts - before

        for op in ops:
            if op[0] == "add":
                request_id = f"i{len(keys)}"
                keys[request_id] = op[1:]
                tokens[request_id] = []
                engine.add_request(request_id, POOL[op[1]], params(*op[2:]))
            elif op[0] == "abort" and keys:
                request_id = f"i{op[1] % len(keys)}"
                if engine.abort(request_id):
                    aborted.add(request_id)
            elif op[0] == "step":
                for _ in range(op[1]):
                    step()
        for _ in range(2_000):  # bounded: a request that can never be scheduled fails the test, not hangs it
            if not engine.has_unfinished():
                break
            step()
        assert_idle(cramped)
        assert finished | aborted == set(keys) and not finished & aborted
        for request_id in finished:
            assert tokens[request_id] == reference(keys[request_id]), (request_id, keys[request_id], ops)

    interleaving()
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache.num_prefix_hit_blocks > 0  # both were run
    assert drafts[0] > 0  # and speculation
