"""Packed weights as a model gets them: the GGUF's own blocks, our Q8_M from 16- and 32-bit weights, torch's
kernels without ours (their crossing points: test_crossing_points), and the default choice of dtype."""

from __future__ import annotations

import json
import logging
import re

import gguf
import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

from wsgi_infer import LLM, EngineConfig, SamplingParams
from wsgi_infer.engine.kernels.block_fields import Q8_M, from_values
from wsgi_infer.engine.kernels.cpu import load_cpu_kernels
from wsgi_infer.engine.layers.packed_embedding import PackedEmbedding
from wsgi_infer.engine.layers.quantization import PackedLinear, SmallBatchLinear, TorchInt4Linear, TorchInt8Linear
from wsgi_infer.engine.loading.checkpoint_tensors import CheckpointTensors
from wsgi_infer.engine.loading.file_weights import FILE_WEIGHTS_FILE
from wsgi_infer.engine.loading.gguf_checkpoint import _hf_names
from wsgi_infer.engine.loading.model_paths import default_model_path
from wsgi_infer.engine.runtime import device
from wsgi_infer.engine.runtime.device import resolve_dtype

from ..conftest import assert_idle
from ..support.kernel_libraries import packed_from_file, packed_from_values


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(64, 96).to(torch.bfloat16)


def _torch_int4(linear: nn.Linear) -> TorchInt4Linear:
    return TorchInt4Linear(linear, from_values(linear.weight, 15))


@pytest.mark.parametrize("make", [TorchInt8Linear, _torch_int4])
def test_torch_packed_weights_serve_small_batches_and_full_weights_large_ones(make):
    linear = _linear()
    packed = make(linear)
    packed.max_rows = 4
    small = torch.randn(4, 64, dtype=torch.bfloat16)
    error = (packed(small).float() - linear(small).float()).abs().max()
    assert 0 < error < 0.1 * linear(small).float().abs().max()  # really packed, and close
    large = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(packed(large), linear(large))


def test_packing_a_float32_layer_leaves_its_weight_as_it_was():
    linear = nn.Linear(64, 96)
    weight = linear.weight.detach().clone()
    packed = TorchInt8Linear(linear)
    assert torch.equal(packed.weight, weight)
    packed.max_rows = 4
    x = torch.randn(4, 64)
    torch.testing.assert_close(packed(x), linear(x), rtol=0.02, atol=0.02)


def test_the_int4_kernel_computes_with_the_blocks_values():
    """torch's convention, ``(q - 8) * scale + zero``, holds Q4_1's blocks, ``q * d + m``."""
    linear = _linear()
    blocks = from_values(linear.weight, 15)
    values = blocks.codes.float() * blocks.d.float().repeat_interleave(32, 1) + blocks.low.float().repeat_interleave(
        32, 1
    )
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = x.float() @ values.t() + linear.bias.float()
    packed = TorchInt4Linear(linear, blocks)
    packed.max_rows = 3
    assert torch.allclose(packed(x).float(), expected, atol=0.05, rtol=0.02)


@pytest.fixture(scope="module")
def gguf_weights(default_model_dir):
    """The default GGUF as gguf-py reads it, and its converted copy as the engine loads it: weights and the config
    (transformers' own reading of the GGUF, test_model_loader shows; reading it here took 7.5 s)."""
    path = default_model_path()
    config = AutoConfig.from_pretrained(default_model_dir, local_files_only=True)
    return gguf.GGUFReader(path), config, CheckpointTensors(default_model_dir, torch.float32)


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
    """gguf-py's dequantization and transformers' row order, bit for bit, read from the file; a 2-D weight's blocks,
    packed for the kernels in that row order, give back the same values."""
    reader, config, weights = gguf_weights
    tensor = next(t for t in reader.tensors if t.name == gguf_name)
    values = gguf.dequantize(tensor.data, tensor.tensor_type)
    expected = LlamaTensorProcessor(config=config.to_dict()).process(weights=values, name=gguf_name).weights
    assert torch.equal(weights[hf_name], torch.from_numpy(np.require(expected, requirements="CW")))  # F32: a view
    blocks = weights.blocks(hf_name)
    if tensor.tensor_type.name == "F32":
        assert blocks is None
        return
    assert blocks.ggml_type == tensor.tensor_type
    kernels = load_cpu_kernels()
    packed = packed_from_file(blocks.rows(0, blocks.shape[0]), blocks.ggml_type)
    assert torch.equal(kernels.packed_rows(packed, torch.arange(blocks.shape[0])), weights[hf_name])


