"""Packed weights in GGUF's own formats, multiplied by the CPU kernels: every format against gguf-py's dequantization
times a float64 product, on odd shapes; one arithmetic for every number of rows; the same bits from every build."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from wsgi_infer.engine.kernels.block_fields import FILE_BLOCK_BYTES, FORMATS, Q8_M, file_bits_per_weight
from wsgi_infer.engine.kernels.cpu import CpuKernels
from wsgi_infer.engine.kernels.packed import packed_weight
from wsgi_infer.engine.runtime.huge_pages import HUGE_PAGE, HugePageArena

from ..support.kernel_libraries import (
    FILE_FORMATS,
    LIBRARIES,
    activation_span,
    file_values,
    largest_file_blocks,
    library,
    packed_from_file,
    packed_from_values,
    quantized_rows,
    randn,
    random_file_blocks,
)

# (rows, inputs): one row, rows not a multiple of the 16-row tile, a tile and one row more; inputs of one block,
# of 9 blocks of 32 (no multiple of 256: only the 32-input formats take it), of 3 super-blocks
SHAPES = [(1, 256), (17, 768), (37, 288)]
# 1..16: a pass in registers; 48 and more: passes of 16 on AMX's tiles where the CPU has them, the rest in registers
ROW_COUNTS = [1, 2, 3, 5, 8, 9, 20, 33, 50]


def _shapes(ggml_type: int) -> list[tuple[int, int]]:
    return [(rows, k) for rows, k in SHAPES if k % FORMATS[ggml_type] == 0]


@pytest.mark.parametrize("ggml_type", FILE_FORMATS, ids=lambda t: t.name)
def test_the_layout_holds_the_files_bits_and_gives_gguf_py_values(kernels: CpuKernels, ggml_type):
    """A tile's block holds its rows' blocks in exactly the file's bytes, as the kernels count them; each row read
    back is gguf-py's values of the file's row, bit for bit."""
    inputs, block_bytes = FORMATS[ggml_type], 16 * FILE_BLOCK_BYTES[ggml_type]
    assert kernels.block_bytes(ggml_type) == block_bytes
    for rows, k in _shapes(ggml_type):
        raw = random_file_blocks(ggml_type, rows, k)
        weight = packed_from_file(raw, ggml_type)
        assert weight.nbytes == -(-rows // 16) * (k // inputs) * block_bytes  # whole tiles of 16 rows
        ids = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
        assert torch.equal(kernels.packed_rows(weight, ids), file_values(raw, ggml_type)[ids])


@pytest.mark.parametrize("planes", [1, 2], ids=["8-bit", "exact"])
@pytest.mark.parametrize("ggml_type", FILE_FORMATS, ids=lambda t: t.name)
def test_packed_mm_is_the_product_of_gguf_py_values_and_each_row_alone(kernels: CpuKernels, ggml_type, planes):
    """Each output is the float64 product of gguf-py's values and the activations as the kernels quantize them
    (8-bit, or 16-bit on the exact path; a scale per 32 inputs, or per K-quant super-block), within float32's
    rounding of each block's scaled sum; on the exact path also within 2^-16 of each span's largest input of the
    true product. A row's outputs are the same bits alone and in any batch, in passes in registers or (48 rows and
    more, where the CPU has them) on AMX's tiles."""
    kernels.use_exact_activations(planes == 2)
    for rows, k in _shapes(ggml_type):
        raw = random_file_blocks(ggml_type, rows, k, seed=rows)
        weight, values = packed_from_file(raw, ggml_type), file_values(raw, ggml_type).double()
        torch.manual_seed(rows)
        x = randn(max(ROW_COUNTS), k, scale=2)
        x[3, :32] *= 1e-4
        x[3, 7] = 300.0  # an outlier in a block of tiny values
        x[4, 32:64] = 0  # a block of zeros
        got = kernels.packed_mm(x, weight)
        magnitudes, span = x.abs().double() @ values.abs().T, activation_span(weight)
        assert ((got.double() - quantized_rows(x, planes, span) @ values.T).abs() <= 2e-6 * magnitudes + 1e-30).all()
        if planes == 2:
            block_max = x.abs().view(len(x), -1, span).amax(-1).repeat_interleave(span, dim=1).double()
            bound = 2**-16 * block_max @ values.abs().T + 2e-6 * magnitudes
            assert ((got.double() - x.double() @ values.T).abs() <= bound).all()
        for count in ROW_COUNTS:
            assert torch.equal(kernels.packed_mm(x[:count], weight), got[:count])
        assert torch.equal(kernels.packed_mm(x[7:8], weight), got[7:8])


