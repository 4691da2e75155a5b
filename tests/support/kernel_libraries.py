"""The CPU kernels' libraries a test multiplies with, the packed weights it multiplies, and their references."""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from wsgi_infer.engine.kernels import variants
from wsgi_infer.engine.kernels.block_fields import FILE_BLOCK_BYTES, FORMATS, file_blocks, from_values
from wsgi_infer.engine.kernels.build import build_cpu_kernels, installed_dir
from wsgi_infer.engine.kernels.cpu import CpuKernels, load_cpu_kernels
from wsgi_infer.engine.kernels.packed import PackedWeight, packed_part, packed_weight
from wsgi_infer.engine.runtime.cpu_info import cpu_flags
from wsgi_infer.engine.runtime.huge_pages import HugePageArena

from .prerequisites import unavailable

# Every library a CPU like this one may load: each installed variant it runs (x86-64-v2 is the path without
# AVX2), clang's build, and a build here where none is installed.
INSTALLED_HERE = variants.runnable(variants.installed_variants(installed_dir()) or [], cpu_flags())
LIBRARIES = [*(f"installed {v.name}" for v in INSTALLED_HERE), *([] if INSTALLED_HERE else ["built here"]), "clang"]
# the GGUF types the kernels read
FILE_FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]


def _clang_build(tmp_path_factory) -> Path:
    """clang's build of the kernels, once a run: every module and xdist worker that asks takes the one build (10 s of
    a core each), made under a lock in the run's directory, which the workers' own directories share."""
    if shutil.which("clang") is None:
        unavailable("no clang here (Debian's)")
    base = tmp_path_factory.getbasetemp()
    run_dir = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    target = run_dir / "cpu_kernels-clang.so"
    with open(run_dir / "cpu_kernels-clang.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            assert variants.compile_library("clang", ("-march=native",), target) is None
    return target


def library(which: str, tmp_path_factory) -> Path:
    if which == "clang":
        return _clang_build(tmp_path_factory)
    if which.startswith("installed "):
        return installed_dir() / variants.Variant(which.removeprefix("installed "), (), frozenset()).file_name()
    path = build_cpu_kernels()
    assert path is not None, "the test machine has a C compiler"
    return path


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape) * scale


def random_file_blocks(ggml_type: int, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """A tensor [rows, k] as GGUF blocks of the type (uint8 [rows, row bytes]): every code and sub-block scale bit
    random, each float16 scale (d, and the minimum or dmin) a small number of either sign."""
    generator = torch.Generator().manual_seed(seed)
    inputs = FORMATS[ggml_type]
    raw = torch.randint(
        0, 256, (rows, k // inputs, FILE_BLOCK_BYTES[ggml_type]), dtype=torch.uint8, generator=generator
    )
    for at in _HALVES_AT[ggml_type]:
        halves = (torch.randn(rows, k // inputs, generator=generator) * 0.01).half()
        raw[..., at : at + 2] = halves.view(torch.uint8).view(rows, k // inputs, 2)
    return raw.reshape(rows, -1)


def largest_file_blocks(ggml_type: int, rows: int, k: int) -> torch.Tensor:
    """random_file_blocks with each code and sub-block scale at its largest magnitude: every byte 0xFF but the
    float16 scales, and Q6_K's signed 8-bit scales -128."""
    raw = random_file_blocks(ggml_type, rows, k).view(rows, k // FORMATS[ggml_type], -1)
    largest = torch.full_like(raw, 0xFF)
    for at in _HALVES_AT[ggml_type]:
        largest[..., at : at + 2] = raw[..., at : at + 2]
    if ggml_type == Q.Q6_K:
        largest[..., 192:208] = 0x80  # its 16 scales, after 128 bytes of low and 64 of high code bits
    return largest.reshape(rows, -1)


_HALVES_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2]}
_HALVES_AT |= {Q.Q6_K: [208], Q.IQ4_NL: [0], Q.IQ4_XS: [0]}


def file_values(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """gguf-py's values of a tensor's blocks: the reference every packed format is held to."""
    return torch.from_numpy(gguf.dequantize(raw.numpy(), ggml_type)).reshape(raw.shape[0], -1)


@functools.cache
def _layout_kernels() -> CpuKernels:
    """Any library lays out tiles the same way (``c/tiles.c`` has no ISA's code): the one this CPU loads."""
    kernels = load_cpu_kernels()
    assert kernels is not None, "the test machine has the CPU kernels"
    return kernels


def _tile_blocks(fmt: int, blocks: torch.Tensor | np.ndarray, tiles: torch.Tensor) -> None:
    _layout_kernels().tile_blocks(fmt, blocks, tiles)


def packed_from_file(raw: torch.Tensor | np.ndarray, ggml_type: int) -> PackedWeight:
    part = packed_part(ggml_type, raw.shape[0], lambda a, b: raw[a:b], HugePageArena(), _tile_blocks)
    return packed_weight([part], True)


def packed_from_values(weight: torch.Tensor, levels: int = 255) -> PackedWeight:
    fields = from_values(weight, levels)
    blocks = file_blocks(fields)
    part = packed_part(fields.format, len(blocks), lambda a, b: blocks[a:b], HugePageArena(), _tile_blocks)
    return packed_weight([part], False)


def activation_span(weight: PackedWeight) -> int:
    """Inputs that share an activation scale before the weight (c/activations.h): a super-block where a part has
    super-blocks (K-quants, IQ4_XS: as llama.cpp's Q8_K), else a 32-input block."""
    return 256 if any(FORMATS[part.format] == 256 for part in weight.parts) else 32


def quantized_rows(x: torch.Tensor, planes: int, span: int = 32) -> torch.Tensor:
    """What the kernels multiply (c/activations.h), in float64: each block of 32 inputs as integers times its scale,
    rounded to 127ths (8-bit) or 32512ths (the exact path) of the largest magnitude of its span, ties to even."""
    spans = x.view(x.shape[0], -1, span)
    d = spans.abs().amax(-1, keepdim=True) / (127.0 if planes == 1 else 32512.0)
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(spans * inverse).double() * d.double()).view_as(x)
