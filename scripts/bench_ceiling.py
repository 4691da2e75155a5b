#!/usr/bin/env python
"""The machine's ceiling for a model: one decode step's weight multiplies alone, as the engine packs them.

For every batch size, times the packed multiplies of one step (each layer's fused QKV, output, gate-up and down
projections, and the LM head) on the CPU kernels, in both activation modes, over the model's own packed weights
(a GGUF's own blocks), each layer's distinct weights read from memory as a step reads them. Reports the step's
time, the bytes it reads a second (at one row: the share of the machine's read bandwidth a stream can reach,
``bench_bandwidth.py``), multiply-adds a second, and the ceiling: batch / time, which no step can beat, whatever
else it does. Example:

    .venv/bin/python scripts/bench_ceiling.py --model shaped-1b-Q4_K_M.gguf --batch 1 16 512 --out ceiling.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from wsgi_infer import LLM
from wsgi_infer.engine.layers.quantization import PackedLinear
from wsgi_infer.engine.runtime.cpu_info import cpu_model_name


def step_layers(llm: LLM) -> list[PackedLinear]:
    """The packed layers a step multiplies, in the order it does."""
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]


def time_step(layers: list[PackedLinear], rows: int, repeats: int) -> float:
    """The fastest of ``repeats`` passes over every layer, after a warm-up pass."""
    inputs = {layer.in_features: torch.randn(rows, layer.in_features) for layer in layers}
    best = float("inf")
    for run in range(repeats + 1):
        start = time.perf_counter()
        for layer in layers:
            layer.kernels.packed_mm(inputs[layer.in_features], layer.packed)
        if run:
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the shipped model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    llm = LLM(model=args.model, device="cpu")
    layers = step_layers(llm)
    kernels = llm.engine.runner.kernels
    weight_bytes = sum(layer.packed.nbytes for layer in layers)
    macs = sum(layer.packed.n * layer.packed.k for layer in layers)
    figures = []
    for activations in ("int8", "int16"):
        kernels.use_exact_activations(activations == "int16")
        for rows in args.batch:
            seconds = time_step(layers, rows, args.repeats if rows <= 64 else 1)
            figure = {"activations": activations, "rows": rows, "step_ms": seconds * 1e3}
            figure |= {"weight_gb_s": weight_bytes / seconds / 1e9, "gmac_s": macs * rows / seconds / 1e9}
            figures.append(figure | {"ceiling_tok_s": rows / seconds})
            print(
                f"{activations} activations, {rows} rows: {seconds * 1e3:.1f} ms, {figure['weight_gb_s']:.1f} GB/s "
                f"of weights, {figure['gmac_s']:.1f} GMAC/s, ceiling {rows / seconds:.1f} tok/s"
            )
    result = {"cpu": cpu_model_name(), "model": args.model or "default", "weight_mb": weight_bytes / 1e6}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result | {"figures": figures}, f, indent=2)


if __name__ == "__main__":
    main()
