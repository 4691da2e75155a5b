"""The load `bench_serve.py` sends: streamed /v1/completions at a fixed concurrency (or a Poisson rate), each
request timed as `vllm bench serve` times it, and a level's requests summarized in its metrics."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx
from bench_engine import percentile, prompts


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: str, output_len: int, extra_body: dict | None = None
) -> dict:
    body = {
        **(extra_body or {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    times, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                times.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    ttft = times[0] - start
    e2el = times[-1] - start
    usage = usage or {"completion_tokens": len(times), "prompt_tokens": 0}  # a peer without stream usage
    tokens = usage["completion_tokens"]
    return {
        "ttft": ttft,
        "e2el": e2el,
        "itl": [b - a for a, b in zip(times, times[1:])],
        "tpot": (e2el - ttft) / (tokens - 1) if tokens > 1 else None,
        "tokens": tokens,
        "prompt_tokens": usage["prompt_tokens"],
        "end": times[-1],
    }


async def run_level(
    url: str,
    model: str,
    concurrency: int,
    num_requests: int,
    output_len: int,
    rate: float | None,
    extra_body: dict | None = None,
    keep_alive: bool = True,
    workload=prompts,
) -> dict:
    todo = workload(num_requests)
    semaphore = asyncio.Semaphore(concurrency)
    # A peer's connections are not reused: llama-server (cpp-httplib) closes a kept-alive connection after 5
    # requests, and a request sent on it just then fails ("Server disconnected without sending a response").
    keep = concurrency + 4 if keep_alive else 0
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=keep)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def limited(prompt: str, delay: float) -> dict:
            await asyncio.sleep(delay)
            async with semaphore:
                return await one_request(client, model, prompt, output_len, extra_body)

        delays, t = [], 0.0
        for _ in todo:
            delays.append(t)
            if rate:
                t += random.expovariate(rate)
        start = time.perf_counter()
        cpu = time.process_time()
        results = await asyncio.gather(*(limited(p, d) for p, d in zip(todo, delays)))
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
    summary = summarize(results, wall)
    summary["client_cpu_frac"] = cpu / wall
    return summary


def summarize(results: list[dict], wall: float) -> dict:
    ms = lambda values, q: 1e3 * percentile(values, q)  # noqa: E731
    mean_ms = lambda values: 1e3 * statistics.mean(values) if values else float("nan")  # noqa: E731
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    itl = [g for r in results for g in r["itl"]]
    e2el = [r["e2el"] for r in results]
    out = sum(r["tokens"] for r in results)
    read = [r["prompt_tokens"] / r["ttft"] for r in results if r["prompt_tokens"]]
    return {
        "prefill_tok_s": statistics.mean(read) if read else float("nan"),  # a prompt's tokens over its TTFT
        "requests": len(results),
        "output_tok_s": out / wall,
        "request_s": len(results) / wall,
        "total_tok_s": (out + sum(r["prompt_tokens"] for r in results)) / wall,
        "ttft_mean_ms": mean_ms(ttft),
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "tpot_mean_ms": mean_ms(tpot),
        "tpot_p50_ms": ms(tpot, 50),
        "tpot_p99_ms": ms(tpot, 99),
        "itl_mean_ms": mean_ms(itl),
        "itl_p50_ms": ms(itl, 50),
        "itl_p99_ms": ms(itl, 99),
        "e2el_mean_ms": mean_ms(e2el),
        "e2el_p50_ms": ms(e2el, 50),
        "e2el_p99_ms": ms(e2el, 99),
    }
