#!/usr/bin/env python
"""Load generator for the HTTP server, reporting what `vllm bench serve` reports.

Streams /v1/completions with include_usage, at fixed concurrencies (or a
Poisson rate), and measures per request: TTFT (first chunk with choices),
ITL (gaps between such chunks), E2EL (last content chunk), TPOT
((E2EL - TTFT) / (tokens - 1)), output tokens from the usage chunk. Then runs
the engine alone (scripts/bench_engine.py) on the same requests in the same
run, and prints both. Example:

    .venv/bin/python scripts/bench_serve.py --concurrency 1 8 32

By default it starts `gunicorn -c gunicorn.conf.py` itself on a free port;
--url targets a running server instead. --peer NAME=URL adds any other
OpenAI-compatible server (llama.cpp, transformers serve, vLLM...): every
system gets the same prompts and lengths, runs alternate between systems, and
peers without `ignore_eos` get a `logit_bias` of -100 on --eos-token-ids.
--llama-server BINARY starts llama.cpp's own server as one more peer, on the
same GGUF (--peer-model for another file: a Hugging Face --model's BF16 GGUF),
with as many threads as this machine has cores and a slot per stream; like
ours, it starts afresh for each run, so that no run reuses the prompts an
earlier run left in its cache.
--ik-llama-server BINARY starts ik_llama.cpp's llama-server the same way, with ``-rtr`` (its run-time repacking
of every tensor into row-interleaved types, its fastest CPU path).
--json and --plot write the medians and a PNG of tok/s and TTFT against
concurrency, one line per system:

    .venv/bin/python scripts/bench_serve.py --concurrency 1 16 --skip-engine --model smol-q8_0.gguf \
        --llama-server llama.cpp/build/bin/llama-server --json side_by_side.json --plot side_by_side.png
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import child, prompts  # noqa: E402
from long_prompts import long_prompts  # noqa: E402
from repeat_prompts import repeat_prompts  # noqa: E402
from serve_load import run_level  # noqa: E402
from serve_processes import IK_NAME, start_llama_server, start_server, tree_peak_rss_mb  # noqa: E402
from serve_report import median_runs, plot, print_served_and_alone, print_side_by_side  # noqa: E402

from wsgi_infer.engine.config import QUANTIZATION_METHODS, EngineConfig  # noqa: E402

WORKLOADS = {"standard": prompts, "repeat": repeat_prompts, "long": long_prompts}


def workload_of(args):
    """The prompts a level sends: n of them for n requests."""
    if args.workload == "long":
        return functools.partial(long_prompts, tokens=args.prompt_tokens)
    return WORKLOADS[args.workload]


def serve_levels(
    args, name: str, peer_url: str | None, env: dict | None = None, llama_args: list[str] | None = None
) -> dict[int, dict]:
    """One run of every concurrency against one system: ours (started here with ``env``, or --url), llama-server
    (started here with ``llama_args`` added, where they are not None) or a peer at ``peer_url``."""
    llama = llama_args is not None
    if llama:
        binary = args.ik_llama_server if name == IK_NAME else None
        server, url = start_llama_server(args, extra=llama_args, binary=binary)
    elif peer_url or args.url:
        server, url = None, peer_url or args.url
    else:
        server, url = start_server(args, env=env)
    peer, ours_started = llama or peer_url is not None, server is not None and not llama
    # Peers may lack ignore_eos: a strongly negative bias on the end tokens has the same effect.
    extra = {"logit_bias": {str(t): -100 for t in args.eos_token_ids}} if peer else None
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        keep_alive = not peer
        asyncio.run(run_level(url, model, 1, 2, 8, None, extra, keep_alive, prompts))  # warm-up: short prompts
        results, workload = {}, workload_of(args)
        for c in args.concurrency:
            n = max(args.min_requests, c * args.rounds)
            level = run_level(url, model, c, n, args.output_len, args.request_rate, extra, keep_alive, workload)
            drafted = spec_counts(url) if ours_started else None
            results[c] = asyncio.run(level)
            if drafted is not None:  # our speculation: the level's draft tokens and those accepted
                after = spec_counts(url)
                results[c]["spec_draft_tokens"], results[c]["spec_accepted_tokens"] = (
                    b - a for a, b in zip(drafted, after)
                )
            if ours_started:
                results[c]["server_peak_rss_mb"] = tree_peak_rss_mb(server.pid)
            r = results[c]
            print(
                f"# {name} c={c}: {r['output_tok_s']:.1f} tok/s, TTFT {r['ttft_mean_ms']:.0f} ms "
                f"({r['prefill_tok_s']:.1f} prompt tok/s), "
                f"client CPU {r['client_cpu_frac']:.0%} of a core",
                file=sys.stderr,
            )
        return results
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)


def spec_counts(url: str) -> tuple[float, float]:
    """Our server's speculative draft tokens and accepted tokens so far (its /metrics)."""
    values = dict.fromkeys(("draft_tokens", "accepted_tokens"), 0.0)
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for name in values:
            if line.startswith(f"wsgi_infer:spec_decode_num_{name}_total{{"):
                values[name] += float(line.rsplit(" ", 1)[1])
    return values["draft_tokens"], values["accepted_tokens"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATION_METHODS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals per second (capped by concurrency)"
    )
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests per concurrency slot")
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="alternating server / engine runs; medians are reported")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--server-log", action="store_true", help="copy the server's log to stderr")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=URL", help="another server to compare")
    parser.add_argument("--llama-server", metavar="BINARY", help="start llama.cpp's llama-server as a peer")
    parser.add_argument("--peer-model", help="the GGUF llama-server serves (default: --model)")
    parser.add_argument("--eos-token-ids", type=int, nargs="+", default=[0, 2], help="biased away for peers")
    parser.add_argument(
        "--workload", choices=WORKLOADS, default="standard", help="repeat: repeat_prompts.py; long: long_prompts.py"
    )
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="the long workload's prompts' length")
    parser.add_argument(
        "--ours", action="append", default=[], metavar="NAME=KEY=VALUE,...", help="our server again, with settings"
    )
    parser.add_argument("--llama-variant", action="append", default=[], metavar="NAME=ARGS", help="llama-server again")
    parser.add_argument("--ik-llama-server", metavar="BINARY", help="ik_llama.cpp's llama-server, a peer")
    parser.add_argument("--json", default=None, help="write every system's medians here")
    parser.add_argument("--plot", default=None, help="write a PNG of tok/s and TTFT against concurrency here")
    return parser.parse_args()


