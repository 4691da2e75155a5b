"""Linear layers with packed weights.

On the CPU kernels, ``PackedLinear`` multiplies a weight packed in a GGUF's own blocks (``kernels.packed``: the
file's, or our Q8_M made from float values) and keeps no full-precision copy: every step, whatever its rows, runs
the kernels' one arithmetic, so a row's result never depends on its step. Without the kernels, torch's own int4 and
int8 kernels serve small steps beside the full weight, up to a crossing point (``crossing_points``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.block_fields import BlockFields, format_name, from_values
from ..kernels.cpu import CpuKernels
from ..kernels.packed import PackedWeight

GROUP_SIZE = 32  # inputs a block: torch's int4 kernel's group size, and GGUF's
INT8_ROWS_PER_CHUNK = 2048  # rows _int8_per_channel quantizes at a time, to stay in cache


class SmallBatchLinear(nn.Module, ABC):
    """A linear layer that multiplies steps of at most ``max_rows`` rows with a packed copy of its weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.dtype = linear.weight.dtype
        self.weight = linear.weight
        self.bias = linear.bias
        self.max_rows = 0  # set by measuring: see crossing_points.choose_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_rows:
            return self.full_mm(x)
        y = self.packed_mm(rows).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def full_mm(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def kind(self) -> str:
        """What the crossing point is measured for."""
        return type(self).__name__

    @abstractmethod
    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ weight.T`` with the packed copy."""


class PackedLinear(nn.Module):
    """A weight packed for the CPU kernels (``kernels.packed``), times float32 rows, for steps of any size: no
    full-precision copy is kept."""

    def __init__(self, linear: nn.Linear, weight: PackedWeight, kernels: CpuKernels) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.weight = None  # never read: the checkpoint's values are not loaded into it
        self.bias = linear.bias
        self.packed = weight
        self.kernels = kernels

    @property
    def kind(self) -> str:
        return "packed " + "+".join(dict.fromkeys(format_name(part.format) for part in self.packed.parts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self.kernels.packed_mm(rows, self.packed, self.bias).view(*x.shape[:-1], -1)


class TorchInt4Linear(SmallBatchLinear):
    """int4 blocks (Q4_1's, made from the weight) through torch's CPU kernel, beside the full weight."""

    def __init__(self, linear: nn.Linear, blocks: BlockFields) -> None:
        super().__init__(linear)
        # innerKTiles 2 packs 2 x 16 codes per group, what the kernel expects for groups of 32.
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), 2))
        scale, low = blocks.d.float(), blocks.low.float()
        scale_zero = torch.stack([scale, low + 8 * scale], dim=-1).transpose(
            0, 1
        )  # [in // 32, out, 2]: w = (q - 8) s + z
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


def _int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes per output channel, and their float32 scales.

    A chunk of rows at a time stays in cache: the default model's LM head packs in 0.1 s, not 0.8.
    """
    w = weight.detach()
    scale = w.abs().amax(dim=1).float().clamp(min=1e-12) / 127.0  # |w|'s maximum is exact in w's dtype
    codes = torch.empty(w.shape, dtype=torch.int8)
    for start in range(0, len(w), INT8_ROWS_PER_CHUNK):
        end = start + INT8_ROWS_PER_CHUNK
        # a copy: .float() of a float32 weight is the weight itself, which the division would change
        chunk = w[start:end].to(torch.float32, copy=True).div_(scale[start:end, None])
        codes[start:end] = chunk.round_().clamp_(-127, 127)
    return codes, scale


def pack_on_kernels(model: nn.Module, weight_of: Callable[[str], PackedWeight | None], kernels: CpuKernels) -> None:
    """Every nn.Linear of ``model`` for which ``weight_of(name)`` gives a packed weight becomes a PackedLinear, in
    place. Called before loading: their full-precision weights are never read."""
    for name, linear in _linear_layers(model):
        weight = weight_of(name)
        if weight is not None:
            model.set_submodule(name, PackedLinear(linear, weight, kernels))


def quantize_with_torch(model: nn.Module, method: str) -> None:
    """Without the kernels: every nn.Linear of the loaded ``model`` gets torch's packed copy, in place. int8: int8
    per channel; int4 (and auto): int4 blocks made from the weights as Q4_1 is made."""
    for name, linear in _linear_layers(model):
        int4 = method != "int8" and linear.in_features % GROUP_SIZE == 0
        model.set_submodule(
            name, TorchInt4Linear(linear, from_values(linear.weight, 15)) if int4 else TorchInt8Linear(linear)
        )


def packed_layers(model: nn.Module) -> list[SmallBatchLinear]:
    """The layers beside a full weight, whose crossing points are measured."""
    return [module for module in model.modules() if isinstance(module, SmallBatchLinear)]


def kinds(model: nn.Module) -> dict[str, int]:
    """How many layers are of each kind, for the log."""
    layers = [m for m in model.modules() if isinstance(m, (SmallBatchLinear, PackedLinear))]
    return dict(Counter(layer.kind for layer in layers))


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
