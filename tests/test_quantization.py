"""Packed weights for small batches: int4 from the GGUF's own blocks, int8, and the default choice."""

from __future__ import annotations

import json
import logging

import gguf
import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoConfig
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from wsgi_infer import LLM, EngineConfig, SamplingParams
from wsgi_infer.engine import device
from wsgi_infer.engine.device import resolve_dtype
from wsgi_infer.engine.gguf_checkpoint import read_gguf_weights
from wsgi_infer.engine.kernels.build import build_cpu_kernels
from wsgi_infer.engine.kernels.cpu import CpuKernels, int4_kernel_layout, load_cpu_kernels
from wsgi_infer.engine.layers import quantization
from wsgi_infer.engine.layers.quantization import (
    ANY_ROWS,
    Int4Groups,
    Int4Linear,
    Int8Linear,
    RowwiseInt8Linear,
    SmallBatchLinear,
    choose_max_rows,
    quantize_linear_layers,
    rowwise_int8_available,
)
from wsgi_infer.engine.model_loader import CheckpointTensors
from wsgi_infer.engine.model_paths import default_model_path
from wsgi_infer.engine.model_runner import PACKED_ROWS_FILE

from .conftest import assert_idle, pin_packed_rows


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(64, 96).to(torch.bfloat16)


needs_rowwise_int8 = pytest.mark.skipif(not rowwise_int8_available(), reason="no fbgemm with VNNI on this CPU")


@pytest.mark.parametrize(
    "make",
    [
        Int8Linear,
        lambda lin: Int4Linear(lin, Int4Groups.from_weight(lin.weight)),
        pytest.param(RowwiseInt8Linear, marks=needs_rowwise_int8),
    ],
)
def test_packed_weights_serve_small_batches_and_full_weights_large_ones(make):
    linear = _linear()
    packed = make(linear)
    packed.max_rows = 4
    small = torch.randn(4, 64, dtype=torch.bfloat16)
    error = (packed(small).float() - linear(small).float()).abs().max()
    assert 0 < error < 0.1 * linear(small).float().abs().max()  # really packed, and close
    large = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(packed(large), linear(large))


def test_the_int4_kernel_computes_with_the_groups_values():
    """torch's convention, ``(q - 8) * scale + zero``, is what Int4Groups stores."""
    linear = _linear()
    groups = Int4Groups.from_weight(linear.weight)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = x.float() @ groups.dequantize().t() + linear.bias.float()
    packed = Int4Linear(linear, groups)
    packed.max_rows = 3
    assert torch.allclose(packed(x).float(), expected, atol=0.05, rtol=0.02)


@needs_rowwise_int8
def test_rowwise_int8_rows_do_not_depend_on_their_batch():
    """Each row gets its own activation scale: an outlier in one row leaves the others' results as they were."""
    packed = RowwiseInt8Linear(_linear())
    packed.max_rows = 8
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    x[3, 5] = 500.0
    together = packed(x)
    assert all(torch.equal(together[i], packed(x[i : i + 1])[0]) for i in range(8))


@needs_rowwise_int8
def test_rowwise_int8_sums_full_8_bit_activations_without_saturating():
    """Activation codes near 255 times weight codes of 127: pairs of such products overflow a 16-bit sum,
    which is what the kernel would do on a CPU without VNNI (rowwise_int8_available refuses those)."""
    linear = nn.Linear(64, 8, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.fill_(0.5)
    packed = RowwiseInt8Linear(linear)
    packed.max_rows = 1
    x = torch.linspace(0, 1, 64, dtype=torch.bfloat16)[None].clone()
    x[0, 32:] = 1.0  # half the codes at 255
    expected = (x.float() @ linear.weight.float().t())[0]
    assert torch.allclose(packed(x)[0].float(), expected, rtol=0.02)


@pytest.fixture(scope="module")
def gguf_weights():
    path = default_model_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    return gguf.GGUFReader(path), config, *read_gguf_weights(path, config)


@pytest.mark.parametrize(
    "gguf_name, hf_name",
    [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),  # Q4_1, rows permuted by llama.cpp
        ("blk.5.attn_k.weight", "model.layers.5.self_attn.k_proj.weight"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
        ("token_embd.weight", "model.embed_tokens.weight"),  # Q8_0
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),  # F32
    ],
)
def test_gguf_weights_equal_what_transformers_reads(gguf_weights, gguf_name, hf_name):
    """gguf-py's dequantization and transformers' row order, bit for bit; 4-bit ones keep their groups."""
    reader, config, weights, groups = gguf_weights
    tensor = next(t for t in reader.tensors if t.name == gguf_name)
    values = gguf.dequantize(tensor.data, tensor.tensor_type)
    expected = LlamaTensorProcessor(config=config.to_dict()).process(weights=values, name=gguf_name).weights
    assert torch.equal(weights[hf_name], torch.from_numpy(np.ascontiguousarray(expected)))
    if tensor.tensor_type.name == "Q4_1":
        assert torch.allclose(groups[hf_name].dequantize(), weights[hf_name], rtol=0, atol=1e-6)
        assert groups[hf_name].q.max() <= 15
        # The kernels keep no bf16 copy: what they unpack for large steps is the bf16 weight, bit for bit.
        # Built here if no test built them yet: only loading them would skip this check in such a run.
        kernels = CpuKernels(build_cpu_kernels())
        g = groups[hf_name]
        unpacked = kernels.int4_dequantize(*int4_kernel_layout(g.codes, g.scale, g.zero), len(g.codes))
        assert torch.equal(unpacked, weights[hf_name].bfloat16())
    else:
        assert hf_name not in groups


