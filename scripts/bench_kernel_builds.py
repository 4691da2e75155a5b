#!/usr/bin/env python
"""Two builds of the CPU kernels side by side: the engine alone, the same Python code, alternating.

For each library (``cpu_kernels-*.so``, say one built from an earlier commit and the installed one), one process
holds an engine with speculation and one without on the same model file, neither with a prefix cache (every
request pays its prefill, as a new prompt would), and the runs alternate between the libraries so that the
machine's drift hits both: the repeating workload (``repeat_prompts.py``, 256 tokens) and ``bench_engine.py``'s
standard prompts (128 tokens) at one stream, greedy, EOS ignored, and a long prompt's prefill (about 2,300
tokens) and the 128 tokens decoded after it. Example, against the kernels of an earlier commit built in a worktree:

    git worktree add /tmp/before HEAD~3 && (cd /tmp/before && python -c \\
        "from wsgi_infer.engine.kernels import variants, build; variants.build_variants(build.installed_dir())")
    .venv/bin/python scripts/bench_kernel_builds.py /tmp/before/wsgi_infer/engine/kernels/lib/cpu_kernels-avx2.so \\
        wsgi_infer/engine/kernels/lib/cpu_kernels-avx2.so --model smol-q4_1.gguf

``--prefill-only`` times only 2,048-token prompts' prefills (``long_prompts.py``, each new), one or more libraries
alternating, ``--repeat`` rounds of ``--prompts`` each: the figure issue 62's prefill asks for, without the server.
``--streams N`` times only N of ``bench_engine.py``'s prompts decoded together (greedy, EOS ignored): their prefills
and first step, and the 64 steps after, in steps a second and, for a GGUF, the matrices' multiply-adds a second;
each library on each of one or more ``--model`` files, all alternating.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

from bench_engine import prompts as standard_prompts
from long_prompts import long_prompts
from repeat_prompts import SENTENCES, repeat_prompts

import wsgi_infer.engine.kernels.cpu as cpu
from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.runtime.cpu_info import cpu_model_name


def engines(library: str, model: str | None, kinds: tuple[str, ...] = ("ngram", "none")) -> dict[str, LLM]:
    cpu.kernels_library = lambda: Path(library)  # what every engine made now loads
    # no prefix cache: every round's requests pay their prefill, as new prompts would, with speculation or without
    return {kind: LLM(model=model, speculative=kind, enable_prefix_caching=False) for kind in kinds}


def tokens_and_seconds(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = sum(len(llm.generate([prompt], params)[0].token_ids) for prompt in prompts)
    return tokens, time.perf_counter() - start


def decode_rate(llm: LLM, prompt: str, tokens: int = 128) -> float:
    """tok/s of the ``tokens`` decoded after ``prompt``'s first token, timed from that token's step."""
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        if engine.step() and first is None:
            first = time.perf_counter()
    return tokens / (time.perf_counter() - first)


def prefills(libraries: list[str], model: str | None, rounds: int, prompts: int) -> None:
    """Each library's 2,048-token prefills, the libraries alternating a round at a time, in prompt tok/s."""
    built = {library: engines(library, model, ("none",))["none"] for library in libraries}
    rates: dict[str, list[float]] = {library: [] for library in libraries}
    once = SamplingParams(temperature=0, max_tokens=1)
    for _ in range(rounds):
        for library, llm in built.items():
            for prompt in long_prompts(prompts):
                start = time.perf_counter()
                output = llm.generate([prompt], once)[0]
                rates[library].append(len(output.prompt_token_ids) / (time.perf_counter() - start))
    print(f"# {cpu_model_name()}, engine alone, 2,048-token prefills, {rounds} alternating rounds of {prompts}")
    for library, values in rates.items():
        each = ", ".join(f"{v:.1f}" for v in values)
        print(f"# {library}: median {statistics.median(values):.1f} prompt tok/s ({each})")


def multiply_adds_per_token(model: str | None) -> float | None:
    """A token's multiply-adds in the weights' matrices (attention's own left out), from a GGUF's tensors: every
    matrix once, the embedding as the LM head where the file has no head of its own (tied)."""
    if not (model and model.endswith(".gguf")):
        return None
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(model).tensors if len(t.shape) == 2}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return float(sum(int(t.n_elements) for t in tensors.values()))


