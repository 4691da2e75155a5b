"""The CPU kernels (cpu_kernels.c) as torch functions, called through ctypes.

A one-stream decode step ran ~1,500 torch ops, most of them tiny: RMSNorm and its residual add are 6 (it rounds as
transformers does), SiLU-and-mul 4, rotary 7, attention over the paged cache 12. Their dispatch, not their arithmetic,
was the distance to llama.cpp. Each of these is one call here, int4 weights have their own multiply, and
``FusedDecoder`` runs a step's decoder layers in one call. They take bf16 tensors on the CPU,
contiguous in their last dimension; the layers hand them nothing else (see ``attach_kernels``).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .build import built_library

log = logging.getLogger(__name__)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _P, _P, _P, _I, _I, _F, ctypes.c_int],
    "silu_mul": [_P, _P, _I, _I, ctypes.c_int],
    "rotate": [_P, _I, _P, _P, _I, _I, _I, ctypes.c_int],
    "paged_attention": [_P, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I, _I, _I, _I, _F, ctypes.c_int],
    "int4_mm": [_P, _I, _P, _P, _P, _P, _I, _I, ctypes.c_int],
    "int4_dequantize": [_P, _P, _P, _P, _I, _I, ctypes.c_int],
    "int8_mm": [_P, _I, _P, _P, _P, _I, _I, ctypes.c_int],
    "decoder_layers": [_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _I],
    "rescale_rows": [_P, _P, _P, _P, _P, _I, _I, ctypes.c_int],
    "argmax_rows": [_P, _I, _I, _P, ctypes.c_int],
}


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
        self.build = library.stem  # names the source, flags and CPU it was built for
        self._lib = ctypes.CDLL(str(library))
        for name, argtypes in _SIGNATURES.items():
            getattr(self._lib, name).argtypes = argtypes
            getattr(self._lib, name).restype = None
        self._dequantized = torch.empty(0, dtype=torch.bfloat16)  # see int4_dequantize

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of x + residual, x + residual); the sum is written into ``residual`` in place."""
        out = torch.empty_like(x)
        ptr = residual.data_ptr() if residual is not None else None
        self._lib.rms_norm(
            x.data_ptr(), ptr, weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads()
        )
        return out, x if residual is None else residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], torch.get_num_threads())
        return out

    def rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """x: [tokens, heads, D], rows strided; cos, sin: float32 [tokens, 1, D]."""
        tokens, heads, head_dim = x.shape
        threads = torch.get_num_threads()
        self._lib.rotate(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, head_dim, threads)

    def paged_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, rows: CacheRows, scale: float) -> torch.Tensor:
        """q: [tokens, heads, D], rows strided, each token over its sequence's cache up to itself;
        -> [tokens, heads * D]."""
        tokens, heads, head_dim = q.shape
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
            kv_cache.shape[1] // 2,
            head_dim,
            scale,
            torch.get_num_threads(),
        )
        return out

    def int4_mm(
        self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, n: int
    ) -> torch.Tensor:
        """x [rows, k] times an int4 weight [n, k] in the kernels' layout (``int4_kernel_layout``) -> [rows, n]."""
        x = x.contiguous()
        out = x.new_empty(x.shape[0], n)
        self._lib.int4_mm(
            x.data_ptr(),
            x.shape[0],
            codes.data_ptr(),
            scale.data_ptr(),
            low.data_ptr(),
            out.data_ptr(),
            n,
            x.shape[1],
            torch.get_num_threads(),
        )
        return out

    def int8_mm(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
        """x [rows, k] times an int8 weight [n, k] in the kernels' layout (``int8_kernel_layout``), scaled per
        output (float32 ``scale`` [n, padded to 16]) -> [rows, n]."""
        x = x.contiguous()
        out = x.new_empty(x.shape[0], n)
        args = (codes.data_ptr(), scale.data_ptr(), out.data_ptr(), n, x.shape[1], torch.get_num_threads())
        self._lib.int8_mm(x.data_ptr(), x.shape[0], *args)
        return out

    def int4_dequantize(self, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, n: int) -> torch.Tensor:
        """The int4 weight [n, k] in the kernels' layout, as bf16 (each value rounded once, to nearest even),
        in a buffer that the next call overwrites: a fresh one per weight cost 5 to 12 times the unpacking
        itself in page faults (the allocator hands buffers this large back to the system when they are freed)."""
        k = codes.shape[1] * 32
        if self._dequantized.numel() < n * k:
            self._dequantized = torch.empty(n * k, dtype=torch.bfloat16)
        out = self._dequantized[: n * k].view(n, k)
        self._lib.int4_dequantize(
            codes.data_ptr(), scale.data_ptr(), low.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads()
        )
        return out

    def rescale_rows(
        self, y: torch.Tensor, width: torch.Tensor, low: torch.Tensor, row_sums: torch.Tensor
    ) -> torch.Tensor:
        """bf16(y * width + low * row_sums) for float32 y [rows, n], width and low [rows, 1], row_sums [n]:
        RowwiseInt8Linear's torch ops, rounded as they round, in one pass instead of three."""
        out = y.new_empty(y.shape, dtype=torch.bfloat16)
        rows, n = y.shape
        self._lib.rescale_rows(
            y.data_ptr(),
            width.data_ptr(),
            low.data_ptr(),
            row_sums.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            torch.get_num_threads(),
        )
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax over the last dimension of float32 rows [rows, n] (the first of equal maxima; NaN
        counts as largest), in one vectorized pass: torch's took 2.5 ms for 64 rows of a 49,152-token
        vocabulary on this machine's EPYC, this 0.3."""
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.long)
        self._lib.argmax_rows(logits.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
        return out

    def fused_decoder(self, layers: list[DecoderWeights], dims: DecoderDims) -> FusedDecoder:
        return FusedDecoder(self._lib, layers, dims)


def int8_kernel_layout(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [n, k] per output channel as ``int8_mm`` reads them, 16 outputs at a time and inputs in pairs
    (n padded to a multiple of 16, k to one of 32, with zeros): [n / 16, k / 2, 16, 2]; and their scales as
    float32 [n padded]."""
    codes = F.pad(codes, (0, -codes.shape[1] % 32, 0, -codes.shape[0] % 16))
    scale = F.pad(scale.float(), (0, -scale.shape[0] % 16))
    return codes.view(-1, 16, codes.shape[1] // 2, 2).transpose(1, 2).contiguous(), scale


def int4_kernel_layout(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Int4 groups (``Int4Groups``: GGUF's block bytes [n, k / 2], ``w = (q - 8) * scale + zero``) as
    ``int4_mm`` reads them, 16 outputs at a time (n padded to a multiple of 16): codes [n / 16, k / 32, 8, 32],
    chunk c's byte j holding output j // 2's codes for inputs 2c + j % 2 (low nibble) and 2(c + 8) + j % 2
    (high), which is that output's block byte 2c + j % 2; float16 scale and low (``w = q * scale + low``)
    [n / 16, k / 32, 16]. So the codes are the blocks' byte pairs, transposed: no nibble moves. A GGUF stores each
    block's ``d`` and ``m`` in float16, and ``Int4Groups.from_weight`` rounds them there too, so half precision
    holds them exactly, in 20 bytes per 32 weights where float32 took 24 (one row over 30 layers: 13-14% less time)."""
    pad = -codes.shape[0] % 16
    codes, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scale.float(), zero.float()))
    tiles, groups = codes.shape[0] // 16, codes.shape[1] // 16
    pairs = codes.view(torch.int16).view(tiles, 16, groups, 8).permute(0, 2, 3, 1)  # [tiles, groups, chunk, out]
    kernel_codes = pairs.contiguous().view(torch.uint8).view(tiles, groups, 8, 32)

    def by_tile(t: torch.Tensor) -> torch.Tensor:
        return t.view(tiles, 16, groups).transpose(1, 2).contiguous()

    return kernel_codes, by_tile(scale).half(), by_tile(zero - 8 * scale).half()


