"""Packed weight copies for small batches on the CPU: int4 groups or int8 channels.

Decoding a few sequences is bound by reading weights, so a smaller copy of each
weight pays there: int4 groups of 32 (the CPU kernels' ``int4_mm`` where they are
built, else ``torch._weight_int4pack_mm_for_cpu``) or int8 per output channel. Large batches are
compute-bound, where oneDNN's bf16 GEMM (AMX where present) wins, so every layer
has a full-precision weight too and picks by the number of rows in a step.
The crossing point is measured once per weight shape on a machine, and kept.
Int4 layers on the kernels keep no bf16 copy: they unpack their codes into one
for each large step (``int4_dequantize``), 200 MB less for the default model.

int4 groups come from the GGUF's own 4-bit blocks where the checkpoint has them
(``Int4Groups.from_gguf_blocks``: Q4_0 and Q4_1 are exactly torch's layout), so
serving them changes nothing the GGUF held; otherwise from the weights, like Q4_1.
"""

from __future__ import annotations

import logging
import time
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_files import read_json, write_json
from ..cpu_info import cpu_has_vnni, cpu_model_name
from ..device import cpu_has_native_bf16
from ..kernels.cpu import CpuKernels, int4_kernel_layout, int8_kernel_layout

log = logging.getLogger(__name__)

GROUP_SIZE = 32  # GGUF's block size, and one of the group sizes of torch's int4 kernel
ROWS_MEASURED = (1, 2, 4, 8, 16, 32, 64)
ANY_ROWS = 2**31 - 1  # a crossing point no step reaches


@dataclass
class Int4Groups:
    """A weight as 4-bit codes: ``w = (q - 8) * scale + zero`` per group of 32 inputs (torch's convention).

    codes: uint8 [out, in // 2], as GGUF's 4-bit blocks hold them: byte i of a group has input i's code
    in its low nibble and input i + 16's in its high one; scale, zero: float32 [out, in // 32], whose scale
    and ``zero - 8 * scale`` (the group's lowest value) are float16 values, as a GGUF's blocks store them.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int4Groups:
        """Asymmetric min/max codes per group, as GGUF's Q4_1 makes them: scale and minimum in float16."""
        groups = weight.float().view(weight.shape[0], -1, GROUP_SIZE)
        low = groups.amin(-1).half().float()
        scale = ((groups.amax(-1) - low) / 15).half().float()
        steps = (groups - low[..., None]) / scale.clamp(min=2**-24)[..., None]  # scale 0 (a constant group): any code
        q = steps.round().clamp(0, 15).to(torch.uint8)
        codes = q[..., : GROUP_SIZE // 2] | (q[..., GROUP_SIZE // 2 :] << 4)
        return cls(codes.view(weight.shape[0], -1), scale, low + 8 * scale)

    @classmethod
    def cat(cls, parts: list[Int4Groups]) -> Int4Groups:
        """Groups of a fused weight (rows stacked), from its parts'."""
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "zero")))

    @property
    def q(self) -> torch.Tensor:
        """The codes one per input: uint8 [out, in], 0..15."""
        halves = self.codes.view(self.codes.shape[0], -1, GROUP_SIZE // 2)
        return torch.cat([halves & 15, halves >> 4], dim=-1).view(self.codes.shape[0], -1)

    def dequantize(self) -> torch.Tensor:
        scale, zero = (t.repeat_interleave(GROUP_SIZE, dim=1) for t in (self.scale, self.zero))
        return (self.q.float() - 8) * scale + zero


class SmallBatchLinear(nn.Module, ABC):
    """A linear layer that multiplies steps of at most ``max_rows`` rows with a packed copy of its weight."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.dtype = linear.weight.dtype
        self.weight = linear.weight if keep_weight else None
        self.bias = linear.bias
        self.max_rows = 0  # set by measuring: see choose_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_rows:
            return self.full_mm(x)
        y = self.packed_mm(rows).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def full_mm(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.full_weight(), self.bias)

    def full_weight(self) -> torch.Tensor:
        return self.weight

    packed_kernels: CpuKernels | None = None  # the CPU kernels that multiply the packed copy, where they do

    @property
    def kind(self) -> str:
        """What the crossing point is measured for: the class, and which build of the kernels multiplies it
        (a new build is measured anew)."""
        name = type(self).__name__
        return name if self.packed_kernels is None else f"{name} ({self.packed_kernels.build})"

    @property
    def on_kernels(self) -> bool:
        return self.packed_kernels is not None

    @abstractmethod
    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ weight.T`` with the packed copy."""


class Int4Linear(SmallBatchLinear):
    """int4 groups, multiplied by the CPU kernels where they are built (their own layout), else by torch."""

    def __init__(self, linear: nn.Linear, groups: Int4Groups, kernels: CpuKernels | None = None) -> None:
        super().__init__(linear, keep_weight=kernels is None)
        self.packed_kernels = kernels
        if kernels is not None:
            layout = int4_kernel_layout(groups.codes, groups.scale, groups.zero)
            for name, tensor in zip(("codes", "scale", "low"), layout):
                self.register_buffer(name, tensor)
            return
        # innerKTiles 2 packs 2 x 16 codes per group, what the kernel expects for groups of 32.
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32), 2))
        scale_zero = torch.stack([groups.scale, groups.zero], dim=-1).transpose(0, 1)  # [in // 32, out, 2]
        self.register_buffer("scale_zero", scale_zero.to(linear.weight.dtype).contiguous())

    @property
    def kind(self) -> str:
        # "dequantized": the full multiply unpacks the weight first, so earlier measurements do not apply
        return f"Int4Linear ({self.packed_kernels.build}, dequantized)" if self.on_kernels else "Int4Linear"

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed_kernels is not None:
            return self.packed_kernels.int4_mm(rows, self.codes, self.scale, self.low, self.out_features)
        return torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scale_zero)

    def full_weight(self) -> torch.Tensor:
        if self.packed_kernels is None:
            return self.weight
        # valid until the next layer unpacks its own: F.linear uses it at once
        return self.packed_kernels.int4_dequantize(self.codes, self.scale, self.low, self.out_features)


