"""Which packed weight each of our linear layers gets, from the checkpoint.

A fused layer (qkv, gate-up) stacks its checkpoint weights' rows, each part in its own format. A part comes from the
GGUF's own blocks, read from the mapped file, where the kernels read its type (``kernels.block_fields.FILE_TYPES``),
else from its float32 values as our Q8_M (16- and 32-bit weights of a Hugging Face directory or an F16 or BF16 GGUF,
and the types the kernels do not read: Q2_K, Q3_K, the IQ types but IQ4_NL and IQ4_XS). ``int4`` asks for 4 bits
everywhere (a file's Q4_0, Q4_1, Q4_K, IQ4_NL and IQ4_XS as they are, other parts made as Q4_1 is), ``int8`` for 8 bits
(a file's Q8_0 as it is, the rest Q8_M).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
from gguf import GGMLQuantizationType as Q

from ..kernels.block_fields import FILE_TYPES, Q8_M, file_blocks, from_values
from ..kernels.cpu import CpuKernels
from ..kernels.packed import PackedWeight, packed_part, packed_weight
from ..runtime.huge_pages import HugePageArena
from .file_weights import FileBlocks

_KEPT = {"auto": FILE_TYPES, "int4": {Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.IQ4_NL, Q.IQ4_XS}, "int8": {Q.Q8_0}}


def layer_weight(
    method: str,
    names: list[str],
    blocks: Callable[[str], FileBlocks | None],
    values: Mapping[str, torch.Tensor],
    memory: HugePageArena,
    kernels: CpuKernels,
) -> PackedWeight | None:
    """The packed weight of the layer that stacks the checkpoint weights ``names``, from their blocks in the file
    (``blocks(name)``, None where a weight is not there) or their float32 ``values``, laid out by ``kernels`` in
    ``memory``; None where it cannot be packed (no names, or inputs not a multiple of 32)."""
    parts, from_file = [], True
    for name in names:
        found = blocks(name)
        if found is not None and found.ggml_type in _KEPT[method]:
            parts.append(packed_part(found.ggml_type, found.shape[0], found.rows, memory, kernels.tile_blocks))
            found.let_go()
            continue
        weight = values[name]
        if weight.shape[1] % 32:
            return None
        levels = 15 if method == "int4" else 255
        fmt = Q.Q4_1 if method == "int4" else Q8_M
        rows_of = partial(_value_rows, weight, levels)
        parts.append(packed_part(fmt, weight.shape[0], rows_of, memory, kernels.tile_blocks))
        from_file = False
    return packed_weight(parts, from_file) if parts else None


def _value_rows(weight: torch.Tensor, levels: int, start: int, stop: int) -> torch.Tensor:
    return file_blocks(from_values(weight[start:stop], levels))
