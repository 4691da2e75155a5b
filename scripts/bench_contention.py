#!/usr/bin/env python
"""Throughput beside other work: busy neighbours, a CPU quota and an affinity mask.

Each condition starts every system afresh, then (for neighbours) that many
`sh -c 'while :; do :; done'` processes beside it, and streams
/v1/completions at each concurrency for --seconds: every stream sends request
after request until time is up. Tokens are counted as they arrive (a request's
usage chunk corrects for chunks that carried several), after --warmup seconds,
so a system that crawls under contention still finishes on time. Reported per
condition, system and concurrency: output tok/s, its share of the same
system's tok/s alone, and ITL p50 (at one stream, the time of a step).

    .venv/bin/python scripts/bench_contention.py --concurrency 1 4 16 \\
        --llama-server llama.cpp/build/bin/llama-server --json contention.json --plot contention.png

The quota condition puts the server in a cgroup v1 `cpu` group with half the
machine's CPUs as its quota (root only); affinity runs it under `taskset` on
half of them. A --peer NAME=URL is already running, so only the neighbour
conditions apply to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import percentile, prompts  # noqa: E402
from serve_processes import start_llama_server, start_server  # noqa: E402

from wsgi_infer.engine.loading.model_paths import default_model_path  # noqa: E402

CPUS = sorted(os.sched_getaffinity(0))
V1_CPU = Path("/sys/fs/cgroup/cpu")


@dataclass(frozen=True)
class Condition:
    name: str
    neighbours: int = 0
    quota: float | None = None  # CPUs
    affinity: list[int] | None = None

    @property
    def confines(self) -> bool:
        return self.quota is not None or self.affinity is not None


CONDITIONS = [
    Condition("alone"),
    Condition("1 busy neighbour", neighbours=1),
    Condition("2 busy neighbours", neighbours=2),
    Condition(f"quota of {len(CPUS) / 2:g} CPUs", quota=len(CPUS) / 2),
    Condition(f"affinity to {len(CPUS) // 2} CPUs", affinity=CPUS[: len(CPUS) // 2]),
]


@contextmanager
def confined(condition: Condition):
    """The command prefix that starts a server under the condition's quota or affinity."""
    if condition.affinity is not None:
        yield ["taskset", "-c", ",".join(map(str, condition.affinity))]
        return
    if condition.quota is None:
        yield []
        return
    group = V1_CPU / f"bench-contention-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(condition.quota * 100000)))
        yield ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"]
    finally:
        group.rmdir()


@contextmanager
def neighbours(count: int):
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


async def stream_until(client: httpx.AsyncClient, body: dict, deadline: float, tokens: list, itl: list) -> None:
    """Requests one after another until the deadline; (time, count) for every token that arrives."""
    while time.perf_counter() < deadline:
        seen, last = 0, None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if chunk["choices"]:
                    tokens.append((now, 1))
                    seen += 1
                    if last is not None:
                        itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    tokens.append((now, chunk["usage"]["completion_tokens"] - seen))


async def measure(url: str, concurrency: int, args, extra: dict) -> dict:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    tokens: list[tuple[float, int]] = []
    itl: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        deadline = start + args.warmup + args.seconds
        bodies = [
            {**extra, "model": model, "prompt": p, "max_tokens": args.output_len, "temperature": 0, "stream": True}
            | {"ignore_eos": True, "stream_options": {"include_usage": True}}
            for p in prompts(concurrency)
        ]
        streams = [asyncio.create_task(stream_until(client, b, deadline, tokens, itl)) for b in bodies]
        await asyncio.wait(streams, timeout=args.warmup + args.seconds)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    counted = sum(n for t, n in tokens if start + args.warmup <= t < deadline)
    return {
        "output_tok_s": counted / args.seconds,
        "itl_p50_ms": 1e3 * percentile(itl, 50) if itl else None,
        "itl_p99_ms": 1e3 * percentile(itl, 99) if itl else None,
    }


def run_condition(args, condition: Condition, name: str, peer_url: str | None) -> dict[int, dict] | None:
    if condition.confines and peer_url is not None:
        return None  # a running peer cannot be put under a quota or mask from here
    extra = {"logit_bias": {str(t): -100 for t in args.eos_token_ids}} if name != "wsgi-infer" else {}
    with confined(condition) as wrap:  # the cgroup outlives the server it holds
        if peer_url is not None:
            server, url = None, peer_url
        elif name == "llama-server":
            server, url = start_llama_server(args, wrap)
        else:
            server, url = start_server(args, wrap)
        try:
            asyncio.run(measure_warm(url, extra))
            with neighbours(condition.neighbours):
                results = {c: asyncio.run(measure(url, c, args, extra)) for c in args.concurrency}
                if name == "wsgi-infer" and server is not None:  # our promise; llama-server waits on its slots
                    results["stop_s"] = asyncio.run(timed_stop(server, url, extra, args.stop_signal))
        finally:
            if server is not None and server.poll() is None:
                server.kill()
                server.wait(60)
    for c in args.concurrency:
        print(f"# {condition.name}, {name} c={c}: {results[c]['output_tok_s']:.1f} tok/s", file=sys.stderr)
    if "stop_s" in results:
        stop = f"exit {results['stop_s']:.2f} s after SIG{args.stop_signal}"
        print(f"# {condition.name}, {name}: {stop}", file=sys.stderr)
    return results


