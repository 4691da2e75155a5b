#!/usr/bin/env python
"""What a JSON schema on every request costs, and whether compiling one stalls running streams.

1. Output tok/s at each concurrency, with and without a JSON schema on every
   request, alternating on one server. The schema is an object holding one
   long string (``minLength`` far beyond the output length), so every request
   runs its full ``--output-len`` tokens constrained and the two sides
   generate the same number of tokens.
2. ITL of running streams while a large new schema (hundreds of properties,
   never seen before, so not cached) compiles: the gaps around the compile
   against the gaps before it.
3. The engine alone, in this process (``--engine``): 16 requests of the
   same length with and without the schema, alternating, and the time the
   grammar masks take per step. Far less noisy than HTTP runs on a shared host.

    .venv/bin/python scripts/bench_structured.py --concurrency 1 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import one_request, run_level  # noqa: E402
from serve_processes import start_server  # noqa: E402

LONG_STRING = {
    "type": "json_schema",
    "json_schema": {
        "name": "essay",
        "schema": {
            "type": "object",
            "properties": {"essay": {"type": "string", "minLength": 20000}},
            "required": ["essay"],
        },
    },
}


def large_schema(num_fields: int) -> dict:
    field = {
        "type": "object",
        "properties": {
            "kind": {"enum": [f"k{j}" for j in range(20)]},
            "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000}},
            "note": {"type": "string", "maxLength": 40},
        },
        "required": ["kind", "values"],
    }
    tag = uuid.uuid4().hex  # never cached
    schema = {"type": "object", "properties": {f"{tag}_{i}": field for i in range(num_fields)}}
    return {
        "type": "json_schema",
        "json_schema": {"name": "large", "schema": {**schema, "required": list(schema["properties"])}},
    }


def throughput(args, url: str, model: str) -> dict[tuple[int, bool], list[float]]:
    runs: dict[tuple[int, bool], list[float]] = {}
    for _ in range(args.repeat):
        for c in args.concurrency:
            for constrained in (False, True):
                extra = {"response_format": LONG_STRING} if constrained else None
                n = max(args.min_requests, c * args.rounds)
                r = asyncio.run(run_level(url, model, c, n, args.output_len, None, extra))
                runs.setdefault((c, constrained), []).append(r["output_tok_s"])
                print(f"# c={c} schema={constrained}: {r['output_tok_s']:.1f} tok/s", file=sys.stderr)
    return runs


async def compile_stall(url: str, model: str, streams: int, num_fields: int) -> dict:
    """Gaps of running streams before, and while, one request with a new large schema is admitted."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        running = [asyncio.create_task(one_request(client, model, f"Story {i}:", 160)) for i in range(streams)]
        await asyncio.sleep(4)  # streams are decoding
        sent = time.perf_counter()
        body = {"model": model, "prompt": "JSON:", "max_tokens": 1, "response_format": large_schema(num_fields)}
        answer = await client.post("/v1/completions", json=body)
        admitted = time.perf_counter()
        results = await asyncio.gather(*running)
    answer.raise_for_status()
    gaps_before, gaps_during = [], []
    for r in results:
        times = [r["end"] - r["e2el"] + r["ttft"]]
        for gap in r["itl"]:
            times.append(times[-1] + gap)
        for a, b in zip(times, times[1:]):
            if b <= sent:
                gaps_before.append(b - a)
            elif a <= admitted:
                gaps_during.append(b - a)
    return {
        "compile_request_s": admitted - sent,
        "itl_before_p50_ms": 1e3 * statistics.median(gaps_before),
        "itl_during_max_ms": 1e3 * max(gaps_during),
        "itl_during_p50_ms": 1e3 * statistics.median(gaps_during),
    }


def engine_cost(args) -> list[tuple[bool, float, float]]:
    """(constrained, wall seconds, mask ms per step) for alternating batches of 16 in this process."""
    from wsgi_infer import LLM, SamplingParams
    from wsgi_infer.engine.sampling import grammar, sampler
    from wsgi_infer.engine.sampling_params import StructuredOutput

    # no drafts on either side: a constrained stream is never speculated, so with them the unconstrained batches
    # would gain what prompt lookup gives and the difference would not be the masks' cost
    llm = LLM(model=args.model, dtype=args.dtype, speculative="none")
    spec = StructuredOutput("json", LONG_STRING["json_schema"]["schema"])
    masks = {"seconds": 0.0, "steps": 0}

    def timed_masks(*call_args) -> None:
        start = time.perf_counter()
        grammar.apply_grammar_masks(*call_args)
        masks["seconds"] += time.perf_counter() - start
        masks["steps"] += 1

    sampler.apply_grammar_masks = timed_masks
    llm.engine.grammars.compile(spec)  # one-time costs (tokenizer tables, the compile) out of the runs
    results = []
    for constrained in (False, True) * args.repeat:
        params = SamplingParams(
            temperature=0, max_tokens=args.output_len, ignore_eos=True, structured_output=spec if constrained else None
        )
        masks.update(seconds=0.0, steps=0)
        start = time.perf_counter()
        llm.generate([f"Essay {i}:" for i in range(16)], params)
        per_step = 1e3 * masks["seconds"] / max(1, masks["steps"])
        results.append((constrained, time.perf_counter() - start, per_step))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--large-schema-fields", type=int, default=1000)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--model", default=None)
    parser.add_argument("--server-log", action="store_true")
    parser.add_argument("--engine", action="store_true", help="only part 3: the engine alone, in this process")
    args = parser.parse_args()
    if args.engine:
        print(f"## Engine alone, 16 requests x {args.output_len} tokens, alternating\n")
        print("| JSON schema | wall s | grammar masks ms per step |\n|---|---|---|")
        for constrained, wall, per_step in engine_cost(args):
            print(f"| {'yes' if constrained else 'no'} | {wall:.2f} | {per_step:.2f} |")
        return
    server, url = start_server(args)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(run_level(url, model, 1, 2, 8, None, {"response_format": LONG_STRING}))  # warm-up, compiles
        runs = throughput(args, url, model)
        stall = asyncio.run(compile_stall(url, model, 4, args.large_schema_fields))
    finally:
        server.terminate()
        server.wait(60)
    print(f"## JSON schema on every request, {args.output_len} output tokens, median of {args.repeat} runs\n")
    print("| concurrency | no constraint tok/s | JSON schema tok/s | cost |\n|---|---|---|---|")
    for c in args.concurrency:
        free, constrained = statistics.median(runs[(c, False)]), statistics.median(runs[(c, True)])
        print(f"| {c} | {free:.1f} | {constrained:.1f} | {100 * (1 - constrained / free):.1f}% |")
    print(
        f"\nA new {args.large_schema_fields}-property schema: its request took {stall['compile_request_s']:.2f} s; "
        f"4 running streams' ITL p50 {stall['itl_before_p50_ms']:.1f} ms before, "
        f"p50 {stall['itl_during_p50_ms']:.1f} ms / max {stall['itl_during_max_ms']:.1f} ms meanwhile"
    )


if __name__ == "__main__":
    main()
