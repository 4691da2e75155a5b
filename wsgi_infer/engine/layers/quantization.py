"""Linear layers with a packed copy of their weight, for the steps small enough that reading weights bounds them.

On the CPU kernels, ``PackedLinear`` multiplies int4 or int8 groups (``weight_groups``: a GGUF's own blocks, or
weights quantized as Q8_0 and Q4_1 are made) and keeps no full-precision copy: a step above its crossing point
(``crossing_points``) unpacks the weight into bf16 for oneDNN's GEMM, where that wins (a CPU with native bf16);
elsewhere the kernels serve steps of every size. Without the kernels, torch's own int4 and int8 kernels serve
small steps beside the full weight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import CpuKernels
from ..kernels.layouts import kernel_weight
from ..kernels.weight_groups import GROUP_SIZE, Int4Groups, WeightGroups


class SmallBatchLinear(nn.Module, ABC):
    """A linear layer that multiplies steps of at most ``max_rows`` rows with a packed copy of its weight."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.dtype = linear.weight.dtype
        self.weight = linear.weight if keep_weight else None
        self.bias = linear.bias
        self.max_rows = 0  # set by measuring: see crossing_points.choose_max_rows

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

    on_kernels = False  # whether the CPU kernels multiply the packed copy

    @property
    def kind(self) -> str:
        """What the crossing point is measured for."""
        return type(self).__name__

    @abstractmethod
    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ weight.T`` with the packed copy."""


class PackedLinear(SmallBatchLinear):
    """int4 or int8 groups on the CPU kernels, in their layout (``kernels.layouts``), times float32 rows; no
    full-precision copy: a larger step unpacks the groups into bf16, one weight at a time (20-35 ms for the default
    model's 120)."""

    on_kernels = True

    def __init__(self, linear: nn.Linear, groups: WeightGroups, kernels: CpuKernels) -> None:
        super().__init__(linear, keep_weight=False)
        self.kernels = kernels
        self.packed = kernel_weight(groups)

    @property
    def bits(self) -> int:
        return self.packed.bits

    @property
    def kind(self) -> str:
        # the build, since a new one is measured anew; "dequantized": the full multiply unpacks the weight first
        activations = ", 8-bit activations" if self.kernels.int8_activations else ""
        return f"PackedLinear int{self.bits} ({self.kernels.build}{activations}, dequantized)"

    def packed_mm(self, rows: torch.Tensor, outputs: int | None = None) -> torch.Tensor:
        """``outputs``: only the first so many (a crossing point's timing of a large LM head)."""
        return self.kernels.packed_mm(rows, self.packed, outputs or self.out_features)

    def full_mm(self, x: torch.Tensor, outputs: int | None = None) -> torch.Tensor:
        """The weight unpacked into bf16 (valid until the next layer unpacks its own), times the rows in bf16: where
        the CPU has native bf16, oneDNN's GEMM there wins for large steps. ``outputs``: as for ``packed_mm``."""
        outputs = outputs or self.out_features
        weight = self.kernels.dequantize(self.packed, outputs, self.in_features)
        y = F.linear(x.to(weight.dtype), weight).to(x.dtype)
        return y if self.bias is None else y + self.bias[:outputs]


class TorchInt4Linear(SmallBatchLinear):
    """int4 groups through torch's CPU kernel, beside the full weight."""

    def __init__(self, linear: nn.Linear, groups: Int4Groups) -> None:
        super().__init__(linear)
        # innerKTiles 2 packs 2 x 16 codes per group, what the kernel expects for groups of 32.
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32), 2))
        scale_zero = torch.stack([groups.scale, groups.zero], dim=-1).transpose(0, 1)  # [in // 32, out, 2]
        self.register_buffer("scale_zero", scale_zero.to(linear.weight.dtype).contiguous())

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scale_zero)


class TorchInt8Linear(SmallBatchLinear):
    """Symmetric int8 per output channel through torch's kernel, beside the full weight; activations stay in
    the model's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        weight_int8, scale = _int8_per_channel(linear.weight)
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale.to(linear.weight.dtype))

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.weight_int8, self.scale)


def _int8_per_channel(weight: torch.Tensor, rows_per_chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes per output channel, and their float32 scales.

    A chunk of rows at a time stays in cache: the default model's LM head packs in 0.1 s, not 0.8.
    """
    w = weight.detach()
    scale = w.abs().amax(dim=1).float().clamp(min=1e-12) / 127.0  # |w|'s maximum is exact in w's dtype
    codes = torch.empty(w.shape, dtype=torch.int8)
    for start in range(0, len(w), rows_per_chunk):
        # a copy: .float() of a float32 weight is the weight itself, which the division would change
        chunk = (
            w[start : start + rows_per_chunk]
            .to(torch.float32, copy=True)
            .div_(scale[start : start + rows_per_chunk, None])
        )
        codes[start : start + rows_per_chunk] = chunk.round_().clamp_(-127, 127)
    return codes, scale


def pack_on_kernels(model: nn.Module, groups_of: Callable[[str], WeightGroups | None], kernels: CpuKernels) -> None:
    """Every nn.Linear of ``model`` for which ``groups_of(name)`` gives groups becomes a PackedLinear, in place.
    They need no weights: called before loading, their full-precision weights are never read."""
    for name, linear in _linear_layers(model):
        groups = groups_of(name)
        if groups is not None:
            model.set_submodule(name, PackedLinear(linear, groups, kernels))


def quantize_with_torch(model: nn.Module, method: str, stored_int4: Callable[[str], Int4Groups | None]) -> None:
    """Without the kernels: every nn.Linear of the loaded ``model`` gets torch's packed copy, in place. int8: int8
    per channel; int4: int4 groups, the checkpoint's own where ``stored_int4(name)`` has them, else from the weights
    (as Q4_1 is made); auto: int4 where the checkpoint is 4-bit, else int8."""
    for name, linear in _linear_layers(model):
        groups = stored_int4(name) if method != "int8" else None
        if groups is None and method == "int4" and linear.in_features % GROUP_SIZE == 0:
            groups = Int4Groups.from_weight(linear.weight)
        model.set_submodule(name, TorchInt8Linear(linear) if groups is None else TorchInt4Linear(linear, groups))


def packed_layers(model: nn.Module) -> list[SmallBatchLinear]:
    return [module for module in model.modules() if isinstance(module, SmallBatchLinear)]


def kinds(layers: list[SmallBatchLinear]) -> dict[str, int]:
    """How many layers are of each kind, for the log."""
    return dict(Counter(layer.kind for layer in layers))


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
