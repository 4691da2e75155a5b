"""Which packed groups each of our linear layers gets, from the checkpoint.

A fused layer (qkv, gate-up) stacks its checkpoint weights' rows, so its groups stack theirs. Each part comes
from the checkpoint's own blocks where a GGUF's map onto a packed format (``gguf_blocks``), else from its float32
values, quantized to 8-bit groups with offsets (``Int8Groups.from_weight``), which keep 16- and 32-bit weights (a
Hugging Face directory, an F16 or BF16 GGUF) and 6-, 3- and 2-bit blocks close to what they were. A layer whose
parts are all 4-bit is 4-bit; a mix is 8-bit (4-bit parts exactly so). ``int4`` asks for 4-bit everywhere (other
parts quantized as Q4_1 is made), ``int8`` for 8-bit everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..kernels.weight_groups import GROUP_SIZE, Int4Groups, Int8Groups, WeightGroups, cat_groups


def layer_groups(
    method: str, names: list[str], stored: Mapping[str, WeightGroups], values: Mapping[str, torch.Tensor]
) -> WeightGroups | None:
    """The groups of the layer that stacks the checkpoint weights ``names``, from their ``stored`` groups or their
    float32 ``values``; None where it cannot be grouped (no names, or inputs not a multiple of 32)."""
    parts = []
    for name in names:
        part = stored.get(name)
        if part is None or (method == "int4" and isinstance(part, Int8Groups)):
            weight = values[name]
            if weight.shape[1] % GROUP_SIZE:
                return None
            part = (Int4Groups if method == "int4" else Int8Groups).from_weight(weight)
        elif method == "int8" and isinstance(part, Int4Groups):
            part = part.as_int8()
        parts.append(part)
    return cat_groups(parts) if parts else None


def stored_int4(names: list[str], stored: Mapping[str, WeightGroups]) -> Int4Groups | None:
    """The layer's 4-bit groups where the checkpoint holds every part of it in 4 bits."""
    parts = [stored.get(name) for name in names]
    return Int4Groups.cat(parts) if parts and all(isinstance(p, Int4Groups) for p in parts) else None
