#!/usr/bin/env python
"""The size sweep: each GGUF side by side with llama-server, as a model grows (issue 52).

    .venv/bin/python scripts/bench_sizes.py --llama-server llsrc/.../build/bin/llama-server \\
        --json sizes.json --plot docs/sizes-llama-server.png smol.gguf shaped-0.5b-Q4_K_M.gguf shaped-1b-Q4_K_M.gguf

Per model, in one run: the first start (an empty cache: the conversion included) and a later start, launch to the
first 200 on /health, each with the serving process's peak RSS (VmHWM); the converted copy's size; llama-server's
start and peak RSS holding as many KV tokens as our default KV budget does; then ``bench_serve.py`` with speculation
off on both sides (one stream and 16, 128 tokens each; a 2,048-token prompt's prefill), ours also with 8-bit
activations; and one stream's share of the read bandwidth (``bench_bandwidth.py``), taking a token to read the
converted copy once (ours) or the file (llama-server; both as the shaped models tie their LM head). It prints a
table and writes the figures (``--json``) and each ratio against parameters (``--plot``).
The shaped models come from ``make_shaped_model.py``: random weights, for speed only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from bench_bandwidth import read_gb_s  # noqa: E402
from bench_serve import tree_peak_rss_mb  # noqa: E402
from bench_start import seconds_to_health  # noqa: E402

SERVE = [str(Path(sys.executable).with_name("wsgi-infer")), "serve"]
KV_BUDGET_BYTES = 256 << 20  # our default KV cache on a CPU, in bf16
RATIOS = {  # name: (ours, theirs, higher is better for us when ours / theirs is above 1)
    "1 stream": ("c1_tok_s", "c1_tok_s"),
    "16 streams": ("c16_tok_s", "c16_tok_s"),
    "16 streams, int8 activations": ("c16_int8_tok_s", "c16_tok_s"),
    "prefill": ("prefill_tok_s", "prefill_tok_s"),
    "prefill, int8 activations": ("prefill_int8_tok_s", "prefill_tok_s"),
}


def shape(path: Path) -> tuple[int, int]:
    """(parameters, KV cache tokens our default budget holds) from the file's table and metadata."""
    reader = GGUFReader(path)
    fields = {f.name: f.parts[f.data[0]] for f in reader.fields.values() if f.data}
    arch = bytes(fields["general.architecture"]).decode()
    value = lambda key: int(np.asarray(fields[f"{arch}.{key}"]).item())  # noqa: E731
    heads = value("attention.head_count")
    head_dim = (
        value("attention.key_length")
        if f"{arch}.attention.key_length" in fields
        else value("embedding_length") // heads
    )
    kv_heads = value("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in fields else heads
    per_token = 2 * value("block_count") * kv_heads * head_dim * 2  # keys and values, bf16
    return sum(int(t.n_elements) for t in reader.tensors), KV_BUDGET_BYTES // per_token


def started(command, env: dict[str, str]) -> tuple[float, float]:
    """(seconds from launch to a 200 on /health, the peak RSS in MB of its processes then); ``command(port)``."""
    peak = []
    seconds = seconds_to_health(command, env, on_ready=lambda process: peak.append(tree_peak_rss_mb(process.pid)))
    return seconds, peak[0]


def starts(model: Path, llama_server: str, kv_tokens: int) -> dict:
    figures = {}
    with tempfile.TemporaryDirectory() as cache:
        env = os.environ | {"WSGI_INFER_CACHE_DIR": cache, "WSGI_INFER_MODEL": str(model)}
        for which in ("first", "later"):
            seconds, rss = started(lambda port: [*SERVE, "--bind", f"127.0.0.1:{port}"], env)
            figures |= {f"{which}_start_s": seconds, f"{which}_start_rss_mb": rss}
        copy = next(p for p in Path(cache).iterdir() if p.is_dir() and p.name.startswith(model.stem))
        figures["cache_mb"] = sum(f.stat().st_size for f in copy.iterdir()) / 1e6
    llama = [llama_server, "-m", str(model), "--host", "127.0.0.1", "--no-webui", "-t", str(os.cpu_count())]
    llama += ["-np", "16", "-c", str(kv_tokens)]
    seconds, rss = started(lambda port: [*llama, "--port", str(port)], dict(os.environ))
    return figures | {"llama_start_s": seconds, "llama_rss_mb": rss, "file_mb": model.stat().st_size / 1e6}


def throughput(model: Path, llama_server: str, out: Path) -> dict:
    """bench_serve's medians: ours, ours with 8-bit activations, and llama-server, speculation off."""
    common = [sys.executable, str(HERE / "bench_serve.py"), "--model", str(model), "--llama-server", llama_server]
    common += ["--repeat", "1", "--skip-engine", "--ours", "int8=WSGI_INFER_ACTIVATIONS=int8"]
    env = os.environ | {"WSGI_INFER_SPECULATIVE": "none"}
    runs = {"standard": ["--concurrency", "1", "16", "--rounds", "2", "--min-requests", "4"]}
    runs["long"] = ["--workload", "long", "--output-len", "1", "--concurrency", "1", "--min-requests", "2"]
    systems = {}
    for workload, extra in runs.items():
        path = out / f"{model.stem}-{workload}.json"
        subprocess.run([*common, *extra, "--json", str(path)], env=env, check=True, stdout=subprocess.DEVNULL)
        for name, levels in json.loads(path.read_text())["systems"].items():
            figures = systems.setdefault(name, {})
            if workload == "long":
                figures["prefill_tok_s"] = levels["1"]["prefill_tok_s"]
            else:
                figures |= {f"c{c}_tok_s": levels[c]["output_tok_s"] for c in ("1", "16")}
    ours, int8 = systems["wsgi-infer"], systems["int8"]
    ours |= {"c16_int8_tok_s": int8["c16_tok_s"], "prefill_int8_tok_s": int8["prefill_tok_s"]}
    return {"ours": ours, "llama": systems["llama-server"]}


def print_table(results: list[dict]) -> None:
    print(
        "| model | parameters | file | cache | first start | later start | peak RSS first / later | 1 stream "
        "| 16 streams (int8 act.) | prefill tok/s (int8 act.) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        o, t = r["ours"], r["llama"]
        print(
            f"| {r['model']} | {r['parameters'] / 1e9:.2f}B | {r['file_mb']:,.0f} MB | {r['cache_mb']:,.0f} MB "
            f"({r['cache_mb'] / r['file_mb']:.2f}x) | {r['first_start_s']:.1f} s "
            f"(llama-server {r['llama_start_s']:.1f}) "
            f"| {r['later_start_s']:.1f} s | {r['first_start_rss_mb']:,.0f} / {r['later_start_rss_mb']:,.0f} MB "
            f"(llama-server {r['llama_rss_mb']:,.0f}) | {o['c1_tok_s']:.1f} vs {t['c1_tok_s']:.1f} "
            f"({o['c1_share']:.0%} / {t['c1_share']:.0%} of {r['read_gb_s']:.1f} GB/s) "
            f"| {o['c16_tok_s']:.1f} ({o['c16_int8_tok_s']:.1f}) vs {t['c16_tok_s']:.1f} "
            f"| {o['prefill_tok_s']:.1f} ({o['prefill_int8_tok_s']:.1f}) vs {t['prefill_tok_s']:.1f} |"
        )


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    params = [r["parameters"] / 1e9 for r in results]
    for name, (ours, theirs) in RATIOS.items():
        ax.plot(params, [r["ours"][ours] / r["llama"][theirs] for r in results], marker="o", label=name)
    ax.plot(
        params,
        [r["llama_rss_mb"] / r["first_start_rss_mb"] for r in results],
        marker="s",
        ls="--",
        label="peak RSS, first start (llama-server / ours)",
    )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xticks(params, [f"{p:.2g}B" for p in params])
    ax.minorticks_off()
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("wsgi-infer / llama-server")
    ax.legend(fontsize=8)
    ax.set_title("The ratios as models grow (speculation off)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    results, bandwidth = [], read_gb_s()
    print(f"read bandwidth {bandwidth:.1f} GB/s", file=sys.stderr)
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            parameters, kv_tokens = shape(model)
            result = {"model": model.name, "parameters": parameters, "kv_tokens": kv_tokens}
            result |= starts(model, args.llama_server, kv_tokens)
            result |= throughput(model, args.llama_server, Path(scratch))
            result["read_gb_s"] = bandwidth
            result["ours"]["c1_share"] = result["cache_mb"] / 1e3 * result["ours"]["c1_tok_s"] / bandwidth
            result["llama"]["c1_share"] = result["file_mb"] / 1e3 * result["llama"]["c1_tok_s"] / bandwidth
            results.append(result)
            print(json.dumps(result), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    print_table(results)


if __name__ == "__main__":
    main()
