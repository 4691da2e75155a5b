#!/usr/bin/env python
"""Start-up time: launch to the first 200 on /health, and where a start's time goes.

    .venv/bin/python scripts/bench_start.py --rounds 3            # first starts (empty cache), then later starts
    .venv/bin/python scripts/bench_start.py --phases               # one later start's phases, in this process
    .venv/bin/python scripts/bench_start.py --rounds 3 --floor     # and beside them, the floor (below)

A start runs `wsgi-infer serve` (the default model unless --model) on a free loopback port with its own cache
directory, polling /health every 50 ms. ``--phases`` makes the worker's calls one after another here, each timed
with perf_counter (the imports, gevent's patching, the engine's tokenizer, weights and KV cache); run it after a
start has prepared the cache it names (the model's too, with --model, a file: the engine's memory is backed
first, as ``bench_sizes.py`` backs a start's). ``--floor`` also starts, each round, gunicorn's
gevent worker on an app that only imports torch, then one that imports torch and transformers
(``start_floor_app.py``): what any server on these dependencies takes before it can answer.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backed_memory import back_memory, load_bytes  # noqa: E402
from serve_processes import free_port  # noqa: E402

SERVE = [str(Path(sys.executable).with_name("wsgi-infer")), "serve"]
HERE = Path(__file__).parent
FLOORS = {"torch": "torch", "torch and transformers": "torch transformers"}


def start_seconds(cache_dir: Path, model: str | None) -> float:
    env = os.environ | {"WSGI_INFER_CACHE_DIR": str(cache_dir)} | ({"WSGI_INFER_MODEL": model} if model else {})
    return seconds_to_health(lambda port: [*SERVE, "--bind", f"127.0.0.1:{port}"], env)


def floor_seconds(imports: str) -> float:
    """A gunicorn gevent worker whose app only imports ``imports``, from launch to its first 200."""
    gunicorn = [str(Path(sys.executable).with_name("gunicorn")), "-k", "gevent", "-w", "1"]
    env = os.environ | {"IMPORTS": imports}
    # run in scripts/, where gunicorn finds no gunicorn.conf.py (ours would start our engine)
    return seconds_to_health(lambda port: [*gunicorn, "-b", f"127.0.0.1:{port}", "start_floor_app:app"], env, HERE)


def seconds_to_health(
    command: Callable[[int], list[str]],
    env: dict[str, str],
    cwd: Path | None = None,
    on_ready: Callable[[subprocess.Popen], None] | None = None,
) -> float:
    """Launch to the first 200 on /health; ``on_ready`` sees the process then, before it is stopped."""
    port = free_port()
    started = time.perf_counter()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    server = subprocess.Popen(command(port), env=env, cwd=cwd, **quiet)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        seconds = time.perf_counter() - started
                        if on_ready is not None:
                            on_ready(server)
                        return seconds
            except OSError:  # refused while the worker boots, 503 while it loads
                pass
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}")
            time.sleep(0.05)
    finally:
        server.terminate()
        server.wait(60)


def phases(model: str | None) -> None:
    if model:
        os.environ["WSGI_INFER_MODEL"] = model  # read by ServerSettings, as a worker reads it
    marks: list[tuple[str, float]] = [("", time.perf_counter())]

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter()))
        print(f"{name:38s} {marks[-1][1] - marks[-2][1]:6.3f} s", flush=True)

    gc.disable()  # as a worker's post_fork: collection paused while it imports (gunicorn/config.py)
    import gevent.monkey

    from wsgi_infer.server.gunicorn.worker import _entry_points_read_once

    mark("gunicorn's worker and gevent, imported")
    with _entry_points_read_once():
        gevent.monkey.patch_all()
    mark("gevent's patching")
    import torch  # noqa: F401

    mark("torch")
    import transformers  # noqa: F401

    mark("transformers")
    import wsgi_infer.server.wsgi  # noqa: F401

    mark("Flask, pydantic and the app's modules")
    gc.freeze()  # as post_worker_init
    gc.enable()
    from importlib import import_module

    from wsgi_infer.engine.llm_engine import LLMEngine
    from wsgi_infer.engine.loading.model_loader import load_imports
    from wsgi_infer.server.settings import ServerSettings

    for module in load_imports(ServerSettings().model or None):
        import_module(module)
    mark("what loading imports (load_imports)")
    backing = 0.0
    if model and Path(model).is_file():  # the engine's memory as a machine's own, not faulted in by a VM's host
        back_memory(load_bytes(Path(model)))
        mark("memory backed (not counted in all)")
        backing = marks[-1][1] - marks[-2][1]
    parts = _time_engine_parts()
    LLMEngine(ServerSettings().engine_config())
    mark("the engine, in all:")
    for name, (seconds, calls) in parts.items():
        print(f"  {name:36s} {seconds:6.3f} s" + ("" if calls else "  (never called: renamed or moved?)"))
    print(f"{'in all':38s} {marks[-1][1] - marks[0][1] - backing:6.3f} s")
    gc.unfreeze()  # else logging's handlers outlive gevent's thread module at exit, and their cleanup complains


def _time_engine_parts() -> dict[str, list[float]]:
    """Wraps the engine's loading steps so that each one's time and calls are kept (its module's name for it is
    replaced): a step the engine no longer calls by that name says so rather than timing nothing."""
    from wsgi_infer.engine import model_runner, text_side
    from wsgi_infer.engine.loading import model_builder

    steps = {
        "tokenizer": (text_side, "load_tokenizer"),
        "packing the projections": (model_builder, "pack_on_kernels"),
        "the other weights": (model_builder, "_load_weights"),
        "the embedding's check": (model_builder, "share_embedding_with_packed_head"),
        "KV cache": (model_runner.ModelRunner, "_allocate_kv_cache"),
    }
    kept = {name: [0.0, 0] for name in steps}  # seconds, calls

    def timed(name, function):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                kept[name][0] += time.perf_counter() - started
                kept[name][1] += 1

        return call

    for name, (owner, attribute) in steps.items():
        setattr(owner, attribute, timed(name, getattr(owner, attribute)))
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", help="a model path (default: the shipped GGUF)")
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--floor", action="store_true", help="also time apps that only import torch (and transformers)")
    args = parser.parse_args()
    if args.phases:
        return phases(args.model)
    times: dict[str, list[float]] = {"first": [], "later": []} | ({name: [] for name in FLOORS} if args.floor else {})
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            times["first"].append(start_seconds(Path(cache), args.model))
            times["later"].append(start_seconds(Path(cache), args.model))
        for name, imports in FLOORS.items() if args.floor else ():
            times[name].append(floor_seconds(imports))
        print(", ".join(f"{name} {seconds[-1]:.2f} s" for name, seconds in times.items()), flush=True)
    print("median: " + ", ".join(f"{name} {statistics.median(seconds):.2f} s" for name, seconds in times.items()))


if __name__ == "__main__":
    main()
