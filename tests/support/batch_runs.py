"""Greedy requests run alone and staggered into a running batch: what batching must not change."""

from __future__ import annotations

from wsgi_infer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "Hi",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A" * 3 + " short one",
    "The list of the fifty states of America, in alphabetical order, starts with Alabama, Alaska, Arizona,",
]


def run_alone(llm: LLM, prompt: str) -> list[int]:
    return llm.generate(prompt, GREEDY)[0].token_ids


def run_staggered(llm: LLM, prompts: list[str]) -> dict[str, list[int]]:
    """Add one request every other step while the others run; return each request's tokens."""
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, GREEDY)
            tokens[f"r{i}"] = []
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
        step += 1
    return tokens
