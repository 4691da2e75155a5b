#!/usr/bin/env python
"""The size sweep: each GGUF side by side with llama.cpp's llama-server and ik_llama.cpp's, as a model grows.

    .venv/bin/python scripts/bench_sizes.py --llama-server LLAMA_SERVER --ik-llama-server IK_LLAMA_SERVER \\
        --json sizes.json --plot docs/sizes-llama-server.png shaped-1b-Q4_K_M.gguf shaped-3b-Q4_K_M.gguf

Per model, in one run: our first start (an empty cache: the conversion included) and a later start, launch to the
first 200 on /health, each with the serving process's peak RSS (VmHWM); each peer's start and peak RSS, holding as
many KV tokens as our default KV budget does (ik_llama.cpp with ``-rtr``, its repacking at load); then
``bench_serve.py`` with speculation off on every side, the systems alternating (one stream and 16, 128 tokens each;
a 2,048-token prompt's prefill), ours also on the exact path (``WSGI_INFER_ACTIVATIONS=int16``); and one stream's
share of the read bandwidth (``bench_bandwidth.py``'s C probe): a token reads the file's weights once, on every
side. It prints a table, writes the figures (``--json``) and each ratio against parameters (``--plot``).
``--starts-only`` times the starts alone (and the imports' floors), ``--repeat`` rounds.
The shaped models come from ``make_shaped_model.py``: random weights, for speed only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGUFReader

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from backed_memory import SETTLE_SECONDS, back_memory, load_bytes  # noqa: E402
from bench_bandwidth import probe_gb_s  # noqa: E402
from bench_start import FLOORS, floor_seconds, seconds_to_health  # noqa: E402
from serve_processes import IK_NAME, tree_peak_rss_mb  # noqa: E402

from wsgi_infer.engine.config import default_cpu_kv_bytes  # noqa: E402
from wsgi_infer.server.engine_client.residency import kv_token_bytes  # noqa: E402

SERVE = [str(Path(sys.executable).with_name("wsgi-infer")), "serve"]
PEERS = {"llama-server": "llama", IK_NAME: "ik"}
FIGURES = {"1 stream": "c1_tok_s", "16 streams": "c16_tok_s", "2,048-token prefill": "prefill_tok_s"}


def shape(path: Path) -> tuple[int, int, int]:
    """(parameters, bytes of weights, KV cache tokens our default budget holds) from the file's table and
    metadata."""
    reader = GGUFReader(path)
    per_token = kv_token_bytes(path)  # keys and values, halves
    weights = sum(int(t.n_bytes) for t in reader.tensors)
    return sum(int(t.n_elements) for t in reader.tensors), weights, default_cpu_kv_bytes(per_token) // per_token


def started(command, env: dict[str, str], memory_bytes: int) -> tuple[float, float]:
    """(seconds from launch to a 200 on /health, the peak RSS in MB of its processes then); ``command(port)``, which
    takes at most ``memory_bytes``, started after that much memory was backed (``backed_memory``: what it covers)."""
    back_memory(memory_bytes)
    time.sleep(SETTLE_SECONDS)
    peak = []
    seconds = seconds_to_health(command, env, on_ready=lambda process: peak.append(tree_peak_rss_mb(process.pid)))
    return seconds, peak[0]


def peer_command(binary: str, model: Path, kv_tokens: int, ik: bool) -> list[str]:
    web_ui = ["--webui", "none", "-rtr"] if ik else ["--no-webui"]
    return [binary, "-m", str(model), "--host", "127.0.0.1", "-t", str(os.cpu_count()), "-np", "16",
            "-c", str(kv_tokens), *web_ui]  # fmt: skip


def starts(model: Path, peers: dict[str, str], kv_tokens: int) -> dict:
    figures, memory = {}, load_bytes(model)
    with tempfile.TemporaryDirectory() as cache:
        env = os.environ | {"WSGI_INFER_CACHE_DIR": cache, "WSGI_INFER_MODEL": str(model)}
        for which in ("first", "later"):
            seconds, rss = started(lambda port: [*SERVE, "--bind", f"127.0.0.1:{port}"], env, memory)
            figures |= {f"{which}_start_s": seconds, f"{which}_start_rss_mb": rss}
    for name, binary in peers.items():
        command = peer_command(binary, model, kv_tokens, name == IK_NAME)
        seconds, rss = started(lambda port, command=command: [*command, "--port", str(port)], dict(os.environ), memory)
        figures |= {f"{PEERS[name]}_start_s": seconds, f"{PEERS[name]}_rss_mb": rss}
    return figures


def throughput(model: Path, peers: dict[str, str], repeat: int, out: Path) -> dict[str, dict]:
    """bench_serve's medians for every system, speculation off: ours, ours on the exact path, and the peers."""
    common = [sys.executable, str(HERE / "bench_serve.py"), "--model", str(model), "--repeat", str(repeat)]
    common += ["--skip-engine", "--ours", "exact=WSGI_INFER_ACTIVATIONS=int16"]
    common += [f"--{'ik-' if name == IK_NAME else ''}llama-server={binary}" for name, binary in peers.items()]
    env = os.environ | {"WSGI_INFER_SPECULATIVE": "none"}
    runs = {"standard": ["--concurrency", "1", "16", "--rounds", "2", "--min-requests", "4"]}
    runs["long"] = ["--workload", "long", "--output-len", "1", "--concurrency", "1", "--min-requests", "2"]
    systems: dict[str, dict] = {}
    for workload, extra in runs.items():
        path = out / f"{model.stem}-{workload}.json"
        subprocess.run([*common, *extra, "--json", str(path)], env=env, check=True, stdout=subprocess.DEVNULL)
        for name, levels in json.loads(path.read_text())["systems"].items():
            figures = systems.setdefault(name, {})
            if workload == "long":
                figures["prefill_tok_s"] = levels["1"]["prefill_tok_s"]
            else:
                figures |= {f"c{c}_tok_s": levels[c]["output_tok_s"] for c in ("1", "16")}
    return systems


