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
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import percentile, prompts  # noqa: E402
from long_prompts import long_prompts  # noqa: E402
from repeat_prompts import repeat_prompts  # noqa: E402

from wsgi_infer.engine.config import QUANTIZATION_METHODS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"standard": prompts, "repeat": repeat_prompts, "long": long_prompts}
WORKLOAD = prompts  # --workload sets it
IK_NAME = "ik_llama.cpp -rtr"


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
    workload=None,
) -> dict:
    todo = (workload or WORKLOAD)(num_requests)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, wrap: list[str] | None = None, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Our gunicorn on a free port, its command behind `wrap` (taskset, a cgroup) when given, with ``env`` added."""
    port = free_port()
    env = {**os.environ, "WSGI_INFER_DTYPE": args.dtype, "WSGI_INFER_QUANTIZATION": args.quantization, **(env or {})}
    if args.model:
        env["WSGI_INFER_MODEL"] = args.model
    process = subprocess.Popen(
        [
            *(wrap or []),
            str(Path(sys.executable).with_name("gunicorn")),
            "-c",
            "gunicorn.conf.py",
            "--bind",
            f"127.0.0.1:{port}",
            "--access-logfile",
            "/dev/null",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ready = threading.Event()

    def drain() -> None:  # keep reading, or a full pipe would block the server's logging
        for line in process.stdout:
            if "engine ready" in line:
                ready.set()
            if args.server_log:
                sys.stderr.write(line)
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    ready.wait()
    if process.poll() is not None:
        raise SystemExit("server exited before it was ready")
    return process, f"http://127.0.0.1:{port}"


def start_llama_server(
    args, wrap: list[str] | None = None, extra: list[str] = (), binary: str | None = None
) -> tuple[subprocess.Popen, str]:
    """llama.cpp's llama-server (or ``binary``: ik_llama.cpp's) on the peer model: 2048 tokens of context per slot
    (or a long prompt's and its output's), one slot per stream."""
    model = args.peer_model or args.model
    if not model or not model.endswith(".gguf"):
        raise SystemExit("--llama-server needs a GGUF: --model FILE.gguf, or --peer-model FILE.gguf")
    model, port, slots = str(Path(model).resolve()), free_port(), max(args.concurrency)
    web_ui = ["--webui", "none"] if binary else ["--no-webui"]  # ik_llama.cpp's spelling, and llama.cpp's
    binary = str(Path(binary or args.llama_server).resolve())
    command = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), *web_ui]
    per_slot = max(2048, args.prompt_tokens + args.output_len if args.workload == "long" else 0)
    command += ["-t", str(os.cpu_count()), "-np", str(slots), "-c", str(per_slot * slots), *extra]
    log = open(os.environ.get("LLAMA_SERVER_LOG", os.devnull), "w")
    # in a scratch directory: ik_llama.cpp's server writes a llama.log where it runs
    process = subprocess.Popen(
        [*(wrap or []), *command], stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir()
    )
    return process, healthy(process, f"http://127.0.0.1:{port}", command)


def healthy(process: subprocess.Popen, url: str, command: list[str]) -> str:
    """``url`` once its /health answers 200 (within 5 minutes); the process is killed if it never does."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"did not become healthy: {' '.join(command)}")


def engine_alone(args) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "bench_engine.py"),
        "--child",
        "engine",
        "--dtype",
        args.dtype,
        "--quantization",
        args.quantization,
        "--output-len",
        str(args.output_len),
        "--rounds",
        str(args.rounds),
        "--min-requests",
        str(args.min_requests),
        "--concurrency",
        *map(str, args.concurrency),
    ]
    if args.model:
        cmd += ["--model", args.model]
    return json.loads(
        subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
    )


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
        results = {}
        for c in args.concurrency:
            n = max(args.min_requests, c * args.rounds)
            level = run_level(url, model, c, n, args.output_len, args.request_rate, extra, keep_alive)
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


def tree_peak_rss_mb(pid: int) -> float:
    """The largest peak RSS (VmHWM, so far) among the server's processes: its worker, with one worker."""
    import psutil

    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return max(_peak_rss_kb(p.pid) for p in processes) / 1024


def _peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def median_runs(runs: list[dict[int, dict]]) -> dict[int, dict]:
    """Per concurrency and metric, the median over runs."""
    return {
        c: {
            k: statistics.median(run[c][k] for run in runs)
            for k in runs[0][c]
            if isinstance(runs[0][c][k], (int, float))
        }
        for c in runs[0]
    }


def print_side_by_side(medians: dict[str, dict[int, dict]], args) -> None:
    names = list(medians)
    print(f"## Side by side, {args.output_len} output tokens, median of {args.repeat} alternating runs\n")
    print("| concurrency | " + " | ".join(f"{n}: out tok/s (TTFT, TPOT mean)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for c in medians[names[0]]:
        cells = [
            f"{r['output_tok_s']:.1f} ({r['ttft_mean_ms'] / 1e3:.2f} s, {r['tpot_mean_ms']:.1f} ms)"
            for r in (medians[n][c] for n in names)
        ]
        print(f"| {c} | " + " | ".join(cells) + " |")
    print()


def plot(medians: dict[str, dict[int, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tok, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for name, levels in medians.items():
        concurrency = sorted(levels)
        tok.plot(concurrency, [levels[c]["output_tok_s"] for c in concurrency], marker="o", label=name)
        ttft.plot(concurrency, [levels[c]["ttft_mean_ms"] / 1e3 for c in concurrency], marker="o", label=name)
    for axis, label in ((tok, "output tok/s"), (ttft, "mean TTFT (s)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    ttft.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
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
    args = parser.parse_args()

    global WORKLOAD
    WORKLOAD = WORKLOADS[args.workload]
    if args.workload == "long":
        WORKLOAD = functools.partial(long_prompts, tokens=args.prompt_tokens)
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
    runs: dict[str, list] = {system[0]: [] for system in systems}
    alone_runs = []
    for _ in range(args.repeat):  # alternate the systems so drift of this shared machine hits each of them
        for name, url, env, llama_args in systems:
            runs[name].append(serve_levels(args, name, url, env, llama_args))
        if not args.skip_engine:
            alone_runs.append({int(c): r for c, r in engine_alone(args)["results"].items()})
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

    print(
        f"## HTTP server vs engine alone ({args.dtype}, quantization {args.quantization}), "
        f"{args.output_len} output tokens, median of {args.repeat} alternating runs\n"
    )
    print(
        "| concurrency | path | out tok/s | req/s | TTFT mean / p50 / p99 ms | TPOT mean / p99 ms "
        "| ITL p50 / p99 ms | E2EL mean / p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c, r in served.items():
        print(
            f"| {c} | HTTP/SSE | {r['output_tok_s']:.1f} | {r['request_s']:.2f} | {r['ttft_mean_ms']:.1f} / "
            f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['tpot_mean_ms']:.1f} / {r['tpot_p99_ms']:.1f} "
            f"| {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['e2el_mean_ms']:.0f} / {r['e2el_p99_ms']:.0f} |"
        )
        if alone:
            e = alone[c]
            print(
                f"| {c} | engine alone | {e['output_tok_s']:.1f} | {e['request_s']:.2f} | {e['ttft_mean_ms']:.1f} / "
                f"{e['ttft_p50_ms']:.1f} / {e['ttft_p99_ms']:.1f} | {e['tpot_mean_ms']:.1f} / {e['tpot_p99_ms']:.1f} | "
                f"{e['itl_p50_ms']:.1f} / {e['itl_p99_ms']:.1f} | {e['e2el_mean_ms']:.0f} / - |"
            )
    if alone:
        print("\n| concurrency | HTTP/SSE cost in output tok/s | TTFT p50 added |\n|---|---|---|")
        for c, r in served.items():
            e = alone[c]
            cost = 100 * (1 - r["output_tok_s"] / e["output_tok_s"])
            print(f"| {c} | {cost:.1f}% | {r['ttft_p50_ms'] - e['ttft_p50_ms']:+.1f} ms |")


if __name__ == "__main__":
    main()
