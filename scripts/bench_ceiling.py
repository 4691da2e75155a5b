#!/usr/bin/env python
"""The machine's ceiling for a model: one decode step's weight multiplies alone.

For every batch size, times the multiplies of one step with the model's own
shapes (each layer's fused QKV, output, gate-up and down projections, and the
LM head), in every format the engine has on this device: the model dtype
through ``F.linear`` (bf16 on a CPU with native bf16), int4 and int8 groups
of 32 on the CPU kernels where they build, and torch's int4 groups and int8
channels. Every
layer gets distinct weights, so they do not sit in a cache. The ceiling at a
batch is batch / (fastest format's time): no step can produce tokens faster,
whatever else it does. Example:

    .venv/bin/python scripts/bench_ceiling.py --batch 1 4 16 64 --out ceiling.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

from wsgi_infer.engine.kernels.cpu import load_cpu_kernels
from wsgi_infer.engine.kernels.weight_groups import Int4Groups, Int8Groups
from wsgi_infer.engine.layers.quantization import PackedLinear, TorchInt4Linear, TorchInt8Linear
from wsgi_infer.engine.loading.model_loader import load_config, resolve_model_dir
from wsgi_infer.engine.runtime.cpu_info import cpu_model_name
from wsgi_infer.engine.runtime.device import resolve_dtype


def step_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of each weight multiply of one step, layer by layer, then the LM head."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    per_layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return per_layer * config.num_hidden_layers + [(config.vocab_size, hidden)]


def formats(shapes: list[tuple[int, int]], dtype: torch.dtype) -> dict[str, tuple[list, torch.dtype]]:
    """The step's weights in each format: callables on activations, and the activations' dtype."""
    torch.manual_seed(0)
    linears = [nn.Linear(k, n, bias=False, dtype=dtype) for n, k in shapes]
    found = {str(dtype).removeprefix("torch."): ([lambda x, w=lin.weight: F.linear(x, w) for lin in linears], dtype)}
    if dtype == torch.bfloat16:
        groups = [Int4Groups.from_weight(lin.weight) for lin in linears]
        found["int4 torch"] = ([TorchInt4Linear(lin, g).packed_mm for lin, g in zip(linears, groups)], dtype)
        found["int8 torch"] = ([TorchInt8Linear(lin).packed_mm for lin in linears], dtype)
    kernels = load_cpu_kernels()
    if kernels is not None:  # the kernels take float32 activations, whatever the weights were
        for bits, groups_of in ((4, Int4Groups.from_weight), (8, Int8Groups.from_weight)):
            packed = [PackedLinear(lin, groups_of(lin.weight), kernels).packed_mm for lin in linears]
            found[f"int{bits} kernels"] = (packed, torch.float32)
    return found


def step_ms(multiplies: list, shapes: list[tuple[int, int]], batch: int, dtype: torch.dtype, repeats: int) -> float:
    inputs = {k: torch.randn(batch, k, dtype=dtype) for _, k in shapes}
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        for multiply, (_, k) in zip(multiplies, shapes):
            multiply(inputs[k])
        best = min(best, time.perf_counter() - start)
    return best * 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per cell; the fastest counts")
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args()
    config = load_config(resolve_model_dir(args.model))
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    shapes = step_shapes(config)
    found = formats(shapes, dtype)
    rows = []
    cpu = cpu_model_name()
    print(f"# {cpu}, {torch.get_num_threads()} threads, {len(shapes)} multiplies per step")
    for batch in args.batch:
        times = {name: step_ms(mult, shapes, batch, x_dtype, args.repeats) for name, (mult, x_dtype) in found.items()}
        fastest = min(times, key=times.get)
        rows.append({"batch": batch, "ms": times, "fastest": fastest, "ceiling_tok_s": batch * 1e3 / times[fastest]})
        cells = "  ".join(f"{name} {ms:7.2f} ms" for name, ms in times.items())
        print(f"batch {batch:3d}: {cells}  -> ceiling {rows[-1]['ceiling_tok_s']:7.0f} tok/s ({fastest})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": config.name_or_path, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