def test_every_tensor_of_the_file_is_what_transformers_reads(gguf_weights):
    """Not a sample: each of the file's 272 tensors, named by transformers' own map of gguf-py's names and reordered by
    its processor, equals what our reader gives, bit for bit. So the reference model the exactness tests build from
    our reader's tensors (``transformers_reference``) is transformers' reading of the file."""
    reader, config, weights = gguf_weights
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = LlamaTensorProcessor(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    for tensor in reader.tensors:
        values = gguf.dequantize(tensor.data, tensor.tensor_type)
        expected = processor.process(weights=values, name=tensor.name).weights
        assert torch.equal(weights[names[tensor.name]], torch.from_numpy(np.require(expected, requirements="CW")))
    assert len(reader.tensors) == len(weights) == 272 and {names[t.name] for t in reader.tensors} == set(weights)


def test_a_conversion_keeps_no_tensor(gguf_weights, default_model_dir):
    """The default model's converted copy writes no tensor: every one the model reads, its Q4_1 projections, its
    Q8_0 embedding and its F32 norms, is read from the GGUF at the place the copy records."""
    reader, config, _ = gguf_weights
    assert not list(default_model_dir.glob("*.safetensors"))
    in_file = json.loads((default_model_dir / FILE_WEIGHTS_FILE).read_text())["weights"]
    names = _hf_names("llama", config, {t.name for t in reader.tensors})
    two_d = {names[t.name] for t in reader.tensors if t.name in names and len(t.shape) == 2}
    norms = {names[t.name] for t in reader.tensors if t.name in names and len(t.shape) == 1}
    assert len(two_d) == 30 * 7 + 1 and len(norms) == 30 * 2 + 1
    assert set(in_file) == two_d | norms


def test_by_default_the_cpu_serves_the_gguf_blocks(default_model_dir, monkeypatch, caplog):
    read = []
    original = CheckpointTensors.__getitem__
    monkeypatch.setattr(CheckpointTensors, "__getitem__", lambda self, name: read.append(name) or original(self, name))
    with caplog.at_level(logging.INFO, logger="wsgi_infer.engine.loading.model_builder"):
        llm = LLM(model=None, device="cpu")
    model = llm.engine.runner.model
    # Built from the GGUF's blocks alone: their full-precision weights are neither read nor kept.
    for layer in (model.layers[0].mlp.down_proj, model.lm_head):
        assert isinstance(layer, PackedLinear) and layer.weight is None
    assert model.layers[0].self_attn.qkv_proj.kind == "packed Q4_1"
    assert model.lm_head.kind == "packed Q8_0"  # the GGUF's embedding is Q8_0, and so is its tied head
    # The Q8_0 embedding's rows come from the head's blocks, its table unread.
    assert isinstance(model.embed_tokens, PackedEmbedding) and "model.embed_tokens.weight" not in read
    assert not [name for name in read if "proj" in name]
    assert "'Q4_1': '5.000 bits (file 5.000)'" in caplog.text and "'Q8_0': '8.500 bits (file 8.500)'" in caplog.text
    laid_out = re.search(r"packed weights: (\d+) MiB laid out in ([\d.]+) s", caplog.text)
    packed = [m.packed for m in model.modules() if isinstance(m, PackedLinear)]
    assert int(laid_out[1]) == sum(weight.nbytes for weight in packed) >> 20 > 0 and float(laid_out[2]) > 0
    # Not the bare question: its first token is a near tie in float32 (0.08 apart), which any rounding may flip.
    question = "What is the capital of France? Answer in one word."
    out = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in out.text
    assert_idle(llm)


@pytest.mark.parametrize("saved_as", [torch.float32, torch.bfloat16])
def test_a_hugging_face_directory_is_served_packed(tiny_model_dirs, tmp_path, saved_as, caplog):
    """16- and 32-bit checkpoints are packed at load as our Q8_M, from their own values, and the kernels serve every
    step in float32 rows."""
    from transformers import AutoModelForCausalLM

    source = tiny_model_dirs["llama"]
    AutoModelForCausalLM.from_pretrained(source, dtype=saved_as).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    with caplog.at_level(logging.INFO, logger="wsgi_infer.engine.loading.model_builder"):
        llm = LLM(model=str(tmp_path), device="cpu")
    assert llm.engine.dtype == torch.float32
    model = llm.engine.runner.model
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 2 * 4 + 1 and all(m.kind == "packed Q8_M" for m in packed)
    assert "quantization auto: {'packed Q8_M': 9}" in caplog.text
    values = CheckpointTensors(tmp_path, torch.float32)
    expected = packed_from_values(values["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(model.layers[0].mlp.down_proj.packed.parts[0].tiles, expected.parts[0].tiles)
    assert expected.parts[0].format == Q8_M and isinstance(model.embed_tokens, torch.nn.Embedding)  # not the file's
    assert len(llm.generate("Hi", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids) == 4


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_on_the_cpu_is_float32_unless_torch_serves_native_bf16(monkeypatch, native_bf16):
    """The kernels take float32 rows; without them, bf16 through torch only where the CPU computes it natively."""
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: native_bf16)
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, on_kernels=True) == torch.float32
    assert resolve_dtype("auto", cpu, on_kernels=False) == (torch.bfloat16 if native_bf16 else torch.float32)
    assert resolve_dtype("bfloat16", cpu, on_kernels=True) == torch.bfloat16


def test_without_packing_or_kernels_the_cpu_computes_in_float32(tiny_model_dirs, monkeypatch, caplog):
    """quantization none, or an architecture the kernels do not serve (GPT-2): float32 on a CPU without native
    bf16, never bf16 through torch there; the log says which path runs and why."""
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    with caplog.at_level(logging.INFO, logger="wsgi_infer.engine.model_runner"):
        assert LLM(model=str(tiny_model_dirs["llama"]), device="cpu", quantization="none").engine.dtype == torch.float32
        assert LLM(model=str(tiny_model_dirs["gpt2"]), device="cpu").engine.dtype == torch.float32
    assert "steps run on torch's ops: quantization none was asked for" in caplog.text
    assert "steps run on torch's ops: gpt2 has no path on the CPU kernels" in caplog.text


def test_float32_stays_unpacked(default_llm):
    modules = list(default_llm.engine.runner.model.modules())
    assert not any(isinstance(m, (SmallBatchLinear, PackedLinear)) for m in modules)


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