class Int8Linear(SmallBatchLinear):
    """Symmetric int8 per output channel; activations stay in the model dtype. Multiplied by the CPU kernels
    where they are given (their own layout), else by torch."""

    def __init__(self, linear: nn.Linear, kernels: CpuKernels | None = None) -> None:
        super().__init__(linear)
        self.packed_kernels = kernels
        weight_int8, scale = _int8_per_channel(linear.weight)
        if kernels is not None:
            codes, scale = int8_kernel_layout(weight_int8, scale)
            self.register_buffer("codes", codes)
            self.register_buffer("scale", scale)
            return
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale.to(linear.weight.dtype))

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed_kernels is not None:
            return self.packed_kernels.int8_mm(rows, self.codes, self.scale, self.out_features)
        return torch._weight_int8pack_mm(rows, self.weight_int8, self.scale)


class RowwiseInt8Linear(SmallBatchLinear):
    """int8 weights per output channel times int8 activations, each row quantized on its own.

    fbgemm's dynamic int8 multiply sums int8 products in int32, as llama.cpp does for its 8-bit
    blocks: on the default model's LM head it takes a third of the weight-only kernel's time at one
    row, and 60% of bf16's at 16. It quantizes its whole input with one scale and zero point, where
    one row's outliers would cost the others their precision (top-1 agreement of a prompt's rows
    together: 64%). So each row is mapped onto [0, 1] first (``x = low + width * unit``), and one
    more row spans exactly [0, 1]: the kernel's codes then run from each row's own minimum to its
    maximum, always with the same scale, and a row's result never depends on the rest of its batch.
    """

    kernels: CpuKernels | None = None  # rescales the kernel's output in one pass (see kernels.cpu.attach_kernels)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        weight_int8, scale = _int8_per_channel(linear.weight)
        zero = torch.zeros(len(scale), dtype=torch.long)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)  # see rowwise_int8_available
            quantized = torch._make_per_channel_quantized_tensor(weight_int8, scale.double(), zero, 0)
            self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.span = torch.zeros(1, linear.in_features)
        self.span[0, 0] = 1.0
        # W @ low (a constant row) is low * the row sums of W, as the kernel's int8 weights give them.
        self.row_sums = weight_int8.sum(dim=1, dtype=torch.int32).float() * scale

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows.float()
        low = x.amin(dim=1, keepdim=True)
        width = (x.amax(dim=1, keepdim=True) - low).clamp(min=torch.finfo(torch.float32).tiny)
        unit = torch.cat(((x - low) / width, self.span))
        # reduce_range False: full 8-bit activations, safe where VNNI sums in int32 (rowwise_int8_available).
        out = torch.ops.quantized.linear_dynamic(unit, self.packed, False)[:-1]
        if self.kernels is not None and rows.dtype == torch.bfloat16:
            return self.kernels.rescale_rows(out, width, low, self.row_sums)
        return out.mul_(width).addr_(low.squeeze(1), self.row_sums).to(rows.dtype)


def rowwise_int8_available() -> bool:
    """fbgemm is built in and the CPU has VNNI: without it, 8-bit activations would saturate 16-bit sums.

    torch has deprecated its quantized tensors (which fbgemm's packing takes); where they are gone,
    layers fall back to Int8Linear.
    """
    packs = hasattr(torch, "_make_per_channel_quantized_tensor") and hasattr(torch.ops.quantized, "linear_dynamic")
    return packs and "fbgemm" in torch.backends.quantized.supported_engines and cpu_has_vnni()


