"""Twenty seconds of scripts/soak.py (issue 11): mixed load and one SIGHUP reload lose and leak nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real processes

ROOT = Path(__file__).resolve().parents[2]
# soak.py fails a run whose workers' RSS or open fds drift more than this under steady load. Three runs of this test
# measured RSS drift 0.0005 to 0.0061 and fd drift 0 to 0.04 (one fd of 25); 0.1 leaves room for a second fd.
MAX_DRIFT = 0.1


def test_twenty_seconds_of_mixed_load_with_a_reload(tiny_model_dirs, tmp_path):
    argv = [
        sys.executable,
        str(ROOT / "scripts" / "soak.py"),
        *("--duration", "20", "--model", str(tiny_model_dirs["llama"]), "--dtype", "float32", "--quantization", "none"),
        *("--sample-every", "1.6", "--request-timeout", "180", "--max-drift", str(MAX_DRIFT), "--out", str(tmp_path)),
    ]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-6000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    summary, samples = report["summary"], report["samples"]

    assert summary["failures_by_category"] == {}, report["failures"][:10]
    assert summary["5xx"] == summary["hung"] == summary["mismatches"] == 0
    assert summary["greedy_checked"] >= 10  # texts compared equal to their greedy reference
    ok = {kind: counts.get("ok", 0) for kind, counts in summary["requests"].items()}
    for kind in ("resume", "disconnect", "sampled_n", "bad_request", "completion", "chat"):
        assert ok.get(kind, 0) >= 1, (kind, summary["requests"])

    reload = summary["reload"]
    assert reload["new_pids"] and not set(reload["new_pids"]) & set(reload["old_pids"]), reload
    assert samples[0]["worker_pids"] == reload["old_pids"] and samples[-1]["worker_pids"] == reload["new_pids"]
    assert summary["final"]["idle"] and summary["final"]["kv_blocks_in_use"] == 0, summary["final"]
    assert len(samples) >= 10
    # Measured (None when too few samples under load), and within the bound the script enforced.
    assert summary["rss_drift"] is not None and summary["rss_drift"] <= MAX_DRIFT, summary
    assert summary["fd_drift"] is not None and summary["fd_drift"] <= MAX_DRIFT, summary
    # Once idle, the new worker holds no more fds than under load (connections closed) nor more memory than drift.
    idle = samples[-1]
    busy = ("load", "last_requests")  # the new worker's load after the reload can be a single sample
    loaded = [s for s in samples if s["phase"] in busy and s["worker_pids"] == idle["worker_pids"]]
    assert idle["phase"] == "idle" and loaded, samples
    assert idle["open_fds"] <= max(s["open_fds"] for s in loaded), (idle, loaded)
    assert idle["rss_bytes"] <= (1 + MAX_DRIFT) * min(s["rss_bytes"] for s in loaded), (idle, loaded)
    assert (tmp_path / "soak.png").read_bytes().startswith(b"\x89PNG")
