"""The soak's verdict: what it counted, the drifts of the workers' memory, fds and threads, and its plot."""

from __future__ import annotations

import argparse
import math
from collections import Counter, defaultdict
from pathlib import Path

from .clients import LoadContext
from .streams import percentile


def drift(samples: list[dict], key: str) -> float | None:
    """How much ``key`` grew under load: in each worker generation, after the first third of its samples (the
    warm-up: a fresh worker's heap reaching its working size), and within each set of models loaded, the rise of the
    later half's peak over the earlier half's, as a fraction of it; the largest over those groups. A leak raises the
    peaks; a model unloaded returns memory, so a set's lows depend on which model went before it and say nothing.
    The warm-up is the worker's, not a set's: a set seen twice in a worker's life, first while it warmed up, rose by
    the warm-up alone (0.29 in a two-minute run). The reload (old and new workers side by side), a model loading or
    just loaded, the last requests and the idle end are left out."""
    generations: dict[tuple, list[dict]] = defaultdict(list)
    for before, s in zip([None, *samples], samples):
        # Not while a model loads, nor in the interval of a load: the model it evicted is freed after its state
        # says unloaded (by the engine thread, in the next moment), and its memory still counts.
        loaded_since = before is None or before["model_loads"] != s["model_loads"]
        settled = s["models"] is not None and not any(m.endswith(":loading") for m in s["models"])
        if s["phase"] == "load" and settled and not loaded_since and s[key]:
            generations[tuple(s["worker_pids"])].append(s)
    groups: dict[tuple, list[float]] = defaultdict(list)
    for generation in generations.values():
        for s in generation[len(generation) // 3 :]:
            groups[(tuple(s["worker_pids"]), tuple(s["models"]))].append(s[key])
    drifts = []
    for values in groups.values():
        if len(values) >= 2:
            earlier, later = max(values[: len(values) // 2]), max(values[len(values) // 2 :])
            drifts.append(max(0.0, later - earlier) / earlier)
    return round(max(drifts), 4) if drifts else None


def threads(samples: list[dict]) -> dict:
    """The last worker generation's threads under load, most often (a model loading or a request's pool adds a
    few for a while), and once idle: threads that models coming and going left behind are the difference."""
    last = samples[-1]
    loaded = [s["threads"] for s in samples if s["phase"] == "load" and s["worker_pids"] == last["worker_pids"]]
    return {"steady": Counter(loaded).most_common(1)[0][0] if loaded else None, "idle": last["threads"]}


def counted(samples: list[dict], key: str) -> int:
    """What a server counter (``model_loads``, ``preemptions``) counted under the load, each worker generation's
    own counter added up."""
    counts: dict[tuple, list[float]] = defaultdict(list)
    for s in samples:
        if s[key] is not None:
            counts[tuple(s["worker_pids"])].append(s[key])
    return int(sum(max(values) - min(values) for values in counts.values()))


def summarize(ctx: LoadContext, samples: list[dict], reload: dict, final: dict, args: argparse.Namespace) -> dict:
    stats = ctx.stats
    categories = Counter(f["category"] for f in stats.failures)
    outcomes = {kind: dict(counts) for kind, counts in sorted(stats.outcomes.items())}
    summary = {
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "requests": outcomes,
        "requests_total": sum(sum(c.values()) for c in outcomes.values()),
        "greedy_checked": stats.greedy_checked,
        "failures_by_category": dict(categories),
        "5xx": categories["5xx"],
        "hung": categories["hung"],
        "mismatches": categories["mismatch"],
        "retried": dict(stats.retried),
        "interrupted_by_reload": sum(c.get("interrupted_by_reload", 0) for c in outcomes.values()),
        "resumes_lost_to_reload": outcomes.get("resume", {}).get("lost_to_reload", 0),
        "p99_itl_s": percentile(stats.all_gaps, 99),
        "rss_drift": drift(samples, "rss_bytes"),
        "fd_drift": drift(samples, "open_fds"),
        "threads": threads(samples),
        "kv_blocks_in_use_least": min(
            (s["kv_blocks_in_use"] for s in samples if s["kv_blocks_in_use"] is not None), default=None
        ),
        "model_loads": counted(samples, "model_loads"),
        "preemptions": counted(samples, "preemptions"),
        "churn_moves": int(args.duration // ctx.churn_seconds) if ctx.churn_seconds else 0,
        "rss_mib_first_last": [round(samples[i]["rss_bytes"] / 2**20, 1) for i in (0, -1)],
        "greenlets_exported": any(s["greenlets"] is not None for s in samples),
        "reload": reload,
        "final": final,
        "references": [
            {"model": r.model, "api": r.api, "prompt": r.prompt, "limit": r.limit}
            for model in ctx.models
            for refs in model.greedy.values()
            for r in refs
        ],
    }
    bounds = {"rss_drift": args.max_rss_drift or args.max_drift, "fd_drift": args.max_drift}
    summary["violations"] = violations(summary, bounds)
    return summary


def violations(summary: dict, max_drifts: dict[str, float | None]) -> list[str]:
    """Why the run fails; empty when it passes."""
    found = [f"{count} {category}" for category, count in summary["failures_by_category"].items()]
    if summary["kv_blocks_in_use_least"] is not None and summary["kv_blocks_in_use_least"] < 0:
        found.append(f"KV blocks in use below zero: {summary['kv_blocks_in_use_least']} (a model's gauges disagree)")
    if not summary["final"]["idle"]:
        found.append(f"not idle at the end: {summary['final']}")
    reload = summary["reload"]
    if reload["error"] or not reload["new_pids"] or set(reload["new_pids"]) & set(reload["old_pids"]):
        found.append(f"the reload did not replace the worker: {reload}")
    if reload["old_pids_alive"]:
        found.append(f"old workers still alive after the reload: {reload['old_pids_alive']}")
    if summary["model_loads"] < summary["churn_moves"] / 2:
        found.append(f"{summary['model_loads']} loads for {summary['churn_moves']} moves of the models in use")
    if summary["threads"]["steady"] is None or summary["threads"]["idle"] > summary["threads"]["steady"]:
        found.append(f"threads left behind: {summary['threads']}")
    for key in ("rss_drift", "fd_drift"):
        bound = max_drifts[key]
        if bound is not None and (summary[key] is None or summary[key] > bound):
            found.append(f"{key} {summary[key]} above {bound}")
    return found


def plot(samples: list[dict], summary: dict, path: Path) -> None:
    """Stacked panels against time, the SIGHUP marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("rss_bytes", "RSS, workers (MiB)", 1 / 2**20),
        ("open_fds", "open fds, workers", 1),
        ("threads", "threads, workers", 1),
        ("model_loads", "model loads", 1),
        ("greenlets", "greenlets", 1),
        ("kv_blocks_in_use", "KV blocks in use", 1),
        ("p99_itl_s", "p99 ITL (ms)", 1e3),
    )
    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(10, 15))
    for ax, (key, label, scale) in zip(axes, panels):
        values = [math.nan if s[key] is None else s[key] * scale for s in samples]
        sets = {tuple(m.split(":")[0] for m in s["models"] or ()) for s in samples}
        if key == "rss_bytes" and len(sets) > 1:  # the memory of each set of models loaded, as drift judges it
            ax.plot(t, values, color="lightgray", linewidth=0.8)
            for models in sorted(sets):
                at = [i for i, s in enumerate(samples) if tuple(m.split(":")[0] for m in s["models"] or ()) == models]
                ax.plot([t[i] for i in at], [values[i] for i in at], ".", label=" + ".join(models) or "unknown")
        else:
            ax.plot(t, values, marker=".")
        if all(math.isnan(v) for v in values):
            ax.text(0.5, 0.5, "not exported by the server", transform=ax.transAxes, ha="center", va="center")
        reload = summary["reload"]
        ax.axvline(reload["sent_at_s"], color="tab:red", linestyle="--", label="SIGHUP")
        if reload["old_exited_after_s"] is not None:
            end = reload["sent_at_s"] + reload["old_exited_after_s"]
            ax.axvspan(reload["sent_at_s"], end, color="tab:red", alpha=0.08, label="old worker draining")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower left", fontsize=7, ncol=3, framealpha=0.6)
    axes[-1].set_xlabel("seconds since the load started")
    verdict = "PASS" if not summary["violations"] else "FAIL: " + "; ".join(summary["violations"])[:120]
    fig.suptitle(f"soak: {summary['requests_total']} requests, c={summary['concurrency']}, {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