def _int8_per_channel(weight: torch.Tensor, rows_per_chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes per output channel, and their float32 scales.

    A chunk of rows at a time stays in cache: the default model's LM head packs in 0.1 s, not 0.8.
    """
    w = weight.detach()
    scale = w.abs().amax(dim=1).float().clamp(min=1e-12) / 127.0  # |w|'s maximum is exact in w's dtype
    codes = torch.empty(w.shape, dtype=torch.int8)
    for start in range(0, len(w), rows_per_chunk):
        chunk = w[start : start + rows_per_chunk].float().div_(scale[start : start + rows_per_chunk, None])
        codes[start : start + rows_per_chunk] = chunk.round_().clamp_(-127, 127)
    return codes, scale


def pack_int4_groups(model: nn.Module, source_groups: Callable[[str], Int4Groups | None], kernels: CpuKernels) -> None:
    """Every nn.Linear of ``model`` that the checkpoint holds as 4-bit groups becomes int4 on the kernels,
    in place. They need no weights: called before loading, their full-precision weights are never read."""
    for name, linear in _linear_layers(model):
        groups = source_groups(name)
        if groups is not None:
            model.set_submodule(name, Int4Linear(linear, groups, kernels))


def quantize_linear_layers(
    model: nn.Module,
    method: str,
    source_groups: Callable[[str], Int4Groups | None],
    saved_rows: Path | None = None,
    kernels: CpuKernels | None = None,
) -> dict[str, int]:
    """Wrap every nn.Linear of ``model`` (the LM head included) in place, then choose every packed layer's
    crossing point; how many layers (packed before too) have each kind.

    ``source_groups(name)`` gives the checkpoint's own 4-bit blocks for a layer, or None. int8: every
    layer in int8. int4: every layer in int4, from its source groups where present, else from its
    weights. auto: int4 where the checkpoint is 4-bit, int8 elsewhere (the default GGUF's LM head
    is 8-bit), row by row with int8 activations where the CPU does that well. With ``kernels``, int4
    layers multiply through them.
    """
    int8_kind = RowwiseInt8Linear if method == "auto" and rowwise_int8_available() else Int8Linear
    if int8_kind is Int8Linear and kernels is not None and not cpu_has_native_bf16():
        int8_kind = partial(Int8Linear, kernels=kernels)  # torch's int8 kernel was 2.2x slower at one row there
    for name, linear in _linear_layers(model):
        groups = source_groups(name)
        if groups is None and method == "int4" and linear.in_features % GROUP_SIZE == 0:
            groups = Int4Groups.from_weight(linear.weight)
        layer = int8_kind(linear) if groups is None or method == "int8" else Int4Linear(linear, groups, kernels)
        model.set_submodule(name, layer)
    packed = [module for module in model.modules() if isinstance(module, SmallBatchLinear)]
    choose_max_rows(packed, saved_rows)
    return dict(Counter(layer.kind for layer in packed))


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def choose_max_rows(layers: list[SmallBatchLinear], saved: Path | None = None) -> None:
    """The packed copy serves up to the largest row count where it beat the full-precision multiply.

    Measured once per weight shape on this machine, then kept in ``saved`` (JSON): a greedy output must
    not depend on how a later start's timing happened to fall, and later starts skip the measuring.
    """
    known = read_json(saved) or {}
    by_key: dict[str, list[SmallBatchLinear]] = {}
    for layer in layers:
        by_key.setdefault(_machine_key(layer), []).append(layer)
    unknown = [key for key in by_key if key not in known]
    for key in unknown:
        known[key] = _measured_max_rows(by_key[key])
        steps = "of any size" if known[key] == ANY_ROWS else f"of at most {known[key]} rows (measured)"
        log.info("%s: packed weights for steps %s", key, steps)
    for key, same_shape in by_key.items():
        for layer in same_shape:
            layer.max_rows = known[key]
    if unknown and saved is not None:
        write_json(saved, known)


def _machine_key(layer: SmallBatchLinear) -> str:
    kind = f"{layer.kind} {layer.out_features}x{layer.in_features} {str(layer.dtype).removeprefix('torch.')}"
    return f"{cpu_model_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {kind}"


@torch.inference_mode()
def _measured_max_rows(same_shape: list[SmallBatchLinear]) -> int:
    """The most rows where the packed copy wins, timed as a step uses them: every layer of the shape in
    turn, each weight read from memory rather than from the cache a single layer's repeated calls would
    leave it in. Counted down: the packed copy's lead only grows as rows fall (it reads fewer bytes for
    the same products), so where it wins at 64 rows, as int4 on the kernels does, one count is timed,
    not seven (a first start spent 2.5 s here).

    Without native bf16, oneDNN's bf16 GEMM is emulated, and a full multiply loses to the kernels' packed one at
    every count (the default model's step of 64 rows: 945 ms against 279 in int4), where a 512-row prefill step
    would take seconds: layers on the kernels take steps of any size there, unmeasured."""
    if same_shape[0].on_kernels and not cpu_has_native_bf16():
        return ANY_ROWS
    for rows in sorted(ROWS_MEASURED, reverse=True):
        x = torch.randn(rows, same_shape[0].in_features, dtype=same_shape[0].dtype)
        packed = _seconds([partial(layer.packed_mm, x) for layer in same_shape])
        full = _seconds([partial(layer.full_mm, x) for layer in same_shape])
        if packed < full:
            return rows
    return 0


def _seconds(calls: list[Callable[[], object]], repeats: int = 3) -> float:
    """The fastest of a few runs through ``calls``: the one least disturbed by whatever else the
    machine was doing (a mean let one slow call move a crossing point from 16 rows to 2)."""
    for call in calls:
        call()  # warm-up: first calls allocate
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest
