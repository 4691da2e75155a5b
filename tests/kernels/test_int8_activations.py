"""8-bit activations (``activations="int8"``): each row's group of 32 inputs as 8-bit integers, as llama.cpp's q8
activations, on the CPU kernels; not exact, so never the default."""

from __future__ import annotations

import logging

import pytest
import torch

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.kernels.build import build_cpu_kernels
from wsgi_infer.engine.kernels.cpu import CpuKernels
from wsgi_infer.engine.kernels.layouts import kernel_weight
from wsgi_infer.engine.kernels.weight_groups import GROUP_SIZE, Int4Groups, Int8Groups

from ..conftest import assert_idle
from ..support.batch_runs import PROMPTS, run_alone, run_staggered
from ..support.kernel_libraries import KINDS, WITHOUT_VNNI, groups_of_kind, randn


def _rows_as_int8(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply: each group of 32 inputs rounded to 127ths of its largest magnitude."""
    groups = x.view(x.shape[0], -1, GROUP_SIZE)
    largest = groups.abs().amax(-1, keepdim=True)
    factor = torch.where(largest > 0, torch.tensor(127.0) / largest, torch.zeros_like(largest))
    q = (groups * factor).round_().clamp_(-127, 127)
    return (q * (largest / 127)).view_as(x)


def _lows(groups: Int4Groups | Int8Groups) -> torch.Tensor:
    low = groups.low if groups.low is not None else torch.zeros_like(groups.scale)
    return low.repeat_interleave(GROUP_SIZE, dim=1).double()


@pytest.mark.parametrize("kind", KINDS)
def test_int8_activations_multiply_each_rows_8_bit_groups_and_each_row_alone(kernels: CpuKernels, kind):
    """A group's codes times its 8-bit inputs, an exact integer, scaled; its lows times the inputs' own sum: within
    float32 rounding of that product, and within 1/254 of each group's largest of the exact one. A row's result is
    the same in any batch and through every way of rows (up to 8 through the 16-bit paths' registers, widened from
    the same 8-bit values; more through the 8-bit path), and a NaN input keeps its meaning."""
    if not kernels.has_int8_activations:
        pytest.skip(f"{kernels.build}: no AVX2, no 8-bit path")
    torch.manual_seed(0)
    groups = groups_of_kind(kind, randn(88, 128, scale=0.05))  # outputs: 5 tiles of 16, the last partial
    weight = kernel_weight(groups)
    x = randn(70, 128)  # more rows than a block of 8 and a chunk of 64
    x[6, 32:64] = 0
    x[7, :32] *= 1e-4
    x[7, 5] = 3000.0
    exact = kernels.packed_mm(x, weight, 88)
    kernels = CpuKernels(kernels.library)  # not the module's: it stays on 16 bits
    assert kernels.use_int8_activations() and kernels.int8_activations
    got = kernels.packed_mm(x, weight, 88)
    lows, values = _lows(groups), groups.dequantize().double()
    expected = _rows_as_int8(x).double() @ (values - lows).t() + x.double() @ lows.t()
    magnitudes = x.abs().double() @ ((values - lows).abs() + lows.abs()).t()  # the two parts the kernels add
    assert ((got.double() - expected).abs() <= 1e-6 * magnitudes + 1e-7).all()
    group_max = x.abs().view(70, -1, 32).amax(-1).repeat_interleave(32, dim=1).double()
    bound = group_max / 254 @ (values - lows).abs().t() + 1e-6 * magnitudes + 1e-7
    assert ((got.double() - x.double() @ values.t()).abs() <= bound).all()
    assert not torch.equal(got, exact)  # not the 16-bit path's
    for rows in (slice(0, 1), slice(9, 10), slice(3, 5), slice(1, 4), slice(2, 7), slice(11, 19), slice(60, 70)):
        assert torch.equal(kernels.packed_mm(x[rows], weight, 88), got[rows])
    x[10, 70] = float("nan")
    assert kernels.packed_mm(x[10:11], weight, 88).isnan().all()


@pytest.mark.parametrize("kind", KINDS)
def test_vnni_and_avx2_give_the_very_same_int8_activation_sums(kind):
    """vpdpbusd (unsigned int8 codes + 128, less 128 times the inputs' sum) and AVX2's vpmaddubsw (magnitudes times
    signed inputs) sum the same integers: the outputs are bit for bit the same, at every count of rows."""
    built, without = (CpuKernels(build_cpu_kernels(flags)) for flags in ((), WITHOUT_VNNI))
    assert built.use_int8_activations() and without.use_int8_activations()
    torch.manual_seed(1)
    weight = kernel_weight(groups_of_kind(kind, randn(64, 256, scale=0.05)))
    x = randn(20, 256)
    for rows in (slice(0, 1), slice(0, 3), slice(0, 8), slice(0, 20)):
        assert torch.equal(built.packed_mm(x[rows], weight, 64), without.packed_mm(x[rows], weight, 64))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_model_on_int8_activations_says_so_and_batches_equal_each_request_alone(tiny_model_dirs, arch, caplog):
    """The setting reaches every packed multiply (the fused decoder's too, for decodes), is logged as not exact,
    and keeps a row's result independent of its batch; the int16 default gives other logits."""
    with caplog.at_level(logging.INFO, logger="wsgi_infer.engine.model_runner"):
        llm = LLM(model=str(tiny_model_dirs[arch]), block_size=4, max_num_batched_tokens=64, activations="int8")
    on = llm.engine.runner.kernels
    if not on.has_int8_activations:
        assert "activations=int8 has no effect here" in caplog.text
        return
    assert on.int8_activations and "8-bit activations" in caplog.text and "not exact" in caplog.text
    alone = {f"r{i}": run_alone(llm, p) for i, p in enumerate(PROMPTS)}
    assert run_staggered(llm, PROMPTS) == alone
    assert_idle(llm)
    exact = LLM(model=str(tiny_model_dirs[arch]), block_size=4, max_num_batched_tokens=64)
    assert not exact.engine.runner.kernels.int8_activations
    read = SamplingParams(max_tokens=0, prompt_logprobs=0)
    eight, sixteen = (m.generate(PROMPTS[4], read)[0].prompt_logprobs for m in (llm, exact))
    assert eight != sixteen
