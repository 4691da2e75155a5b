#!/usr/bin/env python
"""One stream beside the peers, request by request: every server started at once, then rounds of one streaming
request each, the servers' order rotating from round to round, and each ratio taken within its round.

This machine's memory bandwidth moves from minute to minute (the C probe: 33-50 GB/s within ten minutes, Zen 4,
2026-12-05), and one stream follows it; ``bench_serve.py`` starts each server afresh for a run of a minute or more,
so its alternations compare minutes, not servers. Here the requests of one round follow each other within seconds,
and the median of the rounds' ratios is the figure. Speculation off on our side (set here), none on the peers';
128 tokens a request (``ignore_eos``, and a bias of -100 on the end tokens for the peers):

    .venv/bin/python scripts/bench_paired.py --model shaped/1b/shaped-1b-Q4_0.gguf \\
        --llama-server LLAMA_SERVER --ik-llama-server IK_LLAMA_SERVER --rounds 12

Reported per server: the median of its decode rates (tokens after the first over the time after the first: what
one stream reads its weights at) and of its whole requests' tok/s; per peer, the median of our rounds' ratios to
it, with their quartiles.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import prompts  # noqa: E402
from serve_load import one_request  # noqa: E402
from serve_processes import IK_NAME, start_llama_server, start_server  # noqa: E402

OURS = "wsgi-infer"


def start_all(args) -> dict[str, tuple]:
    """Every server, each (process, url, extra request fields); llama-server's slots and context as bench_serve's."""
    serve = argparse.Namespace(
        dtype="auto", quantization="auto", model=args.model, server_log=False, peer_model=None, concurrency=[1],
        prompt_tokens=0, output_len=args.output_len, workload="standard", llama_server=args.llama_server,
    )  # fmt: skip
    peer_extra = {"logit_bias": {str(t): -100 for t in args.eos_token_ids}}  # peers lack ignore_eos
    servers = {OURS: (*start_server(serve, env={"WSGI_INFER_SPECULATIVE": "none"}), None)}  # none on the peers
    if args.llama_server:
        servers["llama-server"] = (*start_llama_server(serve), peer_extra)
    if args.ik_llama_server:
        servers[IK_NAME] = (*start_llama_server(serve, extra=["-rtr"], binary=args.ik_llama_server), peer_extra)
    return servers


async def one(url: str, prompt: str, output_len: int, extra: dict | None) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        r = await one_request(client, model, prompt, output_len, extra)
    return {"decode": (r["tokens"] - 1) / (r["e2el"] - r["ttft"]), "whole": r["tokens"] / r["e2el"]}


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{q[1]:.2f}× ({q[0]:.2f}-{q[2]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--llama-server")
    parser.add_argument("--ik-llama-server")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--eos-token-ids", type=int, nargs="+", default=[0, 2], help="biased away for peers")
    args = parser.parse_args()
    servers = start_all(args)
    names = list(servers)
    rates: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for _, url, extra in servers.values():  # warm-up: each server's first request
            asyncio.run(one(url, "Hello", 8, extra))
        for i, prompt in enumerate(prompts(args.rounds)):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                _, url, extra = servers[name]
                rates[name].append(asyncio.run(one(url, prompt, args.output_len, extra)))
            line = ", ".join(f"{n} {r[-1]['decode']:.1f}" for n, r in rates.items())
            print(f"# round {i + 1}: {line}", file=sys.stderr)
    finally:
        for process, _, _ in servers.values():
            process.terminate()
            process.wait(60)
    title = f"{Path(args.model).name}, {args.rounds} rounds"
    print(f"| {title} | decode tok/s | request tok/s | ours against it, by round |")
    print("|---|---|---|---|")
    for name in names:
        decode, whole = ([r[key] for r in rates[name]] for key in ("decode", "whole"))
        ratio = [o["decode"] / r["decode"] for o, r in zip(rates[OURS], rates[name])]
        paired = quartiles(ratio) if name != OURS else ""
        print(f"| {name} | {statistics.median(decode):.1f} | {statistics.median(whole):.1f} | {paired} |")


if __name__ == "__main__":
    main()