async def timed_stop(server: subprocess.Popen, url: str, extra: dict, signal_name: str, streams: int = 4) -> float:
    """Seconds from the signal to the server's exit, with `streams` long streams open (each past its first token)."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {**extra, "model": model, "prompt": "Tell me a long story.", "max_tokens": 2000, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    streaming = asyncio.Semaphore(0)

    async def hold(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            first = True
            async for _ in response.aiter_lines():
                if first:
                    streaming.release()
                    first = False

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        held = [asyncio.create_task(hold(client)) for _ in range(streams)]
        for _ in held:
            await streaming.acquire()
        start = time.perf_counter()
        server.send_signal(getattr(signal, f"SIG{signal_name}"))
        await asyncio.to_thread(server.wait, 120)
        stopped = time.perf_counter() - start
        await asyncio.gather(*held, return_exceptions=True)
    return stopped


async def measure_warm(url: str, extra: dict) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        body = {**extra, "model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        (await client.post("/v1/completions", json=body)).raise_for_status()


def print_table(results: dict[str, dict[str, dict[int, dict]]], args) -> None:
    systems = sorted({name for by_system in results.values() for name in by_system})
    print(f"## Output tok/s (share of the same system alone; ITL p50), {args.output_len} tokens a request\n")
    stops = [f"{n} exit after SIG{args.stop_signal}" for n in systems]
    print("| condition | " + " | ".join([f"{n} c={c}" for n in systems for c in args.concurrency] + stops) + " |")
    print("|---|" + "---|" * (len(systems) * (len(args.concurrency) + 1)))
    for condition, by_system in results.items():
        cells = []
        for name in systems:
            for c in args.concurrency:
                r, alone = by_system.get(name, {}).get(c), results.get("alone", {}).get(name, {}).get(c)
                if r is None:
                    cells.append("—")
                    continue
                itl = f"{r['itl_p50_ms']:.0f} ms" if r["itl_p50_ms"] is not None else "no tokens"
                share = f"{r['output_tok_s'] / alone['output_tok_s']:.0%}, " if alone and alone["output_tok_s"] else ""
                cells.append(f"{r['output_tok_s']:.1f} ({share}{itl})")
        cells += [f"{by_system[n]['stop_s']:.2f} s" if "stop_s" in by_system.get(n, {}) else "—" for n in systems]
        print(f"| {condition} | " + " | ".join(cells) + " |")
    print()


def plot(results: dict[str, dict[str, dict[int, dict]]], concurrency: list[int], path: str) -> None:
    """tok/s against the number of busy neighbours, one line per system and concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = {c.name: c.neighbours for c in CONDITIONS if not c.confines and c.name in results}
    fig, axis = plt.subplots(figsize=(7, 4.5))
    systems = sorted({n for by_system in results.values() for n in by_system}, key="wsgi-infer".__ne__)  # ours first
    for style, name in zip(("-", "--", ":", "-."), systems):
        for color, c in enumerate(concurrency):  # a colour per concurrency, a line style per system
            points = [(n, results[cond][name][c]["output_tok_s"]) for cond, n in counts.items()]
            axis.plot(*zip(*points), style, color=f"C{color}", marker="o", label=f"{name}, {c} streams")
    axis.set_xticks(sorted(counts.values()))
    axis.set_xlabel("busy processes beside the server")
    axis.set_ylabel("output tok/s")
    axis.set_yscale("log")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="our model (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20, help="counted time per concurrency")
    parser.add_argument("--warmup", type=float, default=3, help="seconds streamed before counting")
    parser.add_argument("--conditions", nargs="+", default=[c.name for c in CONDITIONS])
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=URL", help="a running server")
    parser.add_argument("--llama-server", metavar="BINARY", help="start llama.cpp's llama-server as a peer")
    parser.add_argument("--peer-model", help="the GGUF llama-server serves (default: --model, or ours)")
    parser.add_argument("--eos-token-ids", type=int, nargs="+", default=[0, 2], help="biased away for peers")
    parser.add_argument("--stop-signal", choices=["INT", "TERM"], default="INT", help="how each started server stops")
    parser.add_argument("--server-log", action="store_true", help="copy our server's log to stderr")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    args.peer_model = args.peer_model or args.model or str(default_model_path())

    systems = [("wsgi-infer", None)] + [tuple(p.split("=", 1)) for p in args.peer]
    if args.llama_server:
        systems.append(("llama-server", None))
    results: dict[str, dict[str, dict[int, dict]]] = {}
    for condition in (c for c in CONDITIONS if c.name in args.conditions):
        results[condition.name] = {}
        for name, url in systems:  # each system in turn under the same condition, so drift hits both
            measured = run_condition(args, condition, name, url)
            if measured is not None:
                results[condition.name][name] = measured
    print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    if args.plot:
        plot(results, args.concurrency, args.plot)


if __name__ == "__main__":
    main()
