#!/usr/bin/env python
"""Offline engine benchmark, next to transformers `generate`, in the same run and dtype.

Reports what `vllm bench serve` reports (TTFT, TPOT, ITL p50/p99, output tok/s,
request/s) plus peak RSS. Each system runs in its own subprocess so peak RSS is
its own. Example:

    .venv/bin/python scripts/bench_engine.py --concurrency 1 4 16 32 64

Requests keep a fixed concurrency (closed loop): a new one starts when one
ends. Every request has a distinct prompt of about 36 tokens and generates
exactly --output-len tokens (ignore_eos).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from wsgi_infer.engine.config import QUANTIZATION_METHODS, EngineConfig

SUBJECTS = [
    "a lighthouse keeper",
    "a robot who learns to paint",
    "two rival bakers",
    "a lost dragon",
    "an old violinist",
    "a city under the sea",
    "a detective cat",
    "the last library on Mars",
]
TEMPLATE = (
    "Write a short story about {subject}. Begin with a vivid description of the place, "
    "introduce the main character, and end with a surprising twist. Story {n}:"
)


def prompts(n: int) -> list[str]:
    return [TEMPLATE.format(subject=SUBJECTS[i % len(SUBJECTS)], n=i) for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_engine(args) -> dict:
    from wsgi_infer import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization[0], speculative=args.speculative)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    results = {}
    for concurrency in args.concurrency:
        num_requests = max(args.min_requests, concurrency * args.rounds)
        todo = prompts(num_requests)
        prompt_tokens = [len(engine.tokenize(p)) for p in todo]
        start, first, last, gaps, counts = {}, {}, {}, [], {}
        next_id = 0
        t0 = time.perf_counter()
        while next_id < num_requests or engine.has_unfinished():
            while (
                next_id < num_requests and engine.counters().num_running + engine.counters().num_waiting < concurrency
            ):
                rid = str(next_id)
                engine.add_request(rid, todo[next_id], params)
                start[rid] = time.perf_counter()
                counts[rid] = 0
                next_id += 1
            deltas = engine.step()
            now = time.perf_counter()
            for d in deltas:
                if d.request_id in last:
                    gaps.append(now - last[d.request_id])
                else:
                    first[d.request_id] = now
                last[d.request_id] = now
                counts[d.request_id] += len(d.token_ids)
        wall = time.perf_counter() - t0
        ttft = [first[r] - start[r] for r in start]
        tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in start if counts[r] > 1]
        e2el = [last[r] - start[r] for r in start]
        total_out = sum(counts.values())
        results[concurrency] = {
            "requests": num_requests,
            "mean_prompt_tokens": statistics.mean(prompt_tokens),
            "output_tok_s": total_out / wall,
            "request_s": num_requests / wall,
            "ttft_mean_ms": 1e3 * statistics.mean(ttft),
            "ttft_p50_ms": 1e3 * percentile(ttft, 50),
            "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "tpot_mean_ms": 1e3 * statistics.mean(tpot),
            "tpot_p50_ms": 1e3 * percentile(tpot, 50),
            "tpot_p99_ms": 1e3 * percentile(tpot, 99),
            "itl_p50_ms": 1e3 * percentile(gaps, 50),
            "itl_p99_ms": 1e3 * percentile(gaps, 99),
            "e2el_mean_ms": 1e3 * statistics.mean(e2el),
        }
        print(f"# wsgi-infer c={concurrency}: {results[concurrency]['output_tok_s']:.1f} tok/s", file=sys.stderr)
    return {
        "system": "wsgi-infer",
        "dtype": str(engine.dtype),
        "speculative": engine.config.speculative,
        "results": results,
        "peak_rss_mb": peak_rss_mb(),
    }


def run_transformers(args) -> dict:
    import torch

    from wsgi_infer.engine.loading.model_loader import load_tokenizer, resolve_model_dir
    from wsgi_infer.engine.runtime.device import resolve_dtype

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.support.transformers_reference import load_hf_model  # a GGUF's copy holds no weights of its own

    model_dir = resolve_model_dir(args.model)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    model = load_hf_model(model_dir, dtype)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    results = {}

    def generate(batch: list[str]) -> float:
        enc = tokenizer(batch, return_tensors="pt", padding=True)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
        assert out.shape[1] - enc["input_ids"].shape[1] == args.output_len
        return time.perf_counter() - t

    singles = prompts(args.hf_single_requests)
    wall = sum(generate([p]) for p in singles)
    results["1 (one at a time)"] = {"output_tok_s": len(singles) * args.output_len / wall}
    batch = prompts(16)
    results["16 (padded batch)"] = {"output_tok_s": 16 * args.output_len / generate(batch)}
    return {"system": "transformers", "dtype": str(dtype), "results": results, "peak_rss_mb": peak_rss_mb()}


def run_profile(args) -> dict:
    """Where the time of one decode step goes, at batch sizes 1 and 64."""
    from torch.profiler import ProfilerActivity, profile

    from wsgi_infer import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization[0], speculative=args.speculative)
    engine = llm.engine
    tables = {}
    for batch in (1, 64):
        for i, prompt in enumerate(prompts(batch)):
            engine.add_request(f"p{batch}-{i}", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        for _ in range(8):  # past prefill, into steady decode
            engine.step()
        t = time.perf_counter()
        for _ in range(10):
            engine.step()
        step_ms = (time.perf_counter() - t) / 10 * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)
        tables[batch] = {"step_ms": step_ms, "table": table}
        while engine.has_unfinished():
            engine.step()
    return {"system": "profile", "profiles": tables}


def child(kind: str, args, quant: str = "none", speculative: str | None = None) -> dict:
    """One run of `kind` in a process of its own (its peak RSS its own): the JSON it prints last. ``speculative``:
    the engine's, where not ``args.speculative``."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--dtype",
        args.dtype,
        "--quantization",
        quant,
        "--output-len",
        str(args.output_len),
        "--rounds",
        str(args.rounds),
        "--min-requests",
        str(args.min_requests),
        "--speculative",
        speculative or args.speculative,
        "--concurrency",
        *map(str, args.concurrency),
    ]
    if kind == "transformers":  # the only kind that reads it (bench_serve.py's args have none)
        cmd += ["--hf-single-requests", str(args.hf_single_requests)]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests per concurrency slot")
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--hf-single-requests", type=int, default=2)
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=["none", "auto"],
        choices=QUANTIZATION_METHODS,
        help="engine runs to compare (auto: the GGUF's own 4-bit blocks for small batches, in bf16 on a CPU)",
    )
    parser.add_argument("--speculative", choices=["ngram", "none"], default=EngineConfig().speculative)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also profile one decode step at batch 1 and 64")
    parser.add_argument("--child", choices=["engine", "transformers", "profile"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.child:
        runner = {"engine": run_engine, "transformers": run_transformers, "profile": run_profile}[args.child]
        print(json.dumps(runner(args)))
        return

    for quant in args.quantization:
        engine = child("engine", args, quant)
        print(
            f"## wsgi-infer engine ({engine['dtype']}, quantization {quant}, speculation {engine['speculative']}), "
            f"{args.output_len} output tokens, "
            f"peak RSS {engine['peak_rss_mb']:.0f} MB\n"
        )
        print(
            "| concurrency | requests | prompt tok | out tok/s | req/s | TTFT mean / p99 ms | TPOT mean / p99 ms "
            "| ITL p50 / p99 ms |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for c, r in engine["results"].items():
            print(
                f"| {c} | {r['requests']} | {r['mean_prompt_tokens']:.0f} | {r['output_tok_s']:.1f} "
                f"| {r['request_s']:.2f} | {r['ttft_mean_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
                f"| {r['tpot_mean_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
                f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} |"
            )
        print()
    if not args.skip_transformers:
        hf = child("transformers", args)
        print(f"## transformers generate ({hf['dtype']}), peak RSS {hf['peak_rss_mb']:.0f} MB\n")
        print("| requests | out tok/s |\n|---|---|")
        for c, r in hf["results"].items():
            print(f"| {c} | {r['output_tok_s']:.1f} |")
    if args.profile:
        prof = child("profile", args, args.quantization[-1])
        for batch, p in prof["profiles"].items():
            print(f"\n## one decode step at batch {batch}: {p['step_ms']:.1f} ms\n\n```\n{p['table']}\n```")


if __name__ == "__main__":
    main()