# --- the fused decoder: a decode step's layers in one call -------------------------------------------------
class _Int4Weight(ctypes.Structure):
    _fields_ = [("codes", _P), ("scale", _P), ("low", _P), ("bias", _P), ("n", _I), ("k", _I)]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_attention_norm", _P)] + [
        (name, _Int4Weight) for name in ("qkv", "o", "gate_up", "down")
    ]


class _DecoderShape(ctypes.Structure):
    _fields_ = [
        *((name, _I) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size")),
        ("eps", _F),
        ("scale", _F),
        ("threads", ctypes.c_int),
    ]


@dataclass
class DecoderWeights:
    """One Llama decoder layer as the fused decoder reads it: norms' weights, and four int4 projections,
    each with ``codes``, ``scale``, ``low`` (``int4_kernel_layout``) and ``bias`` (or None)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module


@dataclass
class DecoderDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class FusedDecoder:
    """``decoder_layers``: every decoder layer of a step, in one call (cpu_kernels.c).
    The weights' addresses are laid out once; the step's own tensors are passed per call."""

    def __init__(self, lib: ctypes.CDLL, layers: list[DecoderWeights], dims: DecoderDims) -> None:
        self._lib = lib
        self._dims = dims
        self._layers = (_DecoderLayer * len(layers))(*map(self._layer, layers))
        self._kept = layers  # the addresses above stay valid while the layers live
        self._caches: list[torch.Tensor] | None = None
        self._cache_pointers = (_P * len(layers))()

    @staticmethod
    def _layer(weights: DecoderWeights) -> _DecoderLayer:
        def int4(linear: nn.Module) -> _Int4Weight:
            bias = linear.bias.data_ptr() if linear.bias is not None else None
            n, k = linear.out_features, linear.in_features
            return _Int4Weight(linear.codes.data_ptr(), linear.scale.data_ptr(), linear.low.data_ptr(), bias, n, k)

        projections = (int4(weights.qkv), int4(weights.o), int4(weights.gate_up), int4(weights.down))
        return _DecoderLayer(weights.input_norm.data_ptr(), weights.post_attention_norm.data_ptr(), *projections)

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor], meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [rows, hidden] embeddings, overwritten; cos, sin: [rows, 1, head_dim]; meta: AttentionMetadata.
        Returns (the last layer's output, the residual sum before it), as the layers' loop would."""
        if kv_caches is not self._caches:  # the runner's list: the same one every step
            self._caches = kv_caches
            self._cache_pointers[:] = [cache.data_ptr() for cache in kv_caches]
        rows, d = x.shape[0], self._dims
        shape = _DecoderShape(
            d.hidden,
            d.heads,
            d.kv_heads,
            d.head_dim,
            d.intermediate,
            meta.block_size,
            d.eps,
            d.scale,
            torch.get_num_threads(),
        )
        residual = torch.empty_like(x)
        self._lib.decoder_layers(
            self._layers,
            len(self._layers),
            ctypes.byref(shape),
            self._cache_pointers,
            x.data_ptr(),
            residual.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            meta.slot_mapping.data_ptr(),
            *meta.cache_rows.pointers(),
            rows,
        )
        return x, residual


def load_cpu_kernels() -> CpuKernels | None:
    """The kernels built for this CPU (see build.py), or None where they are not there."""
    library = built_library()  # the server's master may still be building it
    if not library.exists():
        log.warning("no CPU kernels built for this CPU (%s): torch ops serve instead", library)
        return None
    return CpuKernels(library)


def attention_fits(head_dim: int) -> bool:
    """Attention reads heads 16 values at a time: a head size that is no multiple of 16 keeps torch's ops."""
    return head_dim % 16 == 0


def attach_kernels(model: nn.Module, kernels: CpuKernels | None) -> None:
    """Hand the kernels to every layer of ``model`` that has a fused path (a ``kernels`` attribute); those
    that attend (a ``head_dim``) only where ``attention_fits``."""
    for module in model.modules():
        if hasattr(type(module), "kernels"):
            module.kernels = kernels if attention_fits(getattr(module, "head_dim", 16)) else None
