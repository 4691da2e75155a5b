#!/usr/bin/env python
"""The packed multiply alone: G multiply-adds a second of each library and format, at a prefill's rows and at one.

Random blocks of each GGUF format (every code bit random, the float16 scales small numbers), laid out as a load lays
them out, multiplied by random rows with 8-bit activations; the best of 3 timings. Example, the installed builds this
CPU runs side by side:

    .venv/bin/python scripts/bench_gemm.py wsgi_infer/engine/kernels/lib/cpu_kernels-avx512-vnni.so \\
        wsgi_infer/engine/kernels/lib/cpu_kernels-avx2.so --formats Q4_0 IQ4_NL Q4_K IQ4_XS
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from wsgi_infer.engine.kernels.block_fields import FILE_BLOCK_BYTES, FORMATS
from wsgi_infer.engine.kernels.cpu import CpuKernels
from wsgi_infer.engine.kernels.packed import PackedWeight, packed_part, packed_weight
from wsgi_infer.engine.runtime.huge_pages import HugePageArena

# where each format's float16 scales lie in a block (the rest of a block is codes and sub-block scales: any bits)
SCALES_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.IQ4_NL: [0]}
SCALES_AT |= {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_XS: [0]}


def random_weight(kernels: CpuKernels, fmt: Q, n: int, k: int) -> PackedWeight:
    raw = torch.randint(0, 256, (n, k // FORMATS[fmt], FILE_BLOCK_BYTES[fmt]), dtype=torch.uint8)
    for at in SCALES_AT[fmt]:
        raw[..., at : at + 2] = (torch.randn(raw.shape[:2]) * 0.01).half().view(torch.uint8).view(*raw.shape[:2], 2)
    raw = raw.reshape(n, -1)
    part = packed_part(fmt, n, lambda a, b: raw[a:b].contiguous(), HugePageArena(), kernels.tile_blocks)
    return packed_weight([part], True)


def rate(kernels: CpuKernels, x: torch.Tensor, weight: PackedWeight, repeats: int) -> float:
    kernels.packed_mm(x, weight)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            kernels.packed_mm(x, weight)
        best = min(best, (time.perf_counter() - start) / repeats)
    return x.shape[0] * weight.n * weight.k / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="+", type=Path)
    parser.add_argument("--formats", nargs="+", default=["Q4_0", "IQ4_NL", "Q4_K", "IQ4_XS"])
    parser.add_argument("--rows", nargs="+", type=int, default=[512, 1])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=2048)
    args = parser.parse_args()
    print("| library | format | " + " | ".join(f"{rows} rows, G MAC/s" for rows in args.rows) + " |")
    print("|---|---|" + "---|" * len(args.rows))
    for library in args.libraries:
        kernels = CpuKernels(library)
        for name in args.formats:
            weight = random_weight(kernels, Q[name], args.n, args.k)
            rates = [rate(kernels, torch.randn(rows, args.k), weight, max(3, 600 // rows)) for rows in args.rows]
            print(f"| {library.stem} | {name} | " + " | ".join(f"{r:.0f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
