"""``decoder_layers`` (c/decoder.c): every decoder layer of a step and the final norm in one call, for models whose
projections are all packed on the kernels (``layers.quantization.PackedLinear``, in the formats a checkpoint mixes).
The weights' addresses are laid out once; the step's own tensors are passed per call."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .packed import CPackedWeight

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _DecoderLayer(ctypes.Structure):
    _fields_ = [
        *((name, _P) for name in ("input_norm", "post_attention_norm", "q_norm", "k_norm")),
        *((name, _I) for name in ("rope", "window", "local_rope", "gelu")),
        *((name, _P) for name in ("attention_out_norm", "mlp_out_norm")),
        *((name, CPackedWeight) for name in ("qkv", "o", "gate_up", "down")),
    ]


class _DecoderShape(ctypes.Structure):
    _fields_ = [
        *((name, _I) for name in ("hidden", "heads", "kv_heads", "head_dim", "rotary_dim", "intermediate")),
        ("block_size", _I),
        ("eps", _F),
        ("scale", _F),
        ("threads", ctypes.c_int),
        ("planes", ctypes.c_int),  # the packed multiplies' activations (CpuKernels.planes)
        ("final_norm", _P),  # the model's norm after its layers
    ]


@dataclass
class DecoderWeights:
    """One Llama decoder layer as the fused decoder reads it: norms' weights, and four packed projections
    (``PackedLinear``: ``packed`` and ``bias``); the per-head norms of queries and keys where the layer has them,
    whether it rotates them, and its window."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    rope: bool = True
    window: int = 0  # a sliding window's tokens, or 0
    local_rope: bool = False  # the second RoPE tables (Gemma's sliding-window layers)
    gelu: bool = False  # GeGLU (Gemma), else SwiGLU
    attention_out_norm: torch.Tensor | None = None  # Gemma's norms of the attention's and the MLP's outputs
    mlp_out_norm: torch.Tensor | None = None


@dataclass
class DecoderDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecoder:
    def __init__(
        self,
        lib: ctypes.CDLL,
        layers: list[DecoderWeights],
        dims: DecoderDims,
        final_norm: torch.Tensor,
        planes: Callable[[], int],
    ) -> None:
        self._lib = lib
        self._dims = dims
        self._final_norm = final_norm
        self._planes = planes  # the kernels' activations, as they are at each call
        self._layers = (_DecoderLayer * len(layers))(*(self._layer(layer) for layer in layers))
        self._kept = layers  # the addresses above stay valid while the layers live
        self._caches: list[torch.Tensor] | None = None
        self._cache_pointers = (_P * len(layers))()

    @staticmethod
    def _layer(weights: DecoderWeights) -> _DecoderLayer:
        linears = (weights.qkv, weights.o, weights.gate_up, weights.down)
        projections = [linear.packed.struct(linear.bias) for linear in linears]
        norms = (weights.input_norm.data_ptr(), weights.post_attention_norm.data_ptr())
        head_norms = (_address(weights.q_norm), _address(weights.k_norm))
        flags = (int(weights.rope), weights.window, int(weights.local_rope), int(weights.gelu))
        out_norms = (_address(weights.attention_out_norm), _address(weights.mlp_out_norm))
        return _DecoderLayer(*norms, *head_norms, *flags, *out_norms, *projections)

    def __call__(
        self,
        x: torch.Tensor,
        tables: list[tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[torch.Tensor],
        meta,
        stop: int,
    ) -> torch.Tensor:
        """x: [rows, hidden] embeddings, overwritten; tables: (cos, sin) [rows, 1, rotary dims], and a second pair
        for layers with ``local_rope``; meta: AttentionMetadata; stop: the address of an int read before each layer
        (``StepInterrupt``). Returns x: the final norm of the last layer's output and the residual sum, as the
        layers' loop and the model's norm would give it; where ``stop`` was set, part way."""
        cos_sin = (_P * 4)(*(t.data_ptr() for pair in (tables * 2)[:2] for t in pair))
        if kv_caches is not self._caches:  # the runner's list: the same one every step
            self._caches = kv_caches
            self._cache_pointers[:] = [cache.data_ptr() for cache in kv_caches]
        rows, d = x.shape[0], self._dims
        shape = _DecoderShape(
            d.hidden,
            d.heads,
            d.kv_heads,
            d.head_dim,
            tables[0][0].shape[-1],  # the rotated part of a head
            d.intermediate,
            meta.block_size,
            d.eps,
            d.scale,
            torch.get_num_threads(),
            self._planes(),
            self._final_norm.data_ptr(),
        )
        residual = torch.empty_like(x)
        self._lib.decoder_layers(
            self._layers,
            len(self._layers),
            ctypes.byref(shape),
            self._cache_pointers,
            x.data_ptr(),
            residual.data_ptr(),
            cos_sin,
            meta.slot_mapping.data_ptr(),
            *meta.cache_rows.pointers(),
            *self._window_group(meta),
            rows,
            stop,
        )
        return x

    @staticmethod
    def _window_group(meta) -> tuple[int | None, int | None, int]:
        """Slots, block table and its width of the sliding-window layers' own blocks, where they have them."""
        group = meta.window_group
        if group is None:
            return None, None, 0
        table = group.cache_rows.block_tables
        return group.slot_mapping.data_ptr(), table.data_ptr(), table.shape[1]