@pytest.mark.parametrize("planes", [1, 2], ids=["8-bit", "exact"])
@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q4_0], ids=lambda t: t.name)
def test_rows_past_a_tasks_block_are_each_rows_own(kernels: CpuKernels, ggml_type, planes):
    """A multiply's rows go to the threads in blocks whose activations fit L2 (of 8,192 inputs: 64 rows): 150 rows
    take three blocks, the last a part one, and each row is the same bits as alone or in a batch within one block."""
    kernels.use_exact_activations(planes == 2)
    weight = packed_from_file(random_file_blocks(ggml_type, 17, 8192), ggml_type)
    x = randn(150, 8192, scale=2)
    got = kernels.packed_mm(x, weight)
    assert torch.equal(
        got,
        torch.cat(
            [
                kernels.packed_mm(x[:50], weight),
                kernels.packed_mm(x[50:100], weight),
                kernels.packed_mm(x[100:], weight),
            ]
        ),
    )
    assert torch.equal(kernels.packed_mm(x[140:141], weight), got[140:141])


@pytest.mark.parametrize("planes", [1, 2], ids=["8-bit", "exact"])
@pytest.mark.parametrize("ggml_type", FILE_FORMATS, ids=lambda t: t.name)
def test_the_largest_sums_a_block_can_make_are_exact(kernels: CpuKernels, ggml_type, planes):
    """Every code and sub-block scale at its largest magnitude times rows of one activation, positive or negative,
    each quantized to the largest code of each plane: the integer sums at their bounds (VNNI's Q4_K scales each
    half's sum as a 16-bit integer, Q6_K's offset takes its scales times -32 as 16-bit integers) are still the
    float64 product's, in both activation modes."""
    kernels.use_exact_activations(planes == 2)
    raw = largest_file_blocks(ggml_type, 17, 512 if FORMATS[ggml_type] == 256 else 288)
    weight, values = packed_from_file(raw, ggml_type), file_values(raw, ggml_type).double()
    # 52 rows: passes of 16 rows (their own sums, rotated activations) and, with AMX, tiles of 48, not 4 alone
    x = torch.ones(52, values.shape[1]) * torch.tensor([3.0, -3.0, 0.5, -250.0]).repeat(13)[:, None]
    assert kernels.planes == planes
    expected = quantized_rows(x, planes, activation_span(weight)) @ values.T
    got = kernels.packed_mm(x, weight).double()
    assert ((got - expected).abs() <= 2e-6 * (x.abs().double() @ values.abs().T) + 1e-30).all()


@pytest.mark.parametrize("planes", [1, 2], ids=["8-bit", "exact"])
def test_a_fused_weight_of_k_quant_and_32_input_parts_is_each_parts_product(kernels: CpuKernels, planes):
    """A fused projection's parts may mix formats (a Q4_K_M file's queries, keys and values): the K-quants'
    activations then have one scale per super-block, which the other parts read as well. Each part's outputs are
    the product of its own values, within float32's rounding, alone and in a batch."""
    kernels.use_exact_activations(planes == 2)
    types = [Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0]
    raws = [random_file_blocks(t, 17 + i, 512, seed=i) for i, t in enumerate(types)]
    weight = packed_weight([packed_from_file(raw, t).parts[0] for raw, t in zip(raws, types, strict=True)], True)
    values = torch.cat([file_values(raw, t) for raw, t in zip(raws, types, strict=True)]).double()
    torch.manual_seed(planes)
    x = randn(20, 512, scale=2)
    got = kernels.packed_mm(x, weight)
    expected = quantized_rows(x, planes, activation_span(weight)) @ values.T
    assert activation_span(weight) == 256
    assert ((got.double() - expected).abs() <= 2e-6 * (x.abs().double() @ values.abs().T) + 1e-30).all()
    assert torch.equal(kernels.packed_mm(x[3:4], weight), got[3:4])


def test_a_nan_or_infinite_input_makes_its_rows_outputs_nan(kernels: CpuKernels):
    weight = packed_from_file(random_file_blocks(Q.Q4_K, 20, 512), Q.Q4_K)
    x = randn(10, 512)
    x[2, 300], x[5, 3] = float("nan"), float("inf")
    got = kernels.packed_mm(x, weight)
    assert got[[2, 5]].isnan().all() and not got[[0, 1, 3, 4, 6, 7, 8, 9]].isnan().any()


@pytest.fixture(
    scope="module", params=[False, pytest.param(True, marks=pytest.mark.slow)], ids=["installed", "and clang"]
)
def every_library(request, tmp_path_factory) -> list[CpuKernels]:
    """Every library this CPU runs, clang's build with them in the slow tier (compiled by the run)"""
    chosen = [which for which in LIBRARIES if request.param or which != "clang"]
    return [CpuKernels(library(which, tmp_path_factory)) for which in chosen]