def print_table(results: list[dict]) -> None:
    peers = [name for name in PEERS if name in results[0]["systems"]]
    print("| model | parameters | weights | first / later start (" + ", ".join(peers) + ") | peak RSS, first start "
          "| " + " | ".join(f"{figure}: ours (exact) vs " + ", ".join(peers) for figure in FIGURES) + " |")  # fmt: skip
    print("|---" * (5 + len(FIGURES)) + "|")
    for r in results:
        s = r["systems"]
        starts = " / ".join(f"{r[f'{PEERS[p]}_start_s']:.1f}" for p in peers)
        rss = " / ".join(f"{r[f'{PEERS[p]}_rss_mb']:,.0f}" for p in peers)
        cells = []
        for key in FIGURES.values():
            ours = s["wsgi-infer"][key]
            ratios = ", ".join(f"{s[p][key]:.1f} ({ours / s[p][key]:.2f}x)" for p in peers)
            cells.append(f"{ours:.1f} ({s['exact'][key]:.1f}) vs {ratios}")
        print(
            f"| {r['model']} | {r['parameters'] / 1e9:.2f}B | {r['weight_mb']:,.0f} MB "
            f"| {r['first_start_s']:.1f} / {r['later_start_s']:.1f} s ({starts}) "
            f"| {r['first_start_rss_mb']:,.0f} MB ({rss}) | " + " | ".join(cells) + " |"
        )


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = [name for name in PEERS if name in results[0]["systems"]]
    fig, axes = plt.subplots(1, len(peers), figsize=(6 * len(peers), 4.5), squeeze=False)
    params = [r["parameters"] / 1e9 for r in results]
    for ax, peer in zip(axes[0], peers):
        for figure, key in FIGURES.items():
            ratios = [r["systems"]["wsgi-infer"][key] / r["systems"][peer][key] for r in results]
            ax.plot(params, ratios, marker="o", label=figure)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks(params, [f"{p:.2g}B" for p in params])
        ax.minorticks_off()
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel(f"wsgi-infer / {peer}")
        ax.legend(fontsize=8)
        ax.set_title(f"Beside {peer}, speculation off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def starts_only(models: list[Path], peers: dict[str, str], rounds: int) -> None:
    """Each model's starts beside the peers', then the floors (``bench_start.py``), round after round: medians."""
    figures: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for model in models:
            for key, value in starts(model, peers, shape(model)[2]).items():
                figures.setdefault(model.name, {}).setdefault(key, []).append(value)
        for name, imports in FLOORS.items():
            figures.setdefault("floor", {}).setdefault(name, []).append(floor_seconds(imports))
    for name, values in figures.items():
        print(name, {key: f"{np.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for key, v in values.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--ik-llama-server")
    parser.add_argument("--repeat", type=int, default=2, help="alternating runs of every system; medians")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--starts-only", action="store_true", help="only the starts (and the floors), --repeat rounds")
    args = parser.parse_args()
    peers = {"llama-server": args.llama_server} | ({IK_NAME: args.ik_llama_server} if args.ik_llama_server else {})
    if args.starts_only:
        starts_only(args.models, peers, args.repeat)
        return
    bandwidth = max(probe_gb_s(huge_pages=True).values())
    print(f"read bandwidth {bandwidth:.1f} GB/s", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            parameters, weights, kv_tokens = shape(model)
            result = {"model": model.name, "parameters": parameters, "weight_mb": weights / 1e6}
            result |= starts(model, peers, kv_tokens)
            result["systems"] = throughput(model, peers, args.repeat, Path(scratch))
            for figures in result["systems"].values():  # a stream reads the weights once a token
                figures["c1_read_share"] = weights / 1e9 * figures["c1_tok_s"] / bandwidth
            results.append(result | {"read_gb_s": bandwidth})
            print(json.dumps(results[-1]), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    print_table(results)


if __name__ == "__main__":
    main()
