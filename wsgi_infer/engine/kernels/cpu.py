"""The CPU kernels (cpu_kernels.c) as torch functions, called through ctypes.

A one-stream decode step ran ~1,500 torch ops, most of them tiny: RMSNorm and its residual add are 6 (it rounds as
transformers does), SiLU-and-mul 4, rotary 7, attention over the paged cache 12. Their dispatch, not their arithmetic,
was the distance to llama.cpp. Each of these is one call here, packed weights (int4 and int8 groups) have their
own multiply, and ``FusedDecoder`` runs a step's decoder layers in one call. Activations are float32 (bf16 ones
cost a 135M model's greedy output 1-3% of its top-1 agreement with float32, whatever the weights); the KV cache is
bf16. They take CPU tensors contiguous in their last dimension, which the layers give them (see
``attach_kernels``).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .build import kernels_library
from .fused_decoder import DecoderDims, DecoderWeights, FusedDecoder
from .layouts import KernelWeight

log = logging.getLogger(__name__)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _P, _P, _P, _I, _I, _F, ctypes.c_int],
    "silu_mul": [_P, _P, _I, _I, ctypes.c_int],
    "rotate": [_P, _I, _P, _P, _I, _I, _I, _I, ctypes.c_int],
    "head_norm": [_P, _I, _P, _P, _I, _I, _I, _I, _F, ctypes.c_int],
    "paged_attention": [_P, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I, _I, _I, _I, _F, _I, ctypes.c_int],
    "int4_mm": [_P, _I, _P, _P, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int],
    "int4_dequantize": [_P, _P, _P, _P, _I, _I, ctypes.c_int],
    "int8_mm": [_P, _I, _P, _P, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int],
    "int8_dequantize": [_P, _P, _P, _P, _I, _I, ctypes.c_int],
    "decoder_layers": [_P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P, _P, _I, _I, _P],
    "gelu_mul": [_P, _P, _I, _I, ctypes.c_int],
    "argmax_rows": [_P, _I, _I, _P, ctypes.c_int],
}


def _check(t: torch.Tensor, what: str, dtype: torch.dtype = torch.float32) -> None:
    """The kernels read CPU tensors of one dtype with a contiguous last dimension: anything else is a bug upstream,
    which must not become a read past a buffer."""
    if t.dtype != dtype or t.device.type != "cpu" or t.stride(-1) != 1:
        raise TypeError(
            f"{what}: expected {dtype} on the CPU, last dimension contiguous; got {t.dtype} on "
            f"{t.device}, strides {t.stride()}"
        )


def _expect(condition: bool, message: str) -> None:
    """A shape the kernel would read past: a bug upstream, refused before the call."""
    if not condition:
        raise TypeError(message)


@dataclass
class CacheRows:
    """Where each token of a step reads the paged cache, as the kernels take it: a padded block table per
    sequence, and per token its sequence's table row and how many tokens it sees, itself included (a decode
    sees its whole context; each token of a prefill chunk, the context up to itself)."""

    block_size: int
    block_tables: torch.Tensor  # [seqs, max_blocks] int64
    row_seqs: torch.Tensor  # [tokens] int64
    context_lens: torch.Tensor  # [tokens] int64

    def pointers(self) -> tuple[int, int, int, int, int]:
        """block_tables, seqs, max_blocks, row_seqs, context_lens: the kernels' arguments, in their order."""
        seqs, max_blocks = self.block_tables.shape
        return self.block_tables.data_ptr(), seqs, max_blocks, self.row_seqs.data_ptr(), self.context_lens.data_ptr()