def systems_of(args) -> list[tuple]:
    # (name, peer URL, our settings, llama-server's extra arguments)
    systems = [("wsgi-infer", None, None, None)] + [(*p.split("=", 1), None, None) for p in args.peer]
    for variant in args.ours:  # NAME=WSGI_INFER_SPECULATIVE=ngram,...
        name, _, settings = variant.partition("=")
        systems.append((name, None, dict(kv.split("=", 1) for kv in settings.split(",")), None))
    if args.llama_server:  # started afresh for each run, as ours are: no run reuses another's cached prompts
        for name, extra in [("llama-server", "")] + [v.split("=", 1) for v in args.llama_variant]:
            systems.append((name, None, None, extra.split()))
    if args.ik_llama_server:
        systems.append((IK_NAME, None, None, ["-rtr"]))
    return systems


def main() -> None:
    args = parse_args()
    systems = systems_of(args)
    runs: dict[str, list] = {system[0]: [] for system in systems}
    alone_runs = []
    # the engine alone speculates as the server it is set beside does (its WSGI_INFER_SPECULATIVE)
    speculative = os.environ.get("WSGI_INFER_SPECULATIVE", EngineConfig().speculative)
    for _ in range(args.repeat):  # alternate the systems so drift of this shared machine hits each of them
        for name, url, env, llama_args in systems:
            runs[name].append(serve_levels(args, name, url, env, llama_args))
        if not args.skip_engine:
            results = child("engine", args, args.quantization, speculative)["results"]
            alone_runs.append({int(c): r for c, r in results.items()})
    medians = {name: median_runs(r) for name, r in runs.items()}
    for name, levels in medians.items():
        for c, r in levels.items():
            if r.get("spec_draft_tokens"):
                rate = r["spec_accepted_tokens"] / r["spec_draft_tokens"]
                print(f"# {name} c={c}: {rate:.0%} of {r['spec_draft_tokens']:.0f} draft tokens accepted")
    served = medians["wsgi-infer"]
    alone = median_runs(alone_runs) if alone_runs else None
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "systems": medians}, indent=2))
    if args.plot:
        plot(medians, args.plot)
    if len(systems) > 1:
        print_side_by_side(medians, args)
    print_served_and_alone(served, alone, args, speculative)


if __name__ == "__main__":
    main()
