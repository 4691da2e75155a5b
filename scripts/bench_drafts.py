#!/usr/bin/env python
"""Prompt-lookup speculation beside none, one stream in-process: a chat workload with EOS kept (questions through the
model's chat template, greedy, up to --output-len tokens) and the repeating one (a passage repeated with
corrections, EOS ignored), each setting alternating with the others, and what the drafts did (verified draft
tokens, accepted ones). Greedy outputs are the same with and without speculation; only the time differs.

    .venv/bin/python scripts/bench_drafts.py --workload chat repeat --rounds 3
    .venv/bin/python scripts/bench_drafts.py --model gemma3.gguf --workload chat --ours k7=num_speculative_tokens=7
"""

from __future__ import annotations

import argparse
import time

from repeat_prompts import repeat_prompts

from wsgi_infer import LLM, SamplingParams

QUESTIONS = [
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for a job interview.",
    "Why is the sky blue?",
    "Write a short poem about autumn.",
    "How do I make a cup of green tea?",
    "Explain what a hash table is.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a bakery and explain why.",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion to a ten-year-old.",
]


def workload(llm: LLM, name: str, output_len: int) -> tuple[list[list[int]], SamplingParams]:
    if name == "chat":
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        return prompts, SamplingParams(temperature=0, max_tokens=output_len)
    return [llm.engine.tokenize(p) for p in repeat_prompts(8)], SamplingParams(
        temperature=0, max_tokens=output_len, ignore_eos=True
    )


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> str:
    """One request at a time; tok/s over the requests' own time, and the drafts' counters."""
    spec = llm.engine.spec
    before = (spec.draft_tokens, spec.accepted_tokens)
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        start = time.perf_counter()
        tokens += len(llm.generate(prompt, params)[0].token_ids)
        seconds += time.perf_counter() - start
    drafted, accepted = spec.draft_tokens - before[0], spec.accepted_tokens - before[1]
    return f"{tokens / seconds:7.1f} tok/s ({tokens} tokens; {drafted} draft tokens verified, {accepted} accepted)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--workload", nargs="+", choices=("chat", "repeat"), default=["chat", "repeat"])
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ours", action="append", default=[], help="NAME=OPTION=VALUE: speculation with an option")
    args = parser.parse_args()
    settings = {"off": {"speculative": "none"}, "on": {}}
    for item in args.ours:
        name, option, value = item.split("=", 2)
        settings[name] = {option: int(value) if value.isdigit() else value}
    engines = {name: LLM(model=args.model, **options) for name, options in settings.items()}
    for llm in engines.values():  # the first request's one-time costs
        llm.generate("Hello", SamplingParams(max_tokens=8))
    for name in args.workload:
        for round_ in range(args.rounds):
            for setting, llm in engines.items():
                prompts, params = workload(llm, name, args.output_len)
                print(f"{name}, round {round_ + 1}, {setting:>4}: {run(llm, prompts, params)}", flush=True)


if __name__ == "__main__":
    main()
