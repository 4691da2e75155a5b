"""Prometheus metrics, named like vLLM's with our prefix.

Under gunicorn with several workers, ``PROMETHEUS_MULTIPROC_DIR`` (set by
``gunicorn_config`` in the master, before the workers start) switches prometheus_client to its
multiprocess mode: each worker writes its own files and ``/metrics`` sums the
live workers. All updates happen in the hub, never on the engine thread.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)

num_requests_running = Gauge(
    "wsgi_infer:num_requests_running", "Requests in the running batch", multiprocess_mode="livesum"
)
num_requests_waiting = Gauge(
    "wsgi_infer:num_requests_waiting", "Requests waiting to be scheduled", multiprocess_mode="livesum"
)
kv_cache_usage_perc = Gauge(
    "wsgi_infer:kv_cache_usage_perc", "Fraction of KV blocks in use (the fullest worker)", multiprocess_mode="livemax"
)
kv_blocks_free = Gauge("wsgi_infer:kv_blocks_free", "KV blocks no request holds", multiprocess_mode="livesum")
kv_blocks_total = Gauge("wsgi_infer:kv_blocks_total", "KV blocks in the cache", multiprocess_mode="livesum")
open_streams = Gauge("wsgi_infer:open_streams", "Requests with an open response stream", multiprocess_mode="livesum")
time_to_first_token = Histogram(
    "wsgi_infer:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS
)
inter_token_latency = Histogram(
    "wsgi_infer:inter_token_latency_seconds", "Time between tokens of a request", buckets=_LATENCY_BUCKETS
)
e2e_request_latency = Histogram(
    "wsgi_infer:e2e_request_latency_seconds", "Request latency from arrival to last token", buckets=_LATENCY_BUCKETS
)
request_success = Counter("wsgi_infer:request_success", "Finished requests", ["finished_reason"])
prompt_tokens = Counter("wsgi_infer:prompt_tokens", "Prompt tokens processed")
prefix_cache_hits = Counter("wsgi_infer:prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache")
generation_tokens = Counter("wsgi_infer:generation_tokens", "Tokens generated")


def render() -> tuple[bytes, str]:
    """The exposition text of this process, or of every live worker in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def mark_worker_dead(pid: int) -> None:
    """Drop a dead worker's live gauges (gunicorn's child_exit)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(pid)
