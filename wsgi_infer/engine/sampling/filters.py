"""Which tokens a sampled row keeps, and their weights. The row is in bits: its logits over the temperature, moved
so that the largest is 0, times log2(e), so that a token's weight is ``2 ** bits`` (the largest weighs 1). Top-k,
then the top-p nucleus of what top-k kept, then min-p, are each a floor under those bits: a row keeps exactly its
tokens at or above the highest floor (ties with the last one kept are kept, as top-k always kept them).

Every pass over a whole row is a reduction or a threshold (0.01-0.02 ms a 49,152-token row on a CPU core): torch's
comparisons, ``masked_fill``, ``nonzero`` and boolean indexing read or write a bool a token and take 0.06-0.25 ms
each, and its ``exp`` leaves its vector path for an input under -87 (0.15-2 ms a row; ``exp2`` does not).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

CHUNK = 32  # values a chunk, for ``largest``
# Below it a token weighs 0: 2 ** -125 is a normal float32, and on x86 a subnormal one takes a microcode assist
# wherever it is read (the float64 cumulation: 0.4 ms a row at temperature 0.2). Beside the largest weight (1), such
# a token's chance is under 1e-32, which no draw (a multiple of 2 ** -53) resolves anyway.
LOWEST_BITS = -125.0


def in_bits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A new tensor: the row in bits. The scale is at most float32's largest: at a temperature near 0 the others go
    to -inf, the limit it tends to, where the largest (and its ties) are drawn; dividing overflowed to NaN."""
    scale = min(math.log2(math.e) / temperature, float(torch.finfo(torch.float32).max))
    return (logits - logits.max()).mul_(scale)


def largest(values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest of a 1-D tensor, largest first, and their indices (a token's top alternatives too: a topk
    of a 49,152-token row took 0.15 ms). Only the chunks with the ``n`` largest maxima (and the tail) are partially
    sorted: a value outside them is at most each of their maxima, ``n`` values no smaller."""
    body, _ = _chunks(values)
    if 4 * n > body.shape[0]:  # those chunks would be much of the row
        top = values.topk(n)
        return top.values, top.indices
    picked = body.amax(1).topk(n).indices
    offsets = torch.arange(CHUNK, device=values.device)
    tail_indices = torch.arange(body.numel(), values.numel(), device=values.device)
    indices = torch.cat([(picked.unsqueeze(1) * CHUNK + offsets).flatten(), tail_indices])
    top = values[indices].topk(n)
    return top.values, indices[top.indices]


def weights_(bits: torch.Tensor, floor: float) -> torch.Tensor:
    """In place (a new tensor cost a plain sampled row a sixth more): ``2 ** bits`` where ``bits >= floor`` (and
    ``LOWEST_BITS``), 0 elsewhere."""
    return F.threshold_(bits, _below(max(floor, LOWEST_BITS)), -math.inf).exp2_()


def kept_floor(bits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> float:
    """The fewest bits a row keeps under the three filters (-inf: all of them)."""
    floor, top = -math.inf, None
    if 0 < top_k < bits.numel():
        top, _ = largest(bits, top_k)
        floor = float(top[-1])
    if top_p < 1.0:
        floor = max(floor, _nucleus_floor(bits, floor, top_p, top))
    if min_p > 0.0:  # a token's probability over the largest one's is 2 ** bits
        floor = max(floor, math.log2(min_p))
    return floor


def _nucleus_floor(bits: torch.Tensor, floor: float, top_p: float, top: torch.Tensor | None) -> float:
    """The bits of the last of the most likely tokens (of those at or above ``floor``; ``top``, if given, the
    largest of them in order) that a token enters the nucleus while those before it cover less than ``top_p``; the
    most likely one always does."""
    total = float(weights_(bits.clone(), floor).sum(dtype=torch.float64))
    if top is None:
        # Tokens under (1 - top_p) / V of the mass hold less than 1 - top_p together, so each follows a mass of
        # top_p: only the others are sorted (SmolLM2 at temperature 0.7, top_p 0.9: a median 133 of 49,152, at
        # most 1,910). One bit lower, so that no rounding of the bound leaves one out.
        bound = math.log2(min(1.0, (1.0 - top_p) / bits.numel() * total)) - 1.0
        top = _at_least(bits, bound).sort(descending=True).values
    probabilities = top.double().exp2_().div_(total)
    inside = int(((probabilities.cumsum(0) - probabilities) < top_p).sum())
    return float(top[max(inside, 1) - 1])


def _at_least(values: torch.Tensor, bound: float) -> torch.Tensor:
    """The values of a 1-D tensor at or above ``bound``, in no order, read from the chunks whose maxima reach it."""
    body, tail = _chunks(values)
    pool = torch.cat([body[body.amax(1) >= bound].flatten(), tail])
    return pool[pool >= bound]


def _chunks(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-D tensor as whole chunks of ``CHUNK`` (a view, one chunk a row) and the values after them."""
    whole = values.numel() // CHUNK * CHUNK
    return values[:whole].view(-1, CHUNK), values[whole:]


def _below(value: float) -> float:
    """The float32 just under ``value``: ``F.threshold`` keeps what is greater than its threshold."""
    return float(np.nextafter(np.float32(value), np.float32(-np.inf)))
