"""The CPU kernels (cpu_kernels.c) as torch functions, called through ctypes.

A one-stream decode step ran ~1,500 torch ops, most of them tiny: RMSNorm and its residual add are 6 (it rounds as
transformers does), SiLU-and-mul 4, rotary 7, attention over the paged cache 12. Their dispatch, not their arithmetic,
was the distance to llama.cpp. Each of these is one call here. They take bf16 tensors on the CPU,
contiguous in their last dimension; the layers hand them nothing else (see ``attach_kernels``).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
from torch import nn

from .build import library_path

log = logging.getLogger(__name__)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _P, _P, _P, _I, _I, _F],
    "silu_mul": [_P, _P, _I, _I],
    "rotate": [_P, _I, _P, _P, _I, _I, _I],
    "decode_attention": [_P, _I, _P, _P, _I, _P, _I, _P, _I, _I, _I, _I, _F, ctypes.c_int],
}


class CpuKernels:
    def __init__(self, library: Path) -> None:
        self._lib = ctypes.CDLL(str(library))
        for name, argtypes in _SIGNATURES.items():
            getattr(self._lib, name).argtypes = argtypes
            getattr(self._lib, name).restype = None

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of x + residual, x + residual); the sum is written into ``residual`` in place."""
        out = torch.empty_like(x)
        ptr = residual.data_ptr() if residual is not None else None
        self._lib.rms_norm(x.data_ptr(), ptr, weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out, x if residual is None else residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1])
        return out

    def rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """x: [tokens, heads, D], rows strided; cos, sin: float32 [tokens, 1, D]."""
        tokens, heads, head_dim = x.shape
        self._lib.rotate(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, head_dim)

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """q: [seqs, heads, D], rows strided; block_table: [seqs, max_blocks]; -> [seqs, heads * D]."""
        seqs, heads, head_dim = q.shape
        out = q.new_empty(seqs, heads * head_dim)
        self._lib.decode_attention(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            block_table.data_ptr(),
            block_table.shape[1],
            context_lens.data_ptr(),
            block_size,
            out.data_ptr(),
            seqs,
            heads,
            kv_cache.shape[1] // 2,
            head_dim,
            scale,
            torch.get_num_threads(),
        )
        return out


def load_cpu_kernels() -> CpuKernels | None:
    """The kernels built for this CPU (see build.py), or None where they are not there."""
    library = library_path()
    if not library.exists():
        log.warning("no CPU kernels built for this CPU (%s): torch ops serve instead", library)
        return None
    return CpuKernels(library)


def attach_kernels(model: nn.Module, kernels: CpuKernels | None) -> None:
    """Hand the kernels to every layer of ``model`` that has a fused path (a ``kernels`` attribute).
    Attention reads heads 16 values at a time: a head size that is no multiple of 16 keeps torch's ops."""
    for module in model.modules():
        if hasattr(type(module), "kernels"):
            module.kernels = kernels if getattr(module, "head_dim", 16) % 16 == 0 else None
