"""The CPU kernels' grammar masks: each matcher's bitmask row filled on the steps' threads (``fill_masks``), then each
listed row keeps the tokens its row allows and the others become -inf, as torch's unpacking makes them (``mask_rows``),
on every build."""

from __future__ import annotations

import ctypes

import pytest
import torch

from wsgi_infer.engine.sampling.grammar import _BITS


def torch_masked(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """What the sampler's torch path makes of the rows (grammar.apply_grammar_masks without kernels)."""
    words = bitmask.shape[1]
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(len(rows), words * 32)[:, : logits.shape[1]]
    out = logits.clone()
    out[rows] = out[rows].masked_fill(allowed == 0, float("-inf"))
    return out


@pytest.mark.parametrize("vocab", [49152, 49157, 5, 33])  # whole words, a tail, a tail alone, one bit over
def test_masks_bar_what_torch_bars_and_leave_the_other_rows(kernels, vocab):
    """Words of all ones, none, one bit, random bits; rows listed out of order; NaN and infinities kept if allowed."""
    torch.manual_seed(0)
    words = (vocab + 31) // 32
    logits = torch.randn(7, vocab)
    logits[2, 0] = float("nan")
    logits[2, vocab - 1] = float("inf")
    logits[5, vocab // 2] = float("-inf")
    rows = [5, 2, 0, 6]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), dtype=torch.int32)
    bitmask[0] = -1  # every token allowed
    bitmask[1, : words // 2] = 0  # none in the first half
    bitmask[2] = 0
    last = (vocab - 1) % 32
    bitmask[2, words - 1] = 1 << last if last < 31 else -(2**31)  # the last token alone (bit 31: the sign)
    bitmask[3, 0] = -(2**31)  # bit 31 alone: a sign bit
    expected = torch_masked(logits, rows, bitmask)
    got = logits.clone()
    kernels.mask_rows_(got, rows, bitmask)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(0.0, 1.0, -1.0), expected.nan_to_num(0.0, 1.0, -1.0))
    assert torch.equal(got[[1, 3, 4]], logits[[1, 3, 4]]), "a row not listed is untouched"
    assert torch.equal(got[5], logits[5]), "every token allowed: the row as it was"
    assert (got[0] != float("-inf")).nonzero().flatten().tolist() == [vocab - 1], "the last token alone"
    assert (got[2, : 32 * (words // 2)] == float("-inf")).all(), "none in the first half"
    one = logits[:1].clone()
    kernels.mask_rows_(one, [0], bitmask[2:3])  # one row: no threads
    assert torch.equal(one, torch_masked(logits[:1], [0], bitmask[2:3]))


def test_a_bitmask_of_another_width_or_a_row_outside_is_refused(kernels):
    logits = torch.zeros(2, 64)
    with pytest.raises(TypeError, match="mask_rows: bits"):
        kernels.mask_rows_(logits, [0], torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="mask_rows: rows outside"):
        kernels.mask_rows_(logits, [2], torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="mask_rows"):
        kernels.mask_rows_(logits, [0], torch.zeros(1, 2, dtype=torch.int64))


FILL = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_size_t)


@pytest.mark.parametrize("count", [1, 2, 16])
def test_each_row_is_filled_by_its_own_matcher_and_failures_are_named(kernels, count):
    """``fill_masks`` calls llguidance's fill for every matcher on the steps' threads (here a C callback standing in
    for it, which writes its matcher's number in every word and fails every third): each row holds its own
    matcher's words, and exactly the failed rows are returned."""
    words = 7

    def fill(matcher, mask, size) -> int:
        for w in range(size // 4):
            mask[w] = matcher
        return -1 if matcher % 3 == 0 else 0

    callback = FILL(fill)  # kept alive for the call
    matchers = [100 + i for i in range(count)]
    bitmask = torch.zeros((count, words), dtype=torch.int32)
    address = ctypes.cast(callback, ctypes.c_void_p).value
    failed = kernels.fill_masks(address, matchers, bitmask)
    assert torch.equal(bitmask, torch.tensor(matchers, dtype=torch.int32)[:, None].expand(count, words))
    assert failed == [i for i, m in enumerate(matchers) if m % 3 == 0]
    with pytest.raises(TypeError, match="fill_masks: bits"):
        kernels.fill_masks(address, matchers, torch.zeros((count + 1, words), dtype=torch.int32))
