"""What `bench_serve.py` prints and draws: the medians of its alternating runs, side by side per system, the server
against the engine alone, and a plot of tok/s and TTFT against concurrency."""

from __future__ import annotations

import statistics


def median_runs(runs: list[dict[int, dict]]) -> dict[int, dict]:
    """Per concurrency and metric, the median over runs."""
    return {
        c: {
            k: statistics.median(run[c][k] for run in runs)
            for k in runs[0][c]
            if isinstance(runs[0][c][k], (int, float))
        }
        for c in runs[0]
    }


def print_side_by_side(medians: dict[str, dict[int, dict]], args) -> None:
    names = list(medians)
    print(f"## Side by side, {args.output_len} output tokens, median of {args.repeat} alternating runs\n")
    print("| concurrency | " + " | ".join(f"{n}: out tok/s (TTFT, TPOT mean)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for c in medians[names[0]]:
        cells = [
            f"{r['output_tok_s']:.1f} ({r['ttft_mean_ms'] / 1e3:.2f} s, {r['tpot_mean_ms']:.1f} ms)"
            for r in (medians[n][c] for n in names)
        ]
        print(f"| {c} | " + " | ".join(cells) + " |")
    print()


def plot(medians: dict[str, dict[int, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tok, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for name, levels in medians.items():
        concurrency = sorted(levels)
        tok.plot(concurrency, [levels[c]["output_tok_s"] for c in concurrency], marker="o", label=name)
        ttft.plot(concurrency, [levels[c]["ttft_mean_ms"] / 1e3 for c in concurrency], marker="o", label=name)
    for axis, label in ((tok, "output tok/s"), (ttft, "mean TTFT (s)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    ttft.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_served_and_alone(served: dict[int, dict], alone: dict[int, dict] | None, args, speculative: str) -> None:
    print(
        f"## HTTP server vs engine alone ({args.dtype}, quantization {args.quantization}, speculation {speculative}), "
        f"{args.output_len} output tokens, median of {args.repeat} alternating runs\n"
    )
    print(
        "| concurrency | path | out tok/s | req/s | TTFT mean / p50 / p99 ms | TPOT mean / p99 ms "
        "| ITL p50 / p99 ms | E2EL mean / p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c, r in served.items():
        print(
            f"| {c} | HTTP/SSE | {r['output_tok_s']:.1f} | {r['request_s']:.2f} | {r['ttft_mean_ms']:.1f} / "
            f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['tpot_mean_ms']:.1f} / {r['tpot_p99_ms']:.1f} "
            f"| {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['e2el_mean_ms']:.0f} / {r['e2el_p99_ms']:.0f} |"
        )
        if alone:
            e = alone[c]
            print(
                f"| {c} | engine alone | {e['output_tok_s']:.1f} | {e['request_s']:.2f} | {e['ttft_mean_ms']:.1f} / "
                f"{e['ttft_p50_ms']:.1f} / {e['ttft_p99_ms']:.1f} | {e['tpot_mean_ms']:.1f} / {e['tpot_p99_ms']:.1f} | "
                f"{e['itl_p50_ms']:.1f} / {e['itl_p99_ms']:.1f} | {e['e2el_mean_ms']:.0f} / - |"
            )
    if alone:
        print("\n| concurrency | HTTP/SSE cost in output tok/s | TTFT p50 added |\n|---|---|---|")
        for c, r in served.items():
            e = alone[c]
            cost = 100 * (1 - r["output_tok_s"] / e["output_tok_s"])
            print(f"| {c} | {cost:.1f}% | {r['ttft_p50_ms'] - e['ttft_p50_ms']:+.1f} ms |")
