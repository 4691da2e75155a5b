"""Streams beside a long prompt on the same model, with no API keys: a new request's 2,048-token prompt arrives
while ``--streams`` others decode, after ``--turns`` short requests, one after another (a chat server's traffic).
Ours (its prompt paced to the step time, at least ``MIN_PREFILL_CHUNK`` tokens a step), ours reading whole chunks
(``WSGI_INFER_MIN_PREFILL_CHUNK=512``: how it scheduled before) and llama-server (a slot per request), a fresh
server a round, the systems alternating, speculation off.

    .venv/bin/python scripts/bench_prompt_beside_streams.py --llama-server llama.cpp/build/bin/llama-server \\
        --rounds 2 shaped-1b-Q4_K_M.gguf

Per system and round: the prompt's time to its one token, the streams' gaps between tokens while it was read
(median, 99th percentile, largest, over every stream) and the tokens they got a second meanwhile.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model_prefills import gap_figures, on_fresh_server, stream_until  # noqa: E402
from long_prompts import long_prompts  # noqa: E402
from serve_processes import start_llama_server, start_server  # noqa: E402

from wsgi_infer.engine.loading.model_paths import default_model_path  # noqa: E402

STREAM_TOKENS = 1000  # more than a stream gets while the prompt is read; 4 and the prompt fit a 1B's default cache


def beside_streams(url: str, model: str, streams: int, turns: int, prompt: str) -> dict:
    """``streams`` streams (EOS ignored), ``turns`` short requests once every one has sent a token, then ``prompt``:
    its time and theirs."""
    done, arrivals, readers, starts = threading.Event(), [], [], []
    for i in range(streams):
        times, started, ended = [], threading.Event(), threading.Event()
        body = {"model": model, "prompt": f"Story {i}. Once upon a time", "max_tokens": STREAM_TOKENS}
        body |= {"ignore_eos": True, "temperature": 0}
        reader = threading.Thread(target=stream_until, args=(url, body, times, started, done, ended))
        reader.start()
        arrivals.append(times), readers.append(reader), starts.append(started)
    if not all(started.wait(300) for started in starts):
        raise RuntimeError("a stream did not start")
    time.sleep(1.0)  # the streams decode steadily first
    for turn in range(turns):
        body = {"model": model, "prompt": f"Question {turn}: what is {turn} plus {turn}?", "max_tokens": 1}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    sent = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}, timeout=600)
    answered = time.perf_counter()
    deadline = answered + 60
    while time.perf_counter() < deadline and not all(times and times[-1] > answered for times in arrivals):
        time.sleep(0.01)  # each stream's first token after the answer ends its gap across the prompt
    done.set()
    for reader in readers:
        reader.join()
    r.raise_for_status()
    window = [[t for t in times if sent <= t <= answered] for times in arrivals]
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b >= sent and a <= answered]
    return {
        "prompt_s": round(answered - sent, 2),
        "prompt_tokens": r.json()["usage"]["prompt_tokens"],
        **gap_figures(gaps),
        "streams_tok_s": round(sum(map(len, window)) / (answered - sent), 1),
    }


def served_beside_streams(streams: int, turns: int, prompt: str, url: str) -> dict:
    """``beside_streams`` on the model the server at ``url`` serves first."""
    return beside_streams(url, httpx.get(f"{url}/v1/models").json()["data"][0]["id"], streams, turns, prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="?", default=str(default_model_path()), help="default: the shipped model")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--turns", type=int, default=16, help="short requests before the long prompt")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    model = str(Path(args.gguf).resolve())
    launch = Namespace(model=model, dtype="auto", quantization="auto", server_log=False, peer_model=None)
    launch.llama_server, launch.concurrency, launch.workload = args.llama_server, [args.streams + 1], "long"
    launch.prompt_tokens, launch.output_len = 2048, STREAM_TOKENS
    speculation_off = {"WSGI_INFER_SPECULATIVE": "none"}
    systems = {
        "wsgi-infer": lambda: start_server(launch, env=speculation_off),
        "wsgi-infer, whole chunks": lambda: start_server(
            launch, env={**speculation_off, "WSGI_INFER_MIN_PREFILL_CHUNK": "512"}
        ),
    }
    if args.llama_server:
        systems["llama-server"] = lambda: start_llama_server(launch)
    results: dict[str, list[dict]] = {}
    prompts = iter(long_prompts(args.rounds * len(systems)))  # each new to its server's cache
    for _ in range(args.rounds):
        for name, start in systems.items():
            measure = functools.partial(served_beside_streams, args.streams, args.turns, next(prompts))
            results.setdefault(name, []).append(on_fresh_server(start, measure))
            print(name, json.dumps(results[name][-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
