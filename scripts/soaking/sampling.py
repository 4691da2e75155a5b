"""What the soak watches on the server while the load runs, and the idle state it waits for at the end."""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict

import httpx
import psutil

from tests.support.server import GunicornServer

from .streams import Stats, percentile

GAUGES = ("kv_blocks_total", "kv_blocks_free", "num_requests_running", "num_requests_waiting", "open_streams")
COUNTERS = ("model_loads_total", "num_preemptions_total")
GREENLETS = "greenlets"  # a gauge the server may not export yet: then None in every sample


def read_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Our gauges and counters from /metrics by short name, each summed over its label sets (every model's)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {f"wsgi_infer:{name}": name for name in (*GAUGES, *COUNTERS, GREENLETS)}
    values: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=timeout).text):
        for sample in family.samples:
            if sample.name in wanted:
                values[wanted[sample.name]] += sample.value
    return dict(values)


def loaded_models(url: str, timeout: float = 10.0) -> list[str]:
    """The models that are loaded or loading, from /v1/models."""
    listed = httpx.get(f"{url}/v1/models", timeout=timeout).json()["data"]
    return sorted(f"{m['id']}:{m['state']}" for m in listed if m["state"] != "unloaded")


def blocks_in_use(metrics: dict[str, float]) -> float | None:
    if "kv_blocks_total" not in metrics or "kv_blocks_free" not in metrics:
        return None
    return metrics["kv_blocks_total"] - metrics["kv_blocks_free"]


def process_usage(pids: list[int]) -> tuple[int, int, int]:
    """RSS bytes, open fds and threads summed over the processes (one that just exited counts nothing)."""
    rss = fds = threads = 0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            rss += process.memory_info().rss
            fds += process.num_fds()
            threads += process.num_threads()
        except psutil.NoSuchProcess:
            continue
    return rss, fds, threads


class Sampler(threading.Thread):
    """Every ``every`` seconds: the workers' RSS, fds and threads, the models loaded, the server's gauges, this
    window's p99 ITL."""

    def __init__(self, server: GunicornServer, stats: Stats, every: float, t0: float) -> None:
        super().__init__(name="sampler", daemon=True)
        self.server, self.stats, self.every, self.t0 = server, stats, every, t0
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.phase = "load"  # then "reload", "load", "last_requests" and "idle", as soak() moves on

    def run(self) -> None:
        # On a fixed grid: a slow sample (the reload holds new connections) delays no later one.
        due = self.t0 + self.every
        while not self.stop.wait(max(0.0, due - time.monotonic())):
            self.samples.append(self.sample())
            due += self.every * max(1, math.ceil((time.monotonic() - due) / self.every))

    def sample(self) -> dict:
        pids = sorted(self.server.worker_pids())  # read each time: the reload replaces the workers
        rss, fds, threads = process_usage(pids)
        try:
            metrics, models = read_metrics(self.server.url, self.every), loaded_models(self.server.url, self.every)
            metrics_error = None
        except httpx.HTTPError as exc:
            metrics, models, metrics_error = {}, None, repr(exc)
        window = self.stats.take_window()
        done, failed = self.stats.totals()
        return {
            "t": round(time.monotonic() - self.t0, 3),
            "phase": self.phase,
            "worker_pids": pids,
            "models": models,
            "rss_bytes": rss,
            "open_fds": fds,
            "threads": threads,
            "greenlets": metrics.get(GREENLETS),
            "kv_blocks_in_use": blocks_in_use(metrics),
            "model_loads": metrics.get("model_loads_total"),
            "preemptions": metrics.get("num_preemptions_total"),
            "requests_running": metrics.get("num_requests_running"),
            "requests_waiting": metrics.get("num_requests_waiting"),
            "open_streams": metrics.get("open_streams"),
            "p99_itl_s": percentile(window, 99),
            "itl_gaps": len(window),
            "requests_done": done,
            "failures": failed,
            "metrics_error": metrics_error,
        }


def wait_idle(url: str, timeout: float) -> dict:
    """Poll /metrics until no KV block is in use and nothing runs, waits or streams (or the deadline)."""
    start = time.monotonic()
    while True:
        metrics = read_metrics(url)
        state = {
            "kv_blocks_in_use": blocks_in_use(metrics),
            "kv_blocks_total": metrics.get("kv_blocks_total"),
            "requests_running": metrics.get("num_requests_running"),
            "requests_waiting": metrics.get("num_requests_waiting"),
            "open_streams": metrics.get("open_streams"),
        }
        idle = all(state[k] == 0 for k in state if k != "kv_blocks_total")
        state["greenlets"] = metrics.get(GREENLETS)  # reported, not waited for: /metrics itself runs in one
        if idle or time.monotonic() - start > timeout:
            return {**state, "idle": idle, "waited_s": round(time.monotonic() - start, 3)}
        time.sleep(0.2)  # the next poll of the metric
