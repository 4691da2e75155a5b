"""What `bench_models.py` asks of a server (ours, or llama-server's router) about one of its models: a first token,
a long stream's token times, and an unload, waited for."""

from __future__ import annotations

import json
import threading
import time

import httpx

LONG_STREAM = 1500  # tokens of the stream that runs while the other model loads (EOS ignored)


def first_token(url: str, model: str, max_tokens: int = 8) -> float:
    """Seconds from a streamed completion's request to its first text."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens, "stream": True}
    sent = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                return time.perf_counter() - sent
    raise RuntimeError(f"{model}: no text (status {r.status_code})")


def token_times(url: str, model: str, times: list[float], started: threading.Event, tokens: int = LONG_STREAM) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                started.set()


def unload(url: str, model: str) -> None:
    """Unload ``model`` once its last request has ended (ours answers 409 until then), and wait until it has."""
    deadline = time.monotonic() + 60
    while (r := httpx.post(f"{url}/models/unload", json={"model": model}, timeout=60)).status_code == 409:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    r.raise_for_status()
    while time.monotonic() < deadline and loaded(url, model):
        time.sleep(0.1)


def loaded(url: str, model: str) -> bool:
    for entry in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]:
        if entry["id"] == model:
            state = entry.get("state") or entry.get("status", {}).get("value")  # ours, llama-server's
            return state == "loaded"
    raise KeyError(model)
