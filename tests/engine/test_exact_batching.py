"""A request's result is the same bits alone and in any batch, on the shipped model, in both activation modes: the
CPU kernels run one arithmetic for every number of rows. Steps here hold far more than 64 rows, where packed
multiplies once crossed over to oneDNN's bf16 GEMM on CPUs with native bf16 (then six prompts batched matched each
alone on 1 of 3, and an embedding moved by 0.0025 between a batch of one and one of seven)."""

from __future__ import annotations

import pytest

from wsgi_infer import LLM, SamplingParams

from ..conftest import assert_idle

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in three sentences.",
    "List five prime numbers and say why each is prime.",
    "How do vaccines train the immune system?",
    "Translate 'good morning, my friend' into Spanish and German.",
    "What is the difference between weather and climate?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
EMBED = SamplingParams(max_tokens=0, pooling="mean")


def _run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]], one_a_step: bool = False) -> dict[str, tuple]:
    """Every request added at once (or one before each step, joining the others' prefills and decodes); each one's
    tokens, their logprobs (every alternative's) and its embedding."""
    engine, pending = llm.engine, list(requests.items())
    tokens, logprobs, embedding = {r: [] for r in requests}, {r: [] for r in requests}, {}
    while pending or engine.has_unfinished():
        for request_id, (prompt, params) in pending[:1] if one_a_step else pending:
            engine.add_request(request_id, prompt, params)
        pending = pending[1:] if one_a_step else []
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
            logprobs[delta.request_id] += [(p.token_id, p.logprob, p.top) for p in delta.logprobs or []]
            if delta.embedding is not None:
                embedding[delta.request_id] = delta.embedding
    return {r: (tokens[r], logprobs[r], embedding.get(r)) for r in requests}


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_a_request_is_the_same_bits_alone_and_in_a_batch_of_the_shipped_model(activations):
    llm = LLM(device="cpu", dtype="float32", activations=activations)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert sum(len(p) for p in prompts) > 4 * 64  # a prefill step of many more rows than 64
    generate = {f"g{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    embed = {f"e{i}": (p, EMBED) for i, p in enumerate(prompts)}
    batched = _run(llm, generate | embed)
    for request_id, request in (generate | embed).items():
        assert _run(llm, {request_id: request})[request_id] == batched[request_id], request_id
    interleaved = dict(reversed([*generate.items(), *embed.items()]))  # another order, each joining a running batch
    assert _run(llm, interleaved, one_a_step=True) == batched
    assert all(len(batched[r][0]) == GREEDY.max_tokens and len(batched[r][1]) == GREEDY.max_tokens for r in generate)
    assert all(len(batched[r][2]) == llm.engine.hf_config.hidden_size for r in embed)
    assert_idle(llm)
