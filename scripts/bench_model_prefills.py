"""A stream on one model beside another model's long prompts, in one server, against llama-server's router: the
shipped SmolLM2 streams (EOS ignored) while GGUF reads 2,048-token prompts one after another (one token each), the
two models loaded beforehand, speculation off, a fresh server a round, the systems alternating.

    .venv/bin/python scripts/bench_model_prefills.py --llama-server llama.cpp/build/bin/llama-server \\
        --rounds 2 shaped-1b-Q4_K_M.gguf

Per system and round: the stream's gaps between tokens (median, 99th percentile, largest), the tokens it got per
second, and GGUF's prompt tokens per second while it streamed. Our engine thread steps one model at a time, so the
stream waits for each of the other model's steps; the router runs each model in a process of its own, which the
operating system shares the cores between.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import first_token, llama_router, ours  # noqa: E402
from long_prompts import long_prompts  # noqa: E402

from wsgi_infer.engine.loading.model_paths import default_model_path  # noqa: E402

STREAM_MODEL = "smollm2-135m-q4_1"
STREAM_TOKENS = 4300  # more than it streams beside the prompts: its KV cache holds 4,368 tokens (bench_models)


def beside_prompts(url: str, busy: str, prompts: int) -> dict:
    """A SmolLM2 stream's gaps while ``busy`` reads ``prompts`` 2,048-token prompts one after another, and their
    speed."""
    times: list[float] = []
    read: list[tuple[int, float]] = []  # (prompt tokens, seconds) of each prompt
    texts = long_prompts(prompts)  # before the stream: the first call loads a tokenizer in this process
    started, done, ended = threading.Event(), threading.Event(), threading.Event()
    body = {"model": STREAM_MODEL, "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "ignore_eos": True}
    reader = threading.Thread(target=stream_until, args=(url, body, times, started, done, ended))
    reader.start()
    if not started.wait(120):
        raise RuntimeError("the stream did not start")
    for prompt in texts:
        sent = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json={"model": busy, "prompt": prompt, "max_tokens": 1}, timeout=600)
        r.raise_for_status()
        read.append((r.json()["usage"]["prompt_tokens"], time.perf_counter() - sent))
    done.set()
    reader.join()
    if ended.is_set():
        raise RuntimeError("the stream ended before the prompts did: make STREAM_TOKENS larger")
    return {
        **gap_figures([b - a for a, b in zip(times, times[1:])]),
        "stream_tok_s": round((len(times) - 1) / (times[-1] - times[0]), 1),
        "prompt_tok_s": round(sum(n for n, _ in read) / sum(s for _, s in read), 1),
    }


def gap_figures(gaps: list[float]) -> dict:
    """A stream's gaps between tokens (seconds): median, 99th percentile and largest, in ms."""
    gaps = sorted(gaps)
    return {
        "gap_median_ms": round(statistics.median(gaps) * 1e3, 1),
        "gap_p99_ms": round(gaps[int(0.99 * (len(gaps) - 1))] * 1e3, 1),
        "gap_largest_ms": round(gaps[-1] * 1e3, 1),
    }


def stream_until(url: str, body: dict, times: list[float], started: threading.Event, done: threading.Event, ended):
    """Stream a completion (``body``), each token's arrival in ``times``, until ``done``; ``started`` set at its
    first token, ``ended`` where the stream ended first."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if done.is_set():
                return
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                started.set()
    ended.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", help="the model that takes the long prompts")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (with router mode)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=1, help="long prompts a round, one after another")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    busy = Path(args.gguf).stem
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as folder:
            directory = Path(folder)
            os.symlink(default_model_path(), directory / f"{STREAM_MODEL}.gguf")
            os.symlink(Path(args.gguf).resolve(), directory / Path(args.gguf).name)
            systems = {"wsgi-infer": functools.partial(ours, directory, preload=f"{STREAM_MODEL},{busy}")}
            if args.llama_server:
                systems["llama-server"] = functools.partial(llama_router, args.llama_server, directory)
            for name, launch in systems.items():
                results.setdefault(name, []).append(on_fresh_server(launch, functools.partial(warm_then, busy, args)))
                print(name, json.dumps(results[name][-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def warm_then(busy: str, args: argparse.Namespace, url: str) -> dict:
    for model in (STREAM_MODEL, busy):  # both loaded and warm
        first_token(url, model)
    return beside_prompts(url, busy, args.prompts)


def on_fresh_server(launch, measure) -> dict:
    """``measure(url)`` on a server ``launch()`` starts, stopped after it."""
    process, url = launch()
    try:
        return measure(url)
    finally:
        process.terminate()
        process.wait(60)


if __name__ == "__main__":
    main()
