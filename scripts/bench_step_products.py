#!/usr/bin/env python
"""One stream's products as a decode step runs them: the Llama 3.2 1B shape's 16 layers of one-row multiplies (the
fused qkv, o, gate and up, down; Q4_K, with Q6_K for half the layers' down as Q4_K_M files have it) and its 49,152 x
2,048 Q6_K LM head, one after another, each kind's GB/s of its weights; beside them one Q4_K matrix of 151 MB, what
the memory gives a single long read in the same minute; and a one-tile multiply, what a call costs beyond its reads.
Random blocks laid out as a load lays them out (as ``bench_gemm.py``), 8-bit activations, no speculation in a bare
multiply. The machine's bandwidth moves from minute to minute, so only the figures of one round compare:

    .venv/bin/python scripts/bench_step_products.py --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from wsgi_infer.engine.kernels.cpu import CpuKernels, load_cpu_kernels
from wsgi_infer.engine.kernels.packed import PackedWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.kernel_libraries import packed_from_file, random_file_blocks  # noqa: E402

LAYERS = 16
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def weight(fmt: str, n: int, k: int, seed: int) -> PackedWeight:
    return packed_from_file(random_file_blocks(Q[fmt], n, k, seed), Q[fmt])


def step_weights() -> list[tuple[str, PackedWeight]]:
    step = []
    for layer in range(LAYERS):
        for name, (n, k) in SHAPES.items():
            fmt = "Q6_K" if name == "down" and layer % 2 == 0 else "Q4_K"
            step.append((f"down {fmt}" if name == "down" else name, weight(fmt, n, k, len(step))))
    step.append(("LM head Q6_K", weight("Q6_K", 49152, 2048, len(step))))
    return step


def timed(kernels: CpuKernels, weights: list[PackedWeight], repeats: int) -> tuple[float, list[float]]:
    """The median over repeats of the whole sequence's time, and that repeat's time per multiply. The library is
    called with each weight's arguments made beforehand: ``CpuKernels.packed_mm``'s checks and allocations cost
    some 8 us a call, a fifth of a small matrix's reads, where the fused decoder calls it from C."""
    rows = {k: torch.randn(1, k) for k in {w.k for w in weights}}
    outs = {n: torch.empty(1, n) for n in {w.n for w in weights}}
    calls = [(rows[w.k].data_ptr(), w.struct(), outs[w.n].data_ptr()) for w in weights]
    multiply, threads = kernels._lib.packed_mm, torch.get_num_threads()
    runs = []
    for _ in range(repeats + 2):  # two to warm up
        each = []
        for x, struct, out in calls:
            start = time.perf_counter()
            multiply(x, 1, ctypes.byref(struct), out, kernels.planes, threads)
            each.append(time.perf_counter() - start)
        runs.append((sum(each), each))
    return sorted(runs[2:])[len(runs[2:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("library", nargs="?", type=Path, help="a kernels library (default: the one this CPU runs)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    kernels = CpuKernels(args.library) if args.library else load_cpu_kernels()
    step, large, tile = step_weights(), weight("Q4_K", 131072, 2048, 7), weight("Q4_K", 16, 2048, 8)
    total = sum(w.nbytes for _, w in step)
    print(f"{kernels.build}: the step's weights {total / 1e6:.0f} MB")
    for _ in range(args.rounds):
        wall, each = timed(kernels, [w for _, w in step], 8)
        kinds: dict[str, list[float]] = {}
        for (name, w), seconds in zip(step, each, strict=True):
            kinds.setdefault(name, [0.0, 0.0])
            kinds[name][0] += seconds
            kinds[name][1] += w.nbytes
        cells = ", ".join(f"{name} {nbytes / seconds / 1e9:.1f}" for name, (seconds, nbytes) in kinds.items())
        large_wall, _ = timed(kernels, [large], 6)
        call = statistics.median(timed(kernels, [tile] * 64, 4)[1])
        print(
            f"step {wall * 1e3:.2f} ms, {total / wall / 1e9:.1f} GB/s ({cells}); one 151 MB matrix "
            f"{large.nbytes / large_wall / 1e9:.1f} GB/s; a one-tile call {call * 1e6:.1f} us"
        )


if __name__ == "__main__":
    main()