def streams(libraries: list[str], models: list[str | None], rounds: int, count: int) -> None:
    """``count`` standard prompts decoded together, each library on each model, alternating a round at a time: the
    prefills and their first step, then 64 steps more, in steps a second (and multiply-adds a second where the file
    says)."""
    built = {(library, model): engines(library, model, ("none",))["none"] for library in libraries for model in models}
    prompts = standard_prompts(count)

    def seconds(llm: LLM, tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start

    for llm in built.values():
        seconds(llm, 4)  # warm
    first: dict[tuple, list[float]] = {key: [] for key in built}
    rates: dict[tuple, list[float]] = {key: [] for key in built}
    for _ in range(rounds):
        for key, llm in built.items():
            first[key].append(seconds(llm, 1))
            rates[key].append(64 / (seconds(llm, 65) - first[key][-1]))
    work = {model: multiply_adds_per_token(model) for model in models}  # each file read once
    print(f"# {cpu_model_name()}, engine alone, {count} streams decoded together, {rounds} alternating rounds")
    for (library, model), values in rates.items():
        median = statistics.median(values)
        done = f", {count * work[model] * median / 1e9:.0f} G MAC/s" if work[model] else ""
        each = ", ".join(f"{rate:.2f}" for rate in values)
        prefill = ", ".join(f"{s:.2f}" for s in first[library, model])
        print(f"# {library}, {model or 'the shipped model'}: median {median:.2f} steps/s{done} ({each});")
        print(f"#   prefills and a step {prefill} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="+", help="kernel libraries (.so): two, or any number with a mode below")
    parser.add_argument("--model", nargs="+", default=[None], help="default: the shipped model (several: --streams)")
    parser.add_argument("--repeat", type=int, default=2, help="alternating rounds")
    parser.add_argument("--prefill-only", action="store_true", help="only 2,048-token prompts' prefills")
    parser.add_argument("--prompts", type=int, default=2, help="--prefill-only's prompts a round")
    parser.add_argument("--streams", type=int, default=0, help="only this many prompts decoded together")
    args = parser.parse_args()
    if args.streams:
        return streams(args.libraries, args.model, args.repeat, args.streams)
    if len(args.model) != 1:
        parser.error("one --model, or --streams")
    args.model = args.model[0]
    if args.prefill_only:
        return prefills(args.libraries, args.model, args.repeat, args.prompts)
    if len(args.libraries) != 2:
        parser.error("two libraries, --prefill-only or --streams")
    built = {library: engines(library, args.model) for library in args.libraries}
    workloads = {
        "repeat": (repeat_prompts(8), SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)),
        "standard": (standard_prompts(4), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)),
    }
    totals: dict[tuple, list] = {}
    prefill: dict[str, list[float]] = {library: [] for library in built}
    decode: dict[str, list[float]] = {library: [] for library in built}
    long_prompt = " ".join(SENTENCES * 6)
    for round_ in range(args.repeat):
        for workload, (prompts, params) in workloads.items():
            for prompt, speculative in itertools.product(prompts, ("ngram", "none")):
                for library, llms in built.items():  # request by request: the machine drifts within a minute
                    tokens, seconds = tokens_and_seconds(llms[speculative], [prompt], params)
                    total = totals.setdefault((library, workload, speculative), [0, 0.0])
                    total[0], total[1] = total[0] + tokens, total[1] + seconds
        for library, llms in built.items():
            once = SamplingParams(temperature=0, max_tokens=1)
            prefill[library].append(tokens_and_seconds(llms["none"], [f"{round_} {long_prompt}"], once)[1])
            decode[library].append(decode_rate(llms["none"], f"{round_} {long_prompt}"))
    print(f"# {cpu_model_name()}, engine alone, one stream, {args.repeat} alternating rounds")
    print("| library | workload | speculation | tok/s |\n|---|---|---|---|")
    for (library, workload, speculative), (tokens, seconds) in sorted(totals.items()):
        print(f"| {library} | {workload} | {speculative} | {tokens / seconds:.1f} |")
    length = len(next(iter(built.values()))["none"].engine.tokenizer(long_prompt)["input_ids"])
    for library, seconds in prefill.items():
        print(f"# {library}: a {length}-token prompt's prefill " + ", ".join(f"{s:.2f} s" for s in seconds))
        print(f"# {library}: decoding after it " + ", ".join(f"{rate:.1f} tok/s" for rate in decode[library]))


if __name__ == "__main__":
    main()
