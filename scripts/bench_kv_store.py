#!/usr/bin/env python
"""The KV store (issue 54): a prompt's first token cold, warm in the worker's memory, from the store after a
restart, and from the store in a second worker that never saw it; beside them, what a lookup costs a prompt that
is not there, and a block's read against its computation.

    .venv/bin/python scripts/bench_kv_store.py --json kv_store.json                       # the shipped 135M
    .venv/bin/python scripts/bench_kv_store.py --model /work/shaped/shaped-1b-Q4_K_M.gguf  # the 1B shape

Per prompt length (512 and 2,048 tokens, the default model's tokenizer, which the shaped models share), each
repeat with prompts new to the store (numbered first: no block is shared):
- restart: one worker on an empty store directory; TTFT cold, then the same prompt again (memory); SIGTERM (which
  writes what is queued), a new server on the directory, the same prompt (store);
- second worker: two workers; the prompt on a connection one worker holds, then (its blocks written: the files are
  counted) on one the other holds;
- miss: the standard prompts, new to the store, with the store and without it, alternated: the store's share of
  their TTFT; and in this process, what a block costs to compute, read, copy in and out, and a lookup that misses.
Streamed completions of 2 tokens, EOS kept, speculation off (it changes no first token). TTFT is the time to the
first chunk with a token. Each figure is the median over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import prompts as standard_prompts  # noqa: E402
from long_prompts import long_prompts  # noqa: E402
from serve_processes import free_port, healthy  # noqa: E402
from worker_server import Server  # noqa: E402

LENGTHS = (512, 2048)


def prompt_ids(n: int, length: int) -> list[list[int]]:
    from wsgi_infer.engine.loading.model_loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None))
    texts = long_prompts(2 * n)  # each about 2,048 tokens, never more: two make one of ``length`` exactly
    return [tokenizer(texts[2 * i] + " " + texts[2 * i + 1]).input_ids[:length] for i in range(n)]


def ttft(http: httpx.Client, ids: list[int] | str) -> tuple[float, int]:
    """Seconds to the first token of a streamed completion, and the prompt tokens the usage says were cached."""
    body = {"prompt": ids, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, cached = time.perf_counter(), None, None
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - sent
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


def restart_run(model: str | None, length: int, ids: list[int]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as store:
        server = Server(model, Path(store))
        with httpx.Client(base_url=server.url, timeout=600) as http:
            cold, _ = ttft(http, ids)
            memory, cached_memory = ttft(http, ids)
        server.stop()
        server = Server(model, Path(store))
        with httpx.Client(base_url=server.url, timeout=600) as http:
            stored, cached_store = ttft(http, ids)
        server.stop()
    assert cached_memory == cached_store == (length - 1) // 16 * 16, (cached_memory, cached_store)
    return {"cold": cold, "memory": memory, "store_after_restart": stored}


def second_worker_run(model: str | None, length: int, ids: list[int]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as store:
        server = Server(model, Path(store), workers=2)
        first, pid = server.client_on(None)
        second, _ = server.client_on(pid)
        cold, _ = ttft(first, ids)
        deadline = time.monotonic() + 120
        while len(list(Path(store).rglob("*.kv"))) < length // 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        stored, cached = ttft(second, ids)
        first.close(), second.close()
        server.stop()
    assert cached == (length - 1) // 16 * 16, cached
    return {"cold_2_workers": cold, "store_other_worker": stored}


def miss_run(model: str | None, texts: list[str]) -> dict[str, float]:
    """The standard prompts (``bench_engine``: about 36 tokens, each new), alternately to a server with the store
    and one without, both warmed up: what the lookup (and the writes) cost a prompt the store does not have."""
    with tempfile.TemporaryDirectory() as store:
        servers = {"with": Server(model, Path(store)), "without": Server(model, None)}
        times: dict[str, list[float]] = {"with": [], "without": []}
        clients = {k: httpx.Client(base_url=s.url, timeout=600) for k, s in servers.items()}
        for k in clients:
            ttft(clients[k], "warm-up " + texts[0])
        for i, text in enumerate(texts):
            for k in ("with", "without") if i % 2 else ("without", "with"):
                times[k].append(ttft(clients[k], text)[0])
        for k, s in servers.items():
            clients[k].close()
            s.stop()
    return {f"miss_{k}_store": statistics.median(v) for k, v in times.items()}


def miss_in_process(model: str | None, texts: list[str]) -> dict[str, float]:
    """The same prompts in this process, alternately to an engine with the store and one without (one token
    each): the engine's own share, without two servers' differences."""
    from wsgi_infer import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as store:
        engines = {
            "with": LLM(model=model, kv_store_dir=store, speculative="none"),
            "without": LLM(model=model, speculative="none"),
        }
        one = SamplingParams(max_tokens=1)
        for engine in engines.values():
            engine.generate("warm-up " + texts[0], one)
        times: dict[str, list[float]] = {"with": [], "without": []}
        for i, text in enumerate(texts):
            for k in ("with", "without") if i % 2 else ("without", "with"):
                started = time.perf_counter()
                engines[k].generate(text, one)
                times[k].append(time.perf_counter() - started)
        engines["with"].engine.close(wait=True)
    summary = {f"{k}_store_median": statistics.median(v) for k, v in times.items()}
    return summary | {f"{k}_store_mean": statistics.mean(v) for k, v in times.items()}


def llama_ttft(url: str, ids: list[int]) -> tuple[float, int]:
    """llama-server's first token of the prompt in slot 0, and the prompt tokens it computed."""
    body = {"prompt": ids, "n_predict": 2, "stream": True, "id_slot": 0, "cache_prompt": True}
    sent, first, computed = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                first = first or time.perf_counter() - sent
                computed = chunk.get("timings", {}).get("prompt_n", computed)
    return first, computed


