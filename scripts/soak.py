#!/usr/bin/env python
"""Soak test: mixed load on a real gunicorn for a chosen duration, with one SIGHUP reload half way, and with
several models, models loading and unloading all along (churn).

Starts `gunicorn -c gunicorn.conf.py` itself (tests/support/server.py's GunicornServer) and runs --concurrency
client loops, each drawing at random (seeded, so a run repeats) a model among those in use and a request:
greedy /v1/completions and /v1/chat/completions, streamed or not, of 1 to 1,000 tokens (log-uniform, so short
ones dominate); sampled requests with n = 2..4; streams cut after k events, some of them resumed with
GET /v1/streams/<id> and Last-Event-ID; a JSON schema's structured output; a forced tool call; bad bodies that
must get a 4xx JSON error; and, to an embedding model, embeddings of 1 to 4 inputs. Every greedy text is compared
with its reference: each prompt is generated once before the load with logprobs, and the text of L tokens is the
reference's first L token texts (less a trailing incomplete character, which the server holds back; special
tokens add no text); structured outputs, tool calls and each input's embedding equal their reference's whole.
The server runs in float32 by default: in bf16 on the CPU a request's greedy output changes with the batch it
shares (and with a prefix-cache hit), so no reference would hold. Half way it sends SIGHUP to the master and waits
for the new worker's log lines and for the old worker's exit.

With several --model and --max-loaded-models below their number, the clients send to that many models at a time,
the window moving one model along every --churn-seconds, so that models load and unload all through the run (a
request for a model waiting for room gets the documented 503 with Retry-After, and is sent again); each model's
references then come from a server of its own, started before the load with the same settings.

Every --sample-every seconds it records the workers' RSS, open fds and threads (summed), the models loaded, the
`wsgi_infer:greenlets` gauge, KV blocks in use, the models' loads and the client-side p99 inter-token latency of
that window. At the end it stops the load, waits (polling /metrics, with a deadline) for every KV block to be free
and no request to be running or waiting, stops the server, and writes OUT/soak.json, OUT/soak.png and
OUT/server.log. The 30-minute run of the default model (a KV cache that holds the load without thrashing
preemptions, and the 5% bound on RSS and fd drift):

    .venv/bin/python scripts/soak.py --duration 1800 --kv-cache-mb 1024 --max-drift 0.05 --out soak-out

and with models coming and going (docs/benchmarks/reliability.md has its figures and the paths):

    .venv/bin/python scripts/soak.py --duration 1800 --model SMOLLM2 --model GEMMA3_GGUF --model MINILM_DIR \
        --max-loaded-models 2 --churn-seconds 8 --max-drift 0.1 --out churn-out

Exit status 1 on any 5xx, hung client, mismatch, other failed check, KV blocks not back to idle, or more threads
once idle than under load; also on RSS or fd drift (within one set of loaded models) above --max-drift when given,
and, churning, on fewer loads than half the window's moves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from soaking.clients import ClientLoop, LoadContext  # noqa: E402
from soaking.references import MAX_LENGTH, ModelReferences, model_references  # noqa: E402
from soaking.report import plot, summarize  # noqa: E402
from soaking.sampling import Sampler, wait_idle  # noqa: E402
from soaking.streams import Stats  # noqa: E402

from tests.support.server import GunicornServer  # noqa: E402

IDLE_TIMEOUT_S = 60.0  # a cut stream nobody resumes is aborted after one heartbeat interval


def references(server: GunicornServer) -> list[ModelReferences]:
    """Every model's references, from ``server`` (one model, loaded)."""
    with server.client(timeout=600) as http:
        described = http.get("/v1/models").json()["data"]
        parallel = 1
        if any(model["task"] == "generate" for model in described):
            # As many at once as the KV cache holds: more would only be preempted, over and over.
            blocks, block_size = server.wait_for_log(r"KV cache: (\d+) blocks of (\d+) tokens").groups()
            parallel = max(1, min(int(blocks) * int(block_size) // (MAX_LENGTH + 64), 16))
        return [model_references(http, model, parallel) for model in described]


def own_references(settings: dict, models: list[str]) -> list[ModelReferences]:
    """Each model's references from a server of its own, the soak's settings besides: the servers started and
    asked side by side."""
    with ExitStack() as stack:
        servers = []
        for model in models:
            server = GunicornServer({**settings, "model": model}, "--access-logfile", "/dev/null")
            stack.callback(server.stop)
            servers.append(server)
        with ThreadPoolExecutor(len(servers)) as pool:
            answers = list(pool.map(lambda server: references(server.wait_ready()), servers))
            list(pool.map(GunicornServer.stop, servers))  # each stop waits for its drain: side by side too
        return [refs for model_refs in answers for refs in model_refs]


def reload_once(server: GunicornServer, ctx: LoadContext, t0: float) -> dict:
    """SIGHUP to the master, then wait for the new worker's engine-ready log line and the old worker's exit."""
    old = server.worker_pids()
    old_processes = [psutil.Process(pid) for pid in old]
    after = len(server.lines)
    ctx.reload_sent_at = sent = time.monotonic()
    os.kill(server.process.pid, signal.SIGHUP)
    report = {"sent_at_s": round(sent - t0, 3), "old_pids": old, "new_pids": [], "error": None}
    try:
        report["new_pids"] = server.wait_booted(after=after)
        report["new_worker_ready_after_s"] = round(time.monotonic() - sent, 3)
    except AssertionError as exc:
        report["error"] = f"no new worker became ready: {exc}"
    _, alive = psutil.wait_procs(old_processes, timeout=120)
    ctx.reload_done_at = None if alive else time.monotonic()
    report["old_pids_alive"] = [p.pid for p in alive]
    report["old_exited_after_s"] = None if alive else round(time.monotonic() - sent, 3)
    return report


def join_loops(loops: list[ClientLoop], stats: Stats, timeout: float) -> None:
    """Each loop ends after its current request; one still busy after ``timeout`` is a hung client."""
    deadline = time.monotonic() + timeout
    for loop in loops:
        loop.join(max(0.0, deadline - time.monotonic()))
        if loop.is_alive():
            stats.fail(loop.kind, "hung", f"{loop.name} still in {loop.current} {timeout:.0f} s after the end")


def soak(server: GunicornServer, refs: list[ModelReferences], args: argparse.Namespace) -> dict:
    """The load with its sampler and the reload half way, then the idle check."""
    in_use = min(args.max_loaded_models or len(refs), len(refs))
    ctx = LoadContext(server.url, refs, Stats(), threading.Event(), args.request_timeout, args.seed, in_use, 0.0)
    if in_use < len(refs):
        ctx.churn_seconds = args.churn_seconds
    t0 = ctx.started = time.monotonic()
    sampler = Sampler(server, ctx.stats, args.sample_every, t0)
    loops = [ClientLoop(i, ctx) for i in range(args.concurrency)]
    for thread in (sampler, *loops):
        thread.start()
    time.sleep(args.duration / 2)  # the schedule: the reload comes half way
    sampler.phase = "reload"
    reload = reload_once(server, ctx, t0)
    sampler.phase = "load"
    time.sleep(max(0.0, t0 + args.duration - time.monotonic()))
    ctx.stop.set()
    sampler.phase = "last_requests"
    stopped = time.monotonic()
    in_flight = [f"{loop.kind}: {loop.current}" for loop in loops]  # what the last phase waits for
    join_loops(loops, ctx.stats, args.request_timeout + 30)
    joined = time.monotonic()
    final = wait_idle(server.url, IDLE_TIMEOUT_S)
    sampler.stop.set()
    sampler.join()
    sampler.phase = "idle"
    sampler.samples.append(sampler.sample())
    summary = summarize(ctx, sampler.samples, reload, final, args)
    summary["models"] = {model.name: model.task for model in refs}
    phases = {"load": stopped - t0, "last_requests": joined - stopped}
    summary["phases_s"] = {name: round(seconds, 2) for name, seconds in phases.items()}
    summary["in_flight_at_stop"] = in_flight
    return {"summary": summary, "samples": sampler.samples, "failures": ctx.stats.failures}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, required=True, help="seconds of load")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help="model directory or .gguf, once per model (default: the server's default model)",
    )
    parser.add_argument(
        "--max-loaded-models", type=int, default=0, help="the server's budget in models (0: all of them)"
    )
    parser.add_argument(
        "--churn-seconds", type=float, default=8.0, help="how long a window of models is in use, churning"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="the server's dtype; float32 by default, as greedy texts are compared with references made in "
        "another batch, and in bf16 through torch on the CPU the batch's shape changes the output",
    )
    parser.add_argument("--quantization", default="auto", help="the server's packed weights (auto, none, int4, int8)")
    parser.add_argument("--concurrency", type=int, default=8, help="client loops")
    parser.add_argument("--kv-cache-mb", type=int, default=None, help="each model's KV cache (default: its own)")
    parser.add_argument("--out", type=Path, default=Path("soak-out"), help="directory for soak.json, soak.png")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="a request still open after this long has hung (1,000 tokens of the default model in float32 take "
        "2 to 3 minutes at concurrency 8 on 2 cores)",
    )
    parser.add_argument("--max-drift", type=float, default=None, help="fail on RSS or fd drift above this (0.05)")
    parser.add_argument(
        "--max-rss-drift",
        type=float,
        default=None,
        help="RSS's own bound (default: --max-drift); a worker's memory still grows in its first minutes of churn",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' choices")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_memory_mb": args.kv_cache_mb,
    }
    settings = {name: value for name, value in settings.items() if value is not None}
    several = len(args.model) > 1
    served = {"models": ",".join(args.model), "max_loaded_models": args.max_loaded_models} if several else {}
    if len(args.model) == 1:
        served = {"model": args.model[0]}
    server = GunicornServer({**settings, **served}, "--access-logfile", "/dev/null")  # starts beside the references'
    try:
        refs = own_references(settings, args.model) if several else None
        server.wait_ready()
        report = soak(server, refs or references(server), args)
    finally:
        server.stop()
        (args.out / "server.log").write_text("\n".join(server.lines) + "\n")
    report["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    plot(report["samples"], report["summary"], args.out / "soak.png")
    print(json.dumps(report["summary"], indent=1))
    for failure in report["failures"][:20]:
        print(f"FAILED {failure['kind']} {failure['category']}: {failure['detail']}", file=sys.stderr)
    return 1 if report["summary"]["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