class CpuKernels:
    def __init__(self, library: Path) -> None:
        self.library = library
        self.build = library.stem  # names the source, flags and CPU it was built for
        self._lib = ctypes.CDLL(str(library))
        for name, argtypes in _SIGNATURES.items():
            getattr(self._lib, name).argtypes = argtypes
            getattr(self._lib, name).restype = None
        self._dequantized = torch.empty(0, dtype=torch.bfloat16)  # see int4_dequantize
        self._lib.packed_rows_per_pass.argtypes, self._lib.packed_rows_per_pass.restype = [], ctypes.c_int
        # rows a packed multiply computes in one pass over its weight (8 with AVX-512 VNNI, 5 with AVX2)
        self.rows_per_pass: int = self._lib.packed_rows_per_pass()
        self._lib.activations_of_8_bits.argtypes, self._lib.activations_of_8_bits.restype = [], ctypes.c_int
        self.has_int8_activations = bool(self._lib.activations_of_8_bits())  # with AVX2
        self.int8_activations = False  # packed multiplies take the rows as 8-bit groups (use_int8_activations)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of x + residual, x + residual); the sum is written into ``residual`` in place."""
        for t, what in ((x, "x"), (weight, "weight"), (residual, "residual")):
            if t is not None:
                _check(t, f"rms_norm {what}")
        _expect(x.dim() == 2 and weight.shape == (x.shape[1],), f"rms_norm: weight {weight.shape} for x {x.shape}")
        _expect(residual is None or residual.shape == x.shape and residual.is_contiguous(), "rms_norm: residual")
        x = x.contiguous()
        out = torch.empty_like(x)
        ptr = residual.data_ptr() if residual is not None else None
        self._lib.rms_norm(
            x.data_ptr(), ptr, weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads()
        )
        return out, x if residual is None else residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gated(self._lib.silu_mul, gate_up)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU with GELU's tanh approximation (Gemma)."""
        return self._gated(self._lib.gelu_mul, gate_up)

    @staticmethod
    def _gated(function, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up from the rows' [gate | up]."""
        _check(gate_up, "gated activation")
        _expect(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, f"gated activation: rows {gate_up.shape}")
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        function(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], torch.get_num_threads())
        return out

    def rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """x: [tokens, heads, D], rows strided; cos, sin: float32 [tokens, 1, R]: each head's first R dims."""
        for t, what in ((x, "x"), (cos, "cos"), (sin, "sin")):
            _check(t, f"rotate {what}")
        if x.stride(1) != x.shape[2]:
            raise TypeError(f"rotate x: heads must be contiguous in a row, got strides {x.stride()}")
        tokens, heads, head_dim = x.shape
        for table in (cos, sin):
            _expect(table.is_contiguous() and table.numel() == tokens * cos.shape[-1], f"rotate: table {table.shape}")
        _expect(cos.shape[-1] <= head_dim and cos.shape[-1] % 2 == 0, f"rotate: {cos.shape[-1]} of {head_dim} dims")
        tables, dims = (cos.data_ptr(), sin.data_ptr()), (head_dim, cos.shape[-1])
        self._lib.rotate(x.data_ptr(), x.stride(0), *tables, tokens, heads, *dims, torch.get_num_threads())

    def head_norm_(
        self, x: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
    ) -> None:
        """x: [tokens, heads + kv_heads (+ more), D], rows strided: the first ``heads`` of a row normed under
        q_weight, the next ``kv_heads`` under k_weight, in place (each as ``rms_norm`` rounds a row)."""
        for t, what in ((x, "x"), (q_weight, "q weight"), (k_weight, "k weight")):
            _check(t, f"head_norm {what}")
        if x.stride(1) != x.shape[2]:
            raise TypeError(f"head_norm x: heads must be contiguous in a row, got strides {x.stride()}")
        tokens, _, head_dim = x.shape
        _expect(x.shape[1] >= heads + kv_heads, f"head_norm: {heads} + {kv_heads} heads of {x.shape[1]}")
        _expect(q_weight.shape == k_weight.shape == (head_dim,), f"head_norm: weights for heads of {head_dim}")
        args = (q_weight.data_ptr(), k_weight.data_ptr(), tokens, heads, kv_heads, head_dim, eps)
        self._lib.head_norm(x.data_ptr(), x.stride(0), *args, torch.get_num_threads())

    def paged_attention(
        self, q: torch.Tensor, kv_cache: torch.Tensor, rows: CacheRows, scale: float, window: int = 0
    ) -> torch.Tensor:
        """q: float32 [tokens, heads, D], rows strided, each token over its sequence's bf16 cache up to itself (its
        last ``window`` tokens, where that is not 0); -> float32 [tokens, heads * D]."""
        _check(q, "paged_attention q")
        _check(kv_cache, "paged_attention cache", torch.bfloat16)
        if q.stride(1) != q.shape[2] or not kv_cache.is_contiguous():
            raise TypeError("paged_attention: a row's heads and the cache must be contiguous")
        tokens, heads, head_dim = q.shape
        kv_heads = kv_cache.shape[1] // 2
        _expect(kv_cache.dim() == 3 and kv_cache.shape[2] == head_dim, f"paged_attention: cache {kv_cache.shape}")
        _expect(kv_heads > 0 and heads % kv_heads == 0, f"paged_attention: {heads} heads over {kv_heads}")
        for table in (rows.row_seqs, rows.context_lens, rows.block_tables):
            _expect(table.dtype == torch.int64 and table.is_contiguous(), "paged_attention: int64 contiguous tables")
        _expect(len(rows.row_seqs) == len(rows.context_lens) == tokens, "paged_attention: a row per token")
        out = q.new_empty(tokens, heads * head_dim)
        self._lib.paged_attention(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            *rows.pointers(),
            rows.block_size,
            out.data_ptr(),
            tokens,
            heads,
            kv_heads,
            head_dim,
            scale,
            window,
            torch.get_num_threads(),
        )
        return out

    def packed_mm(self, x: torch.Tensor, weight: KernelWeight, n: int) -> torch.Tensor:
        """x [rows, k] times a packed weight [n, k] (``layouts.KernelWeight``) -> [rows, n]."""
        _check(x, "packed_mm x")
        if x.shape[1] != weight.k:
            raise TypeError(f"packed_mm: {x.shape[1]} inputs for a weight of {weight.k}")
        _expect(0 < n <= weight.scale.shape[0] * 16, f"packed_mm: {n} outputs of {weight.scale.shape[0] * 16}")
        x = x.contiguous()
        out = x.new_empty(x.shape[0], n)
        multiply = self._lib.int4_mm if weight.bits == 4 else self._lib.int8_mm
        low = None if weight.low is None else weight.low.data_ptr()
        args = (weight.codes.data_ptr(), weight.scale.data_ptr(), low, out.data_ptr(), n, x.shape[1])
        multiply(x.data_ptr(), x.shape[0], *args, int(self.int8_activations), torch.get_num_threads())
        return out

    def dequantize(self, weight: KernelWeight, n: int, k: int) -> torch.Tensor:
        """The packed weight [n, k] as bf16 (each value rounded once, to nearest even), in a buffer that the next
        call overwrites: a fresh one per weight cost 5 to 12 times the unpacking itself in page faults (the
        allocator hands buffers this large back to the system when they are freed)."""
        _expect(k == weight.k and 0 < n <= weight.scale.shape[0] * 16, f"dequantize: [{n}, {k}] of {weight.k} inputs")
        if self._dequantized.numel() < n * k:
            self._dequantized = torch.empty(n * k, dtype=torch.bfloat16)
        out = self._dequantized[: n * k].view(n, k)
        unpack = self._lib.int4_dequantize if weight.bits == 4 else self._lib.int8_dequantize
        low = None if weight.low is None else weight.low.data_ptr()
        unpack(weight.codes.data_ptr(), weight.scale.data_ptr(), low, out.data_ptr(), n, k, torch.get_num_threads())
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax over the last dimension of float32 rows [rows, n] (the first of equal maxima; NaN
        counts as largest), in one vectorized pass: torch's took 2.5 ms for 64 rows of a 49,152-token
        vocabulary on this machine's EPYC, this 0.3."""
        _check(logits, "argmax")
        _expect(logits.dim() == 2, f"argmax: rows {logits.shape}")
        logits = logits.contiguous()
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.long)
        self._lib.argmax_rows(logits.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
        return out

    def fused_decoder(self, layers: list[DecoderWeights], dims: DecoderDims) -> FusedDecoder:
        return FusedDecoder(self._lib, layers, dims, self.int8_activations)

    def use_int8_activations(self) -> bool:
        """Packed multiplies from now on take each row's groups of 32 as 8-bit integers (llama.cpp's q8
        activations): 2x the products per instruction, each input within 1/254 of its group's largest. False where
        this build has no such path (no AVX2): the rows stay as they are."""
        self.int8_activations = self.has_int8_activations
        return self.int8_activations


def load_cpu_kernels() -> CpuKernels | None:
    """The kernels for this CPU (see build.py), or None where there are none (build.py logged why)."""
    library = kernels_library()  # the server's master may still be building it
    return None if library is None else CpuKernels(library)


def attention_fits(head_dim: int) -> bool:
    """Attention reads heads 16 values at a time: a head size that is no multiple of 16 keeps torch's ops."""
    return head_dim % 16 == 0


def attach_kernels(model: nn.Module, kernels: CpuKernels | None) -> None:
    """Hand the kernels to every layer of ``model`` that has a fused path (a ``kernels`` attribute); those
    that attend (a ``head_dim``) only where ``attention_fits``."""
    for module in model.modules():
        if hasattr(type(module), "kernels"):
            module.kernels = kernels if attention_fits(getattr(module, "head_dim", 16)) else None