def llama_run(binary: str, model: str | None, ids: list[int]) -> dict[str, float]:
    """llama-server with --slot-save-path: the prompt cold, its slot saved, a restart, the slot restored (as a
    client must ask), the prompt again."""
    from wsgi_infer.engine.loading.model_paths import model_path

    with tempfile.TemporaryDirectory() as slots:

        def start() -> tuple[subprocess.Popen, str]:
            port = free_port()
            command = [binary, "-m", str(model_path(model)), "--slot-save-path", slots, "-c", "4096", "-np", "1"]
            command += ["-t", str(os.cpu_count()), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return process, healthy(process, f"http://127.0.0.1:{port}", command)

        process, url = start()
        cold, _ = llama_ttft(url, ids)
        httpx.post(f"{url}/slots/0?action=save", json={"filename": "prompt.bin"}, timeout=600).raise_for_status()
        process.terminate(), process.wait(60)
        process, url = start()
        started = time.perf_counter()
        httpx.post(f"{url}/slots/0?action=restore", json={"filename": "prompt.bin"}, timeout=600).raise_for_status()
        restore = time.perf_counter() - started
        warm, computed = llama_ttft(url, ids)
        process.terminate(), process.wait(60)
    return {"llama_cold": cold, "llama_restore": restore, "llama_restored_ttft": warm, "llama_computed": computed}


def block_costs(model: str | None, ids: list[int], misses: int = 10_000) -> dict[str, float]:
    """In this process: a block's prefill (a cold prompt's time over its blocks) against its read from the store
    (read, checked, copied into the cache), its copy out of the cache and its write; a lookup that misses."""
    from wsgi_infer import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as store:
        llm = LLM(model=model, kv_store_dir=store, speculative="none")
        started = time.perf_counter()
        llm.generate(ids, SamplingParams(max_tokens=1))
        prefill = time.perf_counter() - started
        llm.engine.close(wait=True)
        tier, bs = llm.engine.store, llm.engine.kv_cache.block_size
        keys = _hashes(llm, ids)[: len(ids) // bs]
        started = time.perf_counter()
        payloads = [tier._read(key) for key in keys]
        read = time.perf_counter() - started
        started = time.perf_counter()
        for block_id, payload in enumerate(payloads):
            for group in range(len(tier.blocks.group_caches)):
                tier.blocks.write(group, block_id, payload)
        copy_in = time.perf_counter() - started
        started = time.perf_counter()
        for block_id in range(len(keys)):
            tier.blocks.read([block_id] * len(tier.blocks.group_caches))
        copy_out = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(misses):
            tier.store.contains(tier.namespace, i.to_bytes(16, "little"))
        lookup = (time.perf_counter() - started) / misses
    n = len(keys)
    return {
        "block_bytes": tier.blocks.payload_nbytes,
        "prefill_per_block": prefill / n,
        "read_per_block": read / n,
        "copy_in_per_block": copy_in / n,
        "copy_out_per_block": copy_out / n,
        "lookup_miss": lookup,
    }


def _hashes(llm, ids: list[int]) -> list[bytes]:
    from wsgi_infer import SamplingParams
    from wsgi_infer.engine.scheduling.sequence import Sequence

    seq = Sequence("hashes", ids, SamplingParams(), 1)
    llm.engine.kv_cache.update_block_hashes(seq)
    return seq.block_hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF or directory (default: the shipped SmolLM2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--misses", type=int, default=60, help="prompts of the miss phase")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary: its slot save and restore beside")
    args = parser.parse_args()
    cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    results: dict = {"model": args.model or "SmolLM2-135M-Instruct (shipped)", "cpu": cpu, "date": time.strftime("%F")}
    for length in LENGTHS:
        runs = []
        for ids in prompt_ids(args.repeats, length):
            run = restart_run(args.model, length, ids)
            run.update(second_worker_run(args.model, length, prompt_ids(1, length)[0]))
            if args.llama_server:
                run.update(llama_run(args.llama_server, args.model, prompt_ids(1, length)[0]))
            print(length, {k: round(v, 3) for k, v in run.items()}, flush=True)
            runs.append(run)
        summary = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        summary["store_share_of_cold"] = summary["store_after_restart"] / summary["cold"]
        summary["other_worker_share_of_cold"] = summary["store_other_worker"] / summary["cold_2_workers"]
        results[length] = summary
    results["blocks"] = block_costs(args.model, prompt_ids(1, 2048)[0])
    print(results["blocks"], flush=True)
    results["miss"] = miss_run(args.model, standard_prompts(args.misses))
    results["miss"]["lookup_share"] = results["miss"]["miss_with_store"] / results["miss"]["miss_without_store"] - 1
    results["miss"]["in_process"] = miss_in_process(args.model, standard_prompts(args.misses))
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