@pytest.mark.parametrize("ggml_type", [*FILE_FORMATS, Q8_M], ids=lambda t: getattr(t, "name", "Q8_M"))
def test_every_build_multiplies_to_the_same_bits(every_library, ggml_type):
    """AMX's tiles (51 rows: 3 passes of 16 there, the rest in registers), AVX-512 with VNNI (vpdpbusd), without
    it and AVX2 (vpmaddubsw; 8-bit codes in nibbles), the plain C of CPUs without AVX2, and clang's build sum the
    same integers and scale them with the same roundings: the same bits for every format, in both activation modes,
    at every count of rows."""
    if ggml_type == Q8_M:
        weight = packed_from_values(randn(40, 256))
    else:
        weight = packed_from_file(random_file_blocks(ggml_type, 40, 256), ggml_type)
    x = randn(56, 256, scale=3)
    for planes in (1, 2):
        outputs = []
        for kernels in every_library:
            kernels.use_exact_activations(planes == 2)
            outputs.append(torch.cat([kernels.packed_mm(x[:5], weight), kernels.packed_mm(x[5:], weight)]))
        assert all(torch.equal(out, outputs[0]) for out in outputs[1:]), [k.build for k in every_library]


@pytest.mark.parametrize("levels, fmt", [(255, Q8_M), (15, Q.Q4_1)])
def test_float_weights_are_packed_within_half_a_step_of_their_blocks_range(kernels: CpuKernels, levels, fmt):
    """Our Q8_M (and Q4_1, where 4 bits are asked for): a float16 scale and minimum per block of 32, each code
    rounded against them, so each value is within half a step of the weight; a constant block stays exact."""
    torch.manual_seed(0)
    weight = randn(33, 96, scale=0.05)
    weight[5, 32:64] = 0.25
    packed = packed_from_values(weight, levels)
    assert [part.format for part in packed.parts] == [fmt] and not packed.file_values
    values = kernels.packed_rows(packed, torch.arange(33))
    step = (weight.view(33, 3, 32).amax(-1) - weight.view(33, 3, 32).amin(-1)) / levels
    assert ((values - weight).abs() <= step.repeat_interleave(32, dim=1) * (0.5 + 2**-9) + 1e-7).all()
    assert torch.equal(values[5, 32:64], weight[5, 32:64])
    bits = 8 * packed.nbytes / (48 * 96)  # 33 rows padded to 48
    assert bits == (9.0 if fmt == Q8_M else file_bits_per_weight(Q.Q4_1))


def test_the_kernels_refuse_what_they_cannot_multiply(kernels: CpuKernels):
    weight = packed_from_values(randn(32, 64))
    with pytest.raises(TypeError, match="packed_mm: \\(2, 32\\) for a weight of 64"):
        kernels.packed_mm(randn(2, 32), weight)
    with pytest.raises(TypeError, match="ids outside 0..31"):
        kernels.packed_rows(weight, torch.tensor([32]))
    with pytest.raises(ValueError, match="parts of the same inputs"):
        packed_weight([weight.parts[0], packed_from_values(randn(16, 96)).parts[0]], False)
    raw = random_file_blocks(Q.Q4_K, 20, 512)  # 2 tiles of 2 super-blocks
    with pytest.raises(TypeError, match="tiles' size"):
        kernels.tile_blocks(Q.Q4_K, raw, torch.empty(1, 2, 2304, dtype=torch.uint8))
    with pytest.raises(TypeError, match="rows of 287 bytes"):
        kernels.tile_blocks(Q.Q4_K, raw[:, 1:].contiguous(), torch.empty(2, 2, 2304, dtype=torch.uint8))
    with pytest.raises(TypeError, match="contiguous blocks"):  # a file's view whose rows are not one after another
        kernels.tile_blocks(Q.Q4_K, raw.numpy()[::2], torch.empty(1, 2, 2304, dtype=torch.uint8))


def _anonymous_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) / 1024


def test_a_models_weights_share_huge_pages_and_hold_about_their_bytes():
    """A region of huge pages each rounded every part up to whole 2 MB pages: the shipped 135M model's 210 parts
    (120 MB) held 0.5 GB. From one arena, 200 parts of 100 kB, written, hold about 20 MB; each on its own 64-byte
    lines, none overlapping another."""
    arena, before = HugePageArena(), _anonymous_mb()
    parts = [arena.take(100_000).fill_(i % 256) for i in range(200)]
    assert _anonymous_mb() - before < 20 + 2 * HUGE_PAGE / 2**20 * 2  # the bytes, and each region's last page
    starts = sorted(part.data_ptr() for part in parts)
    assert all(start % 64 == 0 for start in starts)
    assert all(b - a >= 100_000 for a, b in zip(starts, starts[1:]))
    assert all(int(part[0]) == int(part[-1]) == i % 256 for i, part in enumerate(parts))  # none written over
