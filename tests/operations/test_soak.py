"""Two minutes of scripts/soak.py (issues 11 and 64): mixed load on three models with room for two, so that models
load and unload every few seconds, and one SIGHUP reload half way, lose and leak nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real processes

ROOT = Path(__file__).resolve().parents[2]
# soak.py fails a run whose workers' open fds grow more than this under steady load (one set of models loaded): a
# leak of two fds a load measured 0.36 in a minute. Their RSS still grows in a worker's first minute of churn (its
# heap reaching its working size: 0 to 0.13 over runs of this test, beside the suite), so it has a bound of its own;
# the 30-minute churn is where RSS shows flat (docs/benchmarks/reliability.md: 0.035).
MAX_DRIFT = 0.1
MAX_RSS_DRIFT = 0.25
DURATION_S = 120
CHURN_S = 6  # the two models in use move one along the three every this often
NICENESS = 10


def lower_priority() -> None:
    os.nice(NICENESS)


def test_two_minutes_of_models_coming_and_going_with_a_reload(tiny_model_dirs, minilm_dir, tmp_path):
    models = [tiny_model_dirs["llama"], tiny_model_dirs["qwen3"], minilm_dir]
    argv = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--duration", str(DURATION_S)]
    argv += [arg for model in models for arg in ("--model", str(model))]
    argv += ["--max-loaded-models", "2", "--churn-seconds", str(CHURN_S), "--quantization", "none"]
    argv += ["--kv-cache-mb", "8", "--sample-every", "1.6", "--request-timeout", "180"]
    argv += ["--max-drift", str(MAX_DRIFT), "--max-rss-drift", str(MAX_RSS_DRIFT), "--out", str(tmp_path)]
    # At a lower priority: the soak's load is elastic (it checks what it sends, however much that is), and the
    # other test process takes the CPU first rather than waiting behind two minutes of it.
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900, preexec_fn=lower_priority)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-6000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    summary, samples = report["summary"], report["samples"]

    assert summary["failures_by_category"] == {}, report["failures"][:10]
    assert summary["5xx"] == summary["hung"] == summary["mismatches"] == 0
    assert summary["greedy_checked"] >= 100  # texts, structured outputs, tool calls and embeddings: the references'
    ok = {kind: counts.get("ok", 0) for kind, counts in summary["requests"].items()}
    kinds = ("resume", "disconnect", "sampled_n", "bad_request", "completion", "chat", "structured", "tools")
    for kind in (*kinds, "embedding"):
        assert ok.get(kind, 0) >= 1, (kind, summary["requests"])
    # The churn: loads all along (each move of the window needs one), and the three models each loaded at times.
    assert summary["model_loads"] >= DURATION_S // CHURN_S // 2, summary
    loaded = {model.split(":")[0] for s in samples for model in s["models"] or ()}
    assert loaded == {Path(model).name for model in models}, loaded

    reload = summary["reload"]
    assert reload["new_pids"] and not set(reload["new_pids"]) & set(reload["old_pids"]), reload
    assert samples[0]["worker_pids"] == reload["old_pids"] and samples[-1]["worker_pids"] == reload["new_pids"]
    assert summary["final"]["idle"] and summary["final"]["kv_blocks_in_use"] == 0, summary["final"]
    assert len(samples) >= 50
    # Measured (None when too few samples under load), and within the bound the script enforced.
    assert summary["rss_drift"] is not None and summary["rss_drift"] <= MAX_RSS_DRIFT, summary
    assert summary["fd_drift"] is not None and summary["fd_drift"] <= MAX_DRIFT, summary
    assert summary["threads"]["idle"] <= summary["threads"]["steady"], summary["threads"]
    # Once idle, the new worker holds no more fds than under load (connections closed) nor more memory than drift.
    idle = samples[-1]
    busy = ("load", "last_requests")
    loaded_samples = [s for s in samples if s["phase"] in busy and s["worker_pids"] == idle["worker_pids"]]
    assert idle["phase"] == "idle" and loaded_samples, samples
    assert idle["open_fds"] <= max(s["open_fds"] for s in loaded_samples), (idle, loaded_samples)
    assert idle["rss_bytes"] <= (1 + MAX_DRIFT) * max(s["rss_bytes"] for s in loaded_samples), idle
    assert (tmp_path / "soak.png").read_bytes().startswith(b"\x89PNG")
