"""Twenty seconds of scripts/soak.py (issue 11): mixed load and one SIGHUP reload lose and leak nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real processes

ROOT = Path(__file__).resolve().parent.parent


def test_twenty_seconds_of_mixed_load_with_a_reload(tiny_model_dirs, tmp_path):
    argv = [
        sys.executable,
        str(ROOT / "scripts" / "soak.py"),
        *("--duration", "20", "--model", str(tiny_model_dirs["llama"]), "--dtype", "float32", "--quantization", "none"),
        *("--sample-every", "1.6", "--request-timeout", "180", "--out", str(tmp_path)),
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
    assert len(samples) >= 10 and all(s["rss_bytes"] > 0 and s["open_fds"] > 0 for s in samples)
    assert (tmp_path / "soak.png").read_bytes().startswith(b"\x89PNG")
