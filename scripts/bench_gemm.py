#!/usr/bin/env python
"""The packed multiply alone: G multiply-adds a second of each library and format, at a prefill's rows and at one.

Random blocks of each GGUF format (every code bit random, the float16 scales small numbers), laid out as a load lays
them out, multiplied by random rows with 8-bit activations; the best of 3 timings. Example, the installed builds this
CPU runs side by side:

    .venv/bin/python scripts/bench_gemm.py wsgi_infer/engine/kernels/lib/cpu_kernels-avx512-vnni.so \\
        wsgi_infer/engine/kernels/lib/cpu_kernels-avx2.so --formats Q4_0 IQ4_NL Q4_K IQ4_XS

With ``--rounds N`` the libraries take turns N times and each cell is the median of its rounds (their range in
brackets): this machine's clock and bandwidth move from minute to minute, so only turns taken side by side compare.
With ``--copies N`` each format's weight is N copies multiplied in turn, so that with enough of them (8 of 8,192 x
3,072 Q4_K: 113 MB) each multiply reads its weight from memory, as a model's decode step does, not from L3.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from wsgi_infer.engine.kernels.cpu import CpuKernels
from wsgi_infer.engine.kernels.packed import PackedWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the kernel tests' random blocks of a format, laid out as a load lays them out
from tests.support.kernel_libraries import packed_from_file, random_file_blocks  # noqa: E402


def rate(kernels: CpuKernels, x: torch.Tensor, copies: list[PackedWeight], repeats: int) -> float:
    for weight in copies:
        kernels.packed_mm(x, weight)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            for weight in copies:
                kernels.packed_mm(x, weight)
        best = min(best, (time.perf_counter() - start) / repeats / len(copies))
    return x.shape[0] * copies[0].n * copies[0].k / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="+", type=Path)
    parser.add_argument("--formats", nargs="+", default=["Q4_0", "IQ4_NL", "Q4_K", "IQ4_XS"])
    parser.add_argument("--rows", nargs="+", type=int, default=[512, 1])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=1, help="rounds alternating the libraries: medians (range)")
    parser.add_argument("--copies", type=int, default=1, help="copies of each weight multiplied in turn")
    args = parser.parse_args()
    weights = {
        name: [packed_from_file(random_file_blocks(Q[name], args.n, args.k), Q[name]) for _ in range(args.copies)]
        for name in args.formats
    }
    kernels = [CpuKernels(library) for library in args.libraries]
    rates: dict[tuple[int, str, int], list[float]] = {}
    for _ in range(args.rounds):  # each round every library in turn: the machine's swings fall on all of them
        for i, library in enumerate(kernels):
            for name, copies in weights.items():
                for rows in args.rows:
                    measured = rate(library, torch.randn(rows, args.k), copies, max(3, 600 // rows // args.copies))
                    rates.setdefault((i, name, rows), []).append(measured)
    print("| library | format | " + " | ".join(f"{rows} rows, G MAC/s" for rows in args.rows) + " |")
    print("|---|---|" + "---|" * len(args.rows))
    for i, library in enumerate(args.libraries):
        for name in args.formats:
            cells = []
            for rows in args.rows:
                got = rates[(i, name, rows)]
                median = statistics.median(got)
                cells.append(f"{median:.0f}" if len(got) == 1 else f"{median:.0f} ({min(got):.0f}-{max(got):.0f})")
            print(f"| {library.stem} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