def test_the_kernels_half_precision_scales_hold_every_gguf_block_exactly(gguf_weights):
    """The kernels read each group's scale and low in float16: a GGUF's d and m, which it stores in float16."""
    *_, groups = gguf_weights
    assert len(groups) == 30 * 7  # every projection of every layer
    for g in groups.values():
        low = g.zero - 8 * g.scale
        assert torch.equal(g.scale.half().float(), g.scale)
        assert torch.equal(low.half().float(), low)


def test_by_default_bf16_on_the_cpu_serves_the_gguf_blocks(default_model_dir, monkeypatch):
    read = []
    original = CheckpointTensors.__getitem__
    monkeypatch.setattr(CheckpointTensors, "__getitem__", lambda self, name: read.append(name) or original(self, name))
    llm = LLM(model=None, device="cpu", dtype="bfloat16")
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int4Linear)
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)
    if load_cpu_kernels() is not None:
        # Built from the GGUF's blocks alone: their full-precision weights are neither read nor kept.
        assert model.layers[0].mlp.down_proj.weight is None
        assert "model.embed_tokens.weight" in read
        assert not [name for name in read if "proj" in name]
    # The GGUF's embedding is 8-bit (Q8_0): 4 bits would lose it.
    assert isinstance(model.lm_head, RowwiseInt8Linear if rowwise_int8_available() else Int8Linear)
    assert model.lm_head.max_rows >= 1  # measured: a decode step of one sequence uses the packed copy
    # Not the bare question: its first token is a near tie in float32 (0.08 apart), which any rounding may flip.
    question = "What is the capital of France? Answer in one word."
    out = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in out.text
    assert_idle(llm)


@pytest.mark.parametrize("avx2_fma", [True, False])
@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_is_bf16_where_the_cpu_serves_packed_weights_fast(monkeypatch, native_bf16, avx2_fma):
    """Without native bf16, bf16 rows pay only where int4 weights are multiplied on the kernels (AVX2 and
    FMA widen them in registers); a bf16 weight multiply there is slower than float32's."""
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(device, "cpu_has_avx2_fma", lambda: avx2_fma)
    cpu = torch.device("cpu")
    packed = resolve_dtype("auto", cpu, packed_weights=True)
    assert packed == (torch.bfloat16 if native_bf16 or avx2_fma else torch.float32)
    assert resolve_dtype("auto", cpu, packed_weights=False) == (torch.bfloat16 if native_bf16 else torch.float32)
    assert resolve_dtype("float32", cpu, packed_weights=True) == torch.float32


@pytest.mark.parametrize("kind", [Int4Linear, Int8Linear])
def test_without_native_bf16_layers_on_the_kernels_take_steps_of_any_size(monkeypatch, tmp_path, caplog, kind):
    """Unmeasured: a bf16 GEMM is emulated there, and loses to the kernels at every row count."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(quantization, "cpu_has_native_bf16", lambda: False)
    linear = nn.Linear(64, 32).bfloat16()
    if kind is Int4Linear:
        layer = Int4Linear(linear, Int4Groups.from_weight(linear.weight), kernels)
    else:
        layer = Int8Linear(linear, kernels)
    with caplog.at_level(logging.INFO, logger=quantization.__name__):
        choose_max_rows([layer], tmp_path / "rows.json")
    assert layer.max_rows == ANY_ROWS and "of any size" in caplog.text
    x = torch.randn(600, 64).bfloat16()  # more rows than a step's token budget
    assert torch.equal(layer(x), layer.packed_mm(x) + linear.bias)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_8_bit_layers_run_on_the_kernels_only_without_native_bf16(monkeypatch, tmp_path, native_bf16):
    """Where oneDNN computes bf16 natively, torch's int8 kernel stays (measured there); elsewhere the
    kernels' is 2.2x faster at one row."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(quantization, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(quantization, "rowwise_int8_available", lambda: False)
    model = nn.Sequential(nn.Linear(64, 48)).bfloat16()
    quantize_linear_layers(model, "auto", lambda name: None, tmp_path / "rows.json", kernels)
    assert isinstance(model[0], Int8Linear) and model[0].on_kernels != native_bf16
    x = torch.randn(3, 64).bfloat16()
    full = torch.nn.functional.linear(x, model[0].weight)
    torch.testing.assert_close(model[0].packed_mm(x), full, rtol=0.02, atol=0.02)


def test_float32_stays_unpacked(default_llm):
    modules = list(default_llm.engine.runner.model.modules())
    assert not any(isinstance(m, SmallBatchLinear) for m in modules)


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


def test_crossing_points_are_measured_once_per_machine_then_kept(tiny_model_dirs, tmp_path, monkeypatch, caplog):
    """A greedy output must not depend on how one start's timings fell: later starts reuse the first's."""
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path))
    model = str(tiny_model_dirs["llama"])
    with caplog.at_level(logging.INFO, logger="wsgi_infer.engine.layers.quantization"):
        pin_packed_rows(model, 3)
    assert "(measured)" in caplog.text and json.loads((tmp_path / PACKED_ROWS_FILE).read_text())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="wsgi_infer.engine.layers.quantization"):
        llm = LLM(model=model, device="cpu", dtype="float32", quantization="int8")
    packed = [m for m in llm.engine.runner.model.modules() if isinstance(m, SmallBatchLinear)]
    assert packed and all(m.max_rows == 3 for m in packed) and "(measured)" not in caplog.text
