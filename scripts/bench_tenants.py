#!/usr/bin/env python
"""Two API keys on one server (issue 55): key A floods, key B chats; B's first token and inter-token latency,
and everyone's throughput, with fair share and without.

    .venv/bin/python scripts/bench_tenants.py --json tenants.json --plot docs/tenants.png

Per run, a fresh server (one worker, the default model, speculation off unless ``--speculative ngram``) with the
keys A and B:
- B alone: ``--alone`` chat requests, one at a time (EOS kept): B's unshared figures;
- the flood: A keeps ``--streams`` chat streams open (each a new request once the last ends; 128 tokens,
  EOS ignored: load, not quality) and sends a new ``--long``-token prompt every ``--every`` seconds (16 tokens;
  each prompt new to the cache), whatever is still waiting; after ``--warmup`` seconds B chats again, one request
  at a time, for ``--seconds`` seconds.
The flood runs with fair share (the default) and without (``WSGI_INFER_FAIR_SHARE=false``). TTFT: the time to the
first chunk with text; ITL: the gaps between chunks with text (speculation off: a token each). Throughput: the
prompt and generated tokens of every request that finished inside B's window, over the window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import prompts as chat_prompts  # noqa: E402
from bench_kv_store import prompt_ids  # noqa: E402
from serve_processes import ROOT, free_port, healthy  # noqa: E402

KEYS = {"A": "tenant-a-key", "B": "tenant-b-key"}


def start(fair_share: bool, log_path: str | None, speculative: str = "none") -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [str(Path(sys.executable).with_name("gunicorn")), "-c", "gunicorn.conf.py"]
    command += ["--bind", f"127.0.0.1:{port}", "--workers", "1", "--access-logfile", "/dev/null"]
    env = {**os.environ, "WSGI_INFER_SPECULATIVE": speculative, "WSGI_INFER_API_KEY": ",".join(KEYS.values())}
    env["WSGI_INFER_FAIR_SHARE"] = "true" if fair_share else "false"
    log = open(log_path or os.devnull, "w")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return process, healthy(process, f"http://127.0.0.1:{port}", command)


class Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0


async def request(http: httpx.AsyncClient, key: str, path: str, body: dict, clock: Clock) -> dict:
    """A streamed request: when it started, the times of its chunks with text, its usage and status."""
    headers = {"Authorization": f"Bearer {KEYS[key]}"}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    record = {"key": key, "start": clock.now(), "chunks": [], "usage": None, "status": None}
    async with http.stream("POST", path, json=body, headers=headers) as r:
        record["status"], record["accepted"] = r.status_code, clock.now()  # the engine took it: headers sent
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            choice = (chunk.get("choices") or [{}])[0]
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                record["chunks"].append(clock.now())
            record["usage"] = chunk.get("usage") or record["usage"]
    record["end"] = clock.now()
    return record


def chat(prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "ignore_eos": ignore_eos}


async def b_chats(http, clock, prompts, until: float | None, count: int | None, records: list) -> None:
    i = 0
    while (count is None or i < count) and (until is None or clock.now() < until):
        records.append(
            await request(http, "B", "/v1/chat/completions", chat(prompts[i % len(prompts)], 128, False), clock)
        )
        i += 1


async def a_stream(http, clock, prompts, offset: int, records: list) -> None:
    for i in range(offset, 1 << 30, 32):
        records.append(
            await request(http, "A", "/v1/chat/completions", chat(prompts[i % len(prompts)], 128, True), clock)
        )


async def a_long(http, clock, longs: list[list[int]], every: float, records: list) -> None:
    tasks = []
    for ids in longs:
        body = {"prompt": ids, "max_tokens": 16, "ignore_eos": True}
        tasks.append(asyncio.create_task(request(http, "A", "/v1/completions", body, clock)))
        tasks[-1].add_done_callback(
            lambda t: records.append(t.result()) if not t.cancelled() and not t.exception() else None
        )
        await asyncio.sleep(every)


def summary(records: list[dict], since: float, until: float) -> dict:
    done = [r for r in records if r["status"] == 200 and r.get("chunks")]
    ttft = [r["chunks"][0] - r["start"] for r in done]
    itl = [b - a for r in done for a, b in zip(r["chunks"], r["chunks"][1:])]

    def ms(values: list[float], q: int) -> float | None:
        if len(values) < 2:
            return round(1000 * values[0], 1) if values else None
        return round(1000 * statistics.quantiles(values, n=100, method="inclusive")[q - 1], 1)

    return {
        "requests": len(done),
        "refused": sum(r["status"] != 200 for r in records),
        "accepted_p50_ms": ms([r["accepted"] - r["start"] for r in done], 50),
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "itl_p50_ms": ms(itl, 50),
        "itl_p99_ms": ms(itl, 99),
        "ttft_over_time": [(round(r["start"] - since, 2), round(r["chunks"][0] - r["start"], 3)) for r in done],
        "itl_over_time": [
            (round(b - since, 2), round(b - a, 3)) for r in done for a, b in zip(r["chunks"], r["chunks"][1:])
        ],
    }


def throughput(records: list[dict], since: float, until: float) -> dict:
    finished = [r for r in records if r["status"] == 200 and r["usage"] and since <= r["end"] <= until]
    prompt = sum(r["usage"]["prompt_tokens"] for r in finished)
    generated = sum(r["usage"]["completion_tokens"] for r in finished)
    return {
        "total_tok_s": round((prompt + generated) / (until - since), 1),
        "output_tok_s": round(generated / (until - since), 1),
    }


async def run(args, fair_share: bool) -> dict:
    process, url = start(fair_share, args.server_log, args.speculative)
    chats = chat_prompts(64)
    longs = prompt_ids(int(args.seconds + args.warmup) // int(args.every) + 2, args.long)
    limits = httpx.Limits(max_connections=args.streams + 64, max_keepalive_connections=args.streams + 64)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            clock, alone, a_records, b_records = Clock(), [], [], []
            await b_chats(http, clock, chats, None, args.alone, alone)
            flood = [asyncio.create_task(a_stream(http, clock, chats, i, a_records)) for i in range(args.streams)]
            flood.append(asyncio.create_task(a_long(http, clock, longs, args.every, a_records)))
            await asyncio.sleep(args.warmup)
            since = clock.now()
            await b_chats(http, clock, chats, since + args.seconds, None, b_records)
            until = clock.now()
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
    finally:
        process.terminate()
        process.wait(120)
    b_alone = summary(alone, 0, clock.now())
    return {
        "fair_share": fair_share,
        "b_alone": {k: v for k, v in b_alone.items() if not k.endswith("over_time")},
        "b_flood": summary(b_records, since, until),
        "a_flood": {
            k: v
            for k, v in summary([r for r in a_records if since <= r["end"] <= until], since, until).items()
            if not k.endswith("over_time")
        },
        "throughput": throughput(a_records + b_records, since, until),
        "window_s": round(until - since, 1),
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for result in results:
        label = "fair share" if result["fair_share"] else "first come, first served"
        ttft = result["b_flood"]["ttft_over_time"]
        itl = result["b_flood"]["itl_over_time"]
        top.plot([t for t, _ in ttft], [v for _, v in ttft], "o-", ms=3, label=label)
        bottom.plot([t for t, _ in itl], [v * 1000 for _, v in itl], ".", ms=2, label=label)
    top.axhline(0.5, ls="--", color="gray", lw=1, label="goal: 0.5 s")
    bottom.axhline(150, ls="--", color="gray", lw=1, label="goal: 150 ms")
    top.set_ylabel("B's time to first token (s)")
    top.set_yscale("log")
    bottom.set_ylabel("B's inter-token latency (ms)")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds into A's flood (after its warm-up)")
    top.legend()
    bottom.legend()
    top.set_title("Key B chats while key A floods (32 streams + a 4,096-token prompt every 2 s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--long", type=int, default=4096, help="tokens of A's long prompts")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between A's long prompts")
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--seconds", type=float, default=90.0, help="B's window under the flood")
    parser.add_argument("--alone", type=int, default=8, help="B's requests before the flood")
    parser.add_argument("--only", choices=("fair", "fcfs"), help="one run instead of both")
    parser.add_argument("--speculative", default="none", help="WSGI_INFER_SPECULATIVE (ngram: the default)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--server-log")
    parser.add_argument("--from-json", help="print and plot the results of an earlier run instead of running")
    args = parser.parse_args()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        modes = [m == "fair" for m in ([args.only] if args.only else ["fcfs", "fair"])]
        results = [asyncio.run(run(args, fair)) for fair in modes]
    for result in results:
        brief = {k: v for k, v in result["b_flood"].items() if not k.endswith("over_time")}
        print(json.dumps({**result, "b_flood": brief}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
