#!/usr/bin/env python
"""The machine's read bandwidth: what one decoding stream, which reads every weight once a token, is bound by.

    .venv/bin/python scripts/bench_bandwidth.py

Two probes over 1 GiB (far beyond any cache), with as many threads as cores, the best of a few runs, in GB/s:
``bandwidth_probe.c`` (built here with the C compiler: the CPU's widest loads, eight accumulators, prefetching
0 to 8 KiB ahead, in 4 KB pages and in 2 MB ones, as the packed weights lie), and torch's sum of a float32 tensor.
A stream's share of it: the bytes a token reads (its packed weights) times tokens a second, over the best.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

GIB = 1 << 30
PROBE = Path(__file__).with_name("bandwidth_probe.c")


def torch_sum_gb_s(runs: int = 6) -> float:
    torch.set_num_threads(os.cpu_count() or 1)
    data = torch.ones(GIB // 4, dtype=torch.float32)  # written once: every page is backed
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return GIB / best / 1e9


def probe_gb_s(huge_pages: bool) -> dict[int, float]:
    """The C probe's GB/s for each prefetch distance (bytes ahead)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    with tempfile.TemporaryDirectory() as folder:
        binary = Path(folder) / "probe"
        subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(PROBE), "-o", str(binary)], check=True)
        env = os.environ | {"OMP_NUM_THREADS": str(os.cpu_count())} | ({"HUGE": "1"} if huge_pages else {})
        lines = subprocess.run([str(binary), "1024"], env=env, capture_output=True, text=True, check=True).stdout
    return {int(ahead): float(rate) for ahead, rate in (line.split() for line in lines.splitlines())}


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    threads = os.cpu_count()
    for huge in (False, True):
        rates = probe_gb_s(huge)
        ahead, best = max(rates.items(), key=lambda item: item[1])
        pages = "2 MB pages" if huge else "4 KB pages"
        print(f"C probe, {pages}: {best:.1f} GB/s ({threads} threads, prefetching {ahead} bytes ahead)")
    print(f"torch.sum: {torch_sum_gb_s():.1f} GB/s ({threads} threads)")
