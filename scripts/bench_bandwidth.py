#!/usr/bin/env python
"""The machine's read bandwidth: what one decoding stream, which reads every weight once a token, is bound by.

    .venv/bin/python scripts/bench_bandwidth.py

Sums a 1 GiB float32 tensor (far beyond any cache) with as many threads as cores, the best of a few runs, in GB/s.
torch's sum streams it with the CPU's widest loads; a hand-written AVX2 loop of four loads per iteration and
OpenMP read the same 27.1 GB/s on a 2-core AMD EPYC Zen 4 (2026-11-27). A stream's share of it: the bytes a token
reads (its packed weights) times tokens a second, over this.
"""

from __future__ import annotations

import os
import time

import torch

GIB = 1 << 30


def read_gb_s(runs: int = 6) -> float:
    torch.set_num_threads(os.cpu_count() or 1)
    data = torch.ones(GIB // 4, dtype=torch.float32)  # written once: every page is backed
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return GIB / best / 1e9


if __name__ == "__main__":
    print(f"read bandwidth: {read_gb_s():.1f} GB/s ({os.cpu_count()} threads)")
