"""The CPU kernels (``c/``) as torch functions, called through ctypes.

A one-stream decode step ran ~1,500 torch ops, most of them tiny: RMSNorm and its residual add are 6 (it rounds as
transformers does), SiLU-and-mul 4, rotary 7, attention over the paged cache 12. Their dispatch, not their arithmetic,
was the distance to llama.cpp. Each of these is one call here, packed weights (GGUF's own blocks, ``packed``) have
their own multiply, and ``FusedDecoder`` runs a step's decoder layers in one call. Activations are float32 between
the kernels; a packed multiply takes them as 8-bit integers (llama.cpp's trade, the default) or, on the exact path,
as 16-bit ones. The KV cache holds IEEE halves (llama.cpp's default: 3 more bits than bf16). They take CPU tensors
contiguous in their last dimension, which the layers give them (see ``attach.attach_kernels``).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .block_fields import FILE_BLOCK_BYTES, FORMATS
from .build import kernels_library
from .fused_decoder import DecoderDims, DecoderWeights, FusedDecoder
from .packed import PackedWeight

log = logging.getLogger(__name__)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _P, _P, _P, _I, _I, _F, ctypes.c_int],
    "silu_mul": [_P, _P, _I, _I, ctypes.c_int],
    "rotate": [_P, _I, _P, _P, _I, _I, _I, _I, ctypes.c_int],
    "head_norm": [_P, _I, _P, _P, _I, _I, _I, _I, _F, ctypes.c_int],
    "paged_attention": [_P, _I, _P, _P, _I, _I, _P, _P, _I, _P, _I, _I, _I, _I, _F, _I, ctypes.c_int],
    "packed_mm": [_P, _I, _P, _P, ctypes.c_int, ctypes.c_int],
    "packed_rows": [_P, _P, _I, _P, ctypes.c_int],
    "decoder_layers": [_P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P, _P, _I, _I, _P],
    "gelu_mul": [_P, _P, _I, _I, ctypes.c_int],
    "argmax_rows": [_P, _I, _I, _P, ctypes.c_int],
    "mask_rows": [_P, _I, _P, _I, _P, ctypes.c_int],
    "fill_masks": [_P, _P, _I, _P, _I, _P, ctypes.c_int],
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
        self._lib.packed_rows_per_pass.argtypes, self._lib.packed_rows_per_pass.restype = [], ctypes.c_int
        # rows a packed multiply computes in one pass over its weight (16 with AVX-512, 8 with AVX2, else 4)
        self.rows_per_pass: int = self._lib.packed_rows_per_pass()
        self.one_row_non_temporal = bool(self._lib.packed_one_row_non_temporal())  # AMD's (c/register_passes.h)
        self._lib.packed_block_bytes.argtypes, self._lib.packed_block_bytes.restype = [ctypes.c_int], ctypes.c_int64
        self._lib.tile_blocks.argtypes, self._lib.tile_blocks.restype = [_I, _P, _I, _I, _P, ctypes.c_int], ctypes.c_int
        self._lib.amx_rows.argtypes, self._lib.amx_rows.restype = [_I], _I
        self.planes = 1  # of packed multiplies' activations: 1, 8-bit; 2, the exact path (use_exact_activations)

    def rows_on_tiles(self, rows: int) -> int:
        """Of a packed multiply's ``rows``, those AMX's tiles take (``c/amx_mm.c``): none in a build without them, where
        the OS refuses them, or for fewer rows than 3 passes of 16."""
        return self._lib.amx_rows(rows)

    def block_bytes(self, fmt: int) -> int:
        """The bytes of a tile's block of a format, as the kernels read it (0: a format they do not read)."""
        return self._lib.packed_block_bytes(fmt)

    def tile_blocks(self, fmt: int, blocks: torch.Tensor | np.ndarray, tiles: torch.Tensor) -> None:
        """Rows of a format's blocks as a file holds them (uint8 [rows, bytes a row]: a tensor, or an array that may
        be a read-only view of the mapped file) into ``tiles``, uint8 [tiles of 16 rows, blocks a row, bytes a tile's
        block] (``c/tiles.c``)."""
        if isinstance(blocks, torch.Tensor):
            _check(blocks, "tile_blocks blocks", torch.uint8)
            blocks = blocks.numpy()
        _expect(blocks.dtype == np.uint8 and blocks.ndim == 2, "tile_blocks: uint8 [rows, bytes a row] blocks")
        _check(tiles, "tile_blocks tiles", torch.uint8)
        inputs, file_block = FORMATS[fmt], FILE_BLOCK_BYTES[fmt]
        _expect(blocks.flags.c_contiguous and tiles.is_contiguous(), "tile_blocks: contiguous blocks and tiles")
        _expect(blocks.shape[1] % file_block == 0, f"tile_blocks: rows of {blocks.shape[1]} bytes in format {fmt}")
        _expect(tiles.numel() == -(-blocks.shape[0] // 16) * blocks.shape[1] * 16, "tile_blocks: tiles' size")
        k = blocks.shape[1] // file_block * inputs
        if self._lib.tile_blocks(fmt, blocks.ctypes.data, blocks.shape[0], k, tiles.data_ptr(), _threads()):
            raise ValueError(f"tile_blocks: format {fmt} is not laid out by the kernels")

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
            x.data_ptr(), ptr, weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, _threads()
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
        function(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], _threads())
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
        self._lib.rotate(x.data_ptr(), x.stride(0), *tables, tokens, heads, *dims, _threads())

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
        self._lib.head_norm(x.data_ptr(), x.stride(0), *args, _threads())

    def paged_attention(
        self, q: torch.Tensor, kv_cache: torch.Tensor, rows: CacheRows, scale: float, window: int = 0
    ) -> torch.Tensor:
        """q: float32 [tokens, heads, D], rows strided, each token over its sequence's float16 cache up to itself (its
        last ``window`` tokens, where that is not 0); -> float32 [tokens, heads * D]."""
        _check(q, "paged_attention q")
        _check(kv_cache, "paged_attention cache", torch.float16)
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
            _threads(),
        )
        return out

    def packed_mm(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, k] times a packed weight [n, k] (+ bias) -> [rows, n]."""
        _check(x, "packed_mm x")
        _expect(x.dim() == 2 and x.shape[1] == weight.k, f"packed_mm: {tuple(x.shape)} for a weight of {weight.k}")
        x = x.contiguous()
        out = x.new_empty(x.shape[0], weight.n)
        struct = weight.struct(bias)
        self._lib.packed_mm(x.data_ptr(), x.shape[0], ctypes.byref(struct), out.data_ptr(), self.planes, _threads())
        return out

    def packed_rows(self, weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a packed weight as float32 [*ids.shape, k], each value as gguf-py dequantizes the file's
        blocks (a tied embedding's lookups)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        _expect(bool(((flat >= 0) & (flat < weight.n)).all()), f"packed_rows: ids outside 0..{weight.n - 1}")
        out = torch.empty(len(flat), weight.k)
        struct = weight.struct()
        self._lib.packed_rows(ctypes.byref(struct), flat.data_ptr(), len(flat), out.data_ptr(), _threads())
        return out.view(*ids.shape, weight.k)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax over the last dimension of float32 rows [rows, n] (the first of equal maxima; NaN
        counts as largest), in one vectorized pass: torch's took 2.5 ms for 64 rows of a 49,152-token
        vocabulary on this machine's EPYC, this 0.3."""
        _check(logits, "argmax")
        _expect(logits.dim() == 2, f"argmax: rows {logits.shape}")
        logits = logits.contiguous()
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.long)
        self._lib.argmax_rows(logits.data_ptr(), rows, n, out.data_ptr(), _threads())
        return out

    def mask_rows_(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """In place: float32 rows [rows, n] listed in ``rows`` keep the tokens their int32 bitmask rows allow
        (llguidance's words of 32 tokens, ``bitmask[i]`` for ``rows[i]``), the others -inf."""
        _check(logits, "mask_rows")
        _check(bitmask, "mask_rows", torch.int32)
        _expect(logits.dim() == 2 and logits.is_contiguous(), f"mask_rows: rows {logits.shape}")
        words = (logits.shape[1] + 31) // 32
        _expect(bitmask.is_contiguous() and bitmask.shape == (len(rows), words), f"mask_rows: bits {bitmask.shape}")
        _expect(all(0 <= r < logits.shape[0] for r in rows), f"mask_rows: rows outside 0..{logits.shape[0] - 1}")
        listed, n = torch.tensor(rows, dtype=torch.long), logits.shape[1]
        self._lib.mask_rows(logits.data_ptr(), n, listed.data_ptr(), len(rows), bitmask.data_ptr(), _threads())

    def fill_masks(self, fill: int, matchers: list[int], bitmask: torch.Tensor) -> list[int]:
        """Row i of the int32 ``bitmask`` written by the C function at ``fill`` (llguidance's
        ``llg_matcher_compute_mask_into``) for the matcher at ``matchers[i]``, the rows spread over the steps' threads
        (16 rows of SmolLM2's 49,152 tokens in a JSON string: 1.5 ms one after another). The rows whose call failed."""
        _check(bitmask, "fill_masks", torch.int32)
        _expect(bitmask.dim() == 2 and bitmask.shape[0] == len(matchers), f"fill_masks: bits {bitmask.shape}")
        _expect(bitmask.is_contiguous(), "fill_masks: bits not contiguous")
        status, handles = torch.zeros(len(matchers), dtype=torch.int32), (ctypes.c_void_p * len(matchers))(*matchers)
        words = bitmask.shape[1]
        self._lib.fill_masks(fill, handles, len(matchers), bitmask.data_ptr(), words, status.data_ptr(), _threads())
        return status.nonzero().flatten().tolist()

    def fused_decoder(self, layers: list[DecoderWeights], dims: DecoderDims, final_norm: torch.Tensor) -> FusedDecoder:
        return FusedDecoder(self._lib, layers, dims, final_norm, lambda: self.planes)

    def use_exact_activations(self, exact: bool = True) -> None:
        """Packed multiplies from now on take each row's blocks (32 inputs, 256 before K-quants) as 16-bit integers
        (each input within 2^-16 of its block's largest: the exact path, two 8-bit passes), or as 8-bit ones (1/254:
        llama.cpp's trade)."""
        self.planes = 2 if exact else 1


def _threads() -> int:
    return torch.get_num_threads()


def load_cpu_kernels() -> CpuKernels | None:
    """The kernels for this CPU (see build.py), or None where there are none (build.py logged why)."""
    library = kernels_library()  # the server's master may still be building it
    if library is None:
        return None
    kernels = CpuKernels(library)
    if kernels.rows_on_tiles(1 << 20):
        log.info("CPU kernels: packed multiplies of %d rows and more on AMX's tiles", _FIRST_ROWS_ON_TILES)
    log.info("CPU kernels: a decode's weight fetched %s", "non-temporal" if kernels.one_row_non_temporal else "into L2")
    return kernels


_FIRST_ROWS_ON_TILES = 48  # c/amx_mm.c's amx_rows
