"""Prometheus metrics, named like vLLM's with our prefix.

Under gunicorn with several workers, ``PROMETHEUS_MULTIPROC_DIR`` (set by
``gunicorn.config`` in the master, before the workers start) switches prometheus_client to its
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

_LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_MODEL = ("model_name",)  # every series carries it, as vLLM's do


def _gauge(name: str, doc: str, mode: str) -> Gauge:
    return Gauge(f"wsgi_infer:{name}", doc, _MODEL, multiprocess_mode=mode)


def _histogram(name: str, doc: str, buckets: tuple) -> Histogram:
    return Histogram(f"wsgi_infer:{name}", doc, _MODEL, buckets=buckets)


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(f"wsgi_infer:{name}", doc, _MODEL + labels)


_FAMILIES = {
    "num_requests_running": _gauge("num_requests_running", "Requests in the running batch", "livesum"),
    "num_requests_waiting": _gauge("num_requests_waiting", "Requests waiting to be scheduled", "livesum"),
    "kv_cache_usage_perc": _gauge(
        "kv_cache_usage_perc", "Fraction of KV blocks in use (the fullest worker)", "livemax"
    ),
    "kv_blocks_free": _gauge("kv_blocks_free", "KV blocks no request holds", "livesum"),
    "kv_blocks_total": _gauge("kv_blocks_total", "KV blocks in the cache", "livesum"),
    "greenlets": _gauge(
        "greenlets", "Request greenlets: one per open connection, stream pump and Redis mirror", "livesum"
    ),
    "http_connections": _gauge("http_connections", "Open client connections (one greenlet each)", "livesum"),
    "http_connections_refused": _counter(
        "http_connections_refused", "Connections answered 503 because the worker held worker_connections"
    ),
    "open_streams": _gauge("open_streams", "Requests with an open response stream", "livesum"),
    "streams_unmirrored": _gauge(
        "streams_unmirrored", "Streams whose copy in Redis is not complete (running, or waiting for Redis)", "livesum"
    ),
    "time_to_first_token": _histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS),
    "inter_token_latency": _histogram("inter_token_latency_seconds", "Time between tokens", _LATENCY_BUCKETS),
    "e2e_request_latency": _histogram(
        "e2e_request_latency_seconds", "Request latency from arrival to last token", _LATENCY_BUCKETS
    ),
    "request_queue_time": _histogram(
        "request_queue_time_seconds", "Time a request waited before its first step", _LATENCY_BUCKETS
    ),
    "request_prefill_time": _histogram(
        "request_prefill_time_seconds", "Time to first token less the queue time", _LATENCY_BUCKETS
    ),
    "request_decode_time": _histogram(
        "request_decode_time_seconds", "Time from a request's first token to its last", _LATENCY_BUCKETS
    ),
    "request_inference_time": _histogram(
        "request_inference_time_seconds", "Prefill and decode time of a request", _LATENCY_BUCKETS
    ),
    "request_time_per_output_token": _histogram(
        "request_time_per_output_token_seconds",
        "A request's decode time over its tokens after the first",
        _LATENCY_BUCKETS,
    ),
    "request_prompt_tokens": _histogram("request_prompt_tokens", "Prompt tokens per finished request", _TOKEN_BUCKETS),
    "request_generation_tokens": _histogram(
        "request_generation_tokens", "Generated tokens per finished request", _TOKEN_BUCKETS
    ),
    "iteration_tokens": _histogram("iteration_tokens_total", "Tokens computed per engine step", _TOKEN_BUCKETS),
    "prompt_tokens": _counter("prompt_tokens", "Prompt tokens processed"),
    "generation_tokens": _counter("generation_tokens", "Tokens generated"),
    "prefix_cache_queries": _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": _counter("prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache"),
    "num_preemptions": _counter("num_preemptions", "Sequences preempted for lack of KV blocks"),
    "spec_decode_num_drafts": _counter("spec_decode_num_drafts", "Speculative drafts verified"),
    "spec_decode_num_draft_tokens": _counter("spec_decode_num_draft_tokens", "Draft tokens verified"),
    "spec_decode_num_accepted_tokens": _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
}
_FAMILIES["requests_refused"] = _counter(
    "requests_refused", "Requests refused (429) with every running and waiting place taken (max_waiting_requests)"
)
_FAMILIES.update(
    model_loaded=_gauge("model_loaded", "1 while the model is loaded (summed over workers)", "livesum"),
    model_loads=_counter("model_loads", "Loads of the model that succeeded"),
    model_load_seconds=_histogram("model_load_seconds", "Time from a load's start to the model serving", _LOAD_BUCKETS),
)
_FAMILIES.update(
    external_prefix_cache_queries=_counter("external_prefix_cache_queries", "Prompt tokens looked up in the KV store"),
    external_prefix_cache_hits=_counter("external_prefix_cache_hits", "Prompt tokens whose KV came from the KV store"),
    kv_store_degraded=_gauge("kv_store_degraded", "1 while a worker cannot write to the KV store", "livemax"),
)
# The KV store's own counters (``StoreCounters``), each this worker's, as kv_store_<name>.
STORE_COUNTERS = {
    "bytes_read": "Bytes of KV blocks read from the KV store",
    "bytes_written": "Bytes of KV blocks written to the KV store",
    "evicted_blocks": "KV store blocks removed, least recently used first, to keep within its size limit",
    "corrupt_blocks": "KV store blocks removed as truncated, foreign or failing their checksum (each a miss)",
    "read_errors": "KV store reads that failed (each a miss)",
    "write_errors": "KV store writes that failed: a full disk, a read-only or vanished directory",
    "dropped_blocks": "KV blocks not written because the writer was too far behind",
}
_FAMILIES.update({f"kv_store_{name}": _counter(f"kv_store_{name}", doc) for name, doc in STORE_COUNTERS.items()})
_MODEL_UNLOADS = _counter("model_unloads", "Unloads of the model, by reason: idle, memory, admin", ("reason",))
_STREAMS_CONTINUED = _counter(
    "streams_continued",
    "Streams whose host died, continued here when a client resumed them, by outcome: continued; failed (the "
    "request could not run here); diverged (the run here wrote other events than the client had)",
    ("outcome",),
)
_REQUEST_SUCCESS = _counter("request_success", "Finished requests", ("finished_reason",))
FINISHED_REASONS = ("stop", "length", "abort", "error")  # each series there from the start, at 0, as vLLM's are
# Per API key, by its id (a keys-file table's name, or a hash's first digits: never the key).
_KEY_COUNTERS = {
    "requests": _counter("key_requests", "A key's requests admitted", ("key",)),
    "prompt_tokens": _counter("key_prompt_tokens", "Prompt tokens of a key's requests", ("key",)),
    "generation_tokens": _counter("key_generation_tokens", "Tokens generated for a key", ("key",)),
}
_KEY_RATE_LIMITED = _counter("key_rate_limited", "A key's requests refused (429), by the limit", ("key", "limit"))
_ACCEPTED_PER_POSITION = _counter(
    "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position", ("position",)
)


class ModelMetrics:
    """Every series of one served model, its ``model_name`` label bound: ``m.prompt_tokens.inc(n)``."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self._series = {name: family.labels(model_name) for name, family in _FAMILIES.items()}
        for reason in FINISHED_REASONS:
            self.request_success(reason)

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_series"][name]
        except KeyError:
            raise AttributeError(name) from None

    def request_success(self, finished_reason: str) -> Counter:
        return _REQUEST_SUCCESS.labels(self._model_name, finished_reason)

    def streams_continued(self, outcome: str) -> Counter:
        return _STREAMS_CONTINUED.labels(self._model_name, outcome)

    def model_unloads(self, reason: str) -> Counter:
        return _MODEL_UNLOADS.labels(self._model_name, reason)

    def of_key(self, name: str, key: str) -> Counter:
        """A key's ``requests``, ``prompt_tokens`` or ``generation_tokens``."""
        return _KEY_COUNTERS[name].labels(self._model_name, key)

    def key_rate_limited(self, key: str, limit: str) -> Counter:
        return _KEY_RATE_LIMITED.labels(self._model_name, key, limit)

    def accepted_at(self, position: int) -> Counter:
        return _ACCEPTED_PER_POSITION.labels(self._model_name, str(position))


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
