"""Every GGUF tensor type gguf-py reads loads: the kernels multiply the file's own blocks where they read its type,
our Q8_M made from its values elsewhere; the values a load reads are gguf-py's; a tied embedding's rows come from
the LM head's blocks, or from the file's rows."""

from __future__ import annotations

import json
import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.kernels.block_fields import FILE_TYPES
from wsgi_infer.engine.layers.packed_embedding import PackedEmbedding
from wsgi_infer.engine.layers.quantization import PackedLinear
from wsgi_infer.engine.loading import model_builder
from wsgi_infer.engine.loading.checkpoint_tensors import CheckpointTensors
from wsgi_infer.engine.loading.file_weights import FILE_WEIGHTS_FILE, FileEmbedding, FileWeights
from wsgi_infer.engine.loading.gguf_checkpoint import _hf_names
from wsgi_infer.engine.loading.gguf_config import read_gguf_config
from wsgi_infer.engine.loading.gguf_file import DEQUANTIZED_ROWS, GgufTensor, tensor_table
from wsgi_infer.engine.loading.model_paths import ModelLoadError

from ..conftest import assert_idle
from ..support.batch_runs import GREEDY
from ..support.gguf_files import (
    ALL_TYPES,
    MIXED_TYPES,
    PHI3_ORIGINAL_CONTEXT,
    PHI3_ROPE_FACTORS,
    PROJECTIONS,
    TinyGGUF,
    write_tiny_gguf,
)
from ..support.kernel_libraries import activation_span, quantized_rows
from ..support.transformers_reference import load_hf_model


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, TinyGGUF]:
    folder = tmp_path_factory.mktemp("gguf")
    return {name: write_tiny_gguf(folder / f"tiny-{name}.gguf", name) for name in ALL_TYPES}


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_every_type_loads_as_gguf_py_reads_it_and_packs_what_it_holds(tiny_ggufs, type_name):
    """Every 2-D weight is read from the file (the conversion keeps none), and its values are gguf-py's bit for bit
    (in transformers' row order). On the CPU kernels every projection is packed in the file's own type where the
    kernels read it, else as our Q8_M made from the values; it keeps no full-precision copy, and multiplies the
    file's weights as the activations are rounded (the exact path's 16 bits), within float32's rounding (within
    Q8_M's 8 bits where it was made from the values)."""
    tiny, ggml_type = tiny_ggufs[type_name], Q[type_name]
    llm = LLM(model=str(tiny.path), device="cpu", activations="int16")
    model_dir = llm.engine.model_dir
    values = CheckpointTensors(model_dir, torch.float32)
    processor = LlamaTensorProcessor(config=llm.engine.hf_config.to_dict())
    in_file = json.loads((model_dir / FILE_WEIGHTS_FILE).read_text())["weights"]
    for gguf_name, (written_type, raw) in tiny.tensors.items():
        if not gguf_name.startswith("blk.0."):
            continue
        hf_name = _hf_name(gguf_name)
        read = processor.process(weights=gguf.dequantize(raw, written_type), name=gguf_name).weights
        assert torch.equal(values[hf_name], torch.from_numpy(np.ascontiguousarray(read))), gguf_name
        assert (hf_name in in_file) == (len(raw.shape) == 2), gguf_name
    model = llm.engine.runner.model
    torch.manual_seed(0)
    own = ggml_type in FILE_TYPES
    for name, layer in model.named_modules():
        if not isinstance(layer, PackedLinear) or name == "lm_head":
            continue
        assert layer.weight is None and layer.kind == f"packed {type_name if own else 'Q8_M'}", name
        assert layer.packed.file_values == own
        weight = torch.cat([values[n] for n in model.checkpoint_names(name)]).double()
        x = torch.randn(3, layer.in_features)
        got = layer(x).double()
        expected = quantized_rows(x, 2, activation_span(layer.packed)) @ weight.T if own else x.double() @ weight.T
        magnitudes = x.abs().double() @ weight.abs().T
        assert ((got - expected).abs() <= (2e-6 if own else 2**-8) * magnitudes + 1e-12).all(), name
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    assert_idle(llm)


@pytest.mark.parametrize("type_name, kept", [("IQ4_NL", True), ("IQ4_XS", True), ("Q4_K", True), ("Q5_K", False)])
def test_int4_keeps_a_files_4_bit_blocks_and_makes_the_rest_q4_1(tiny_ggufs, type_name, kept):
    """``quantization int4``: a file's 4-bit formats (Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS) as they are, the others made
    into Q4_1 from their values."""
    llm = LLM(model=str(tiny_ggufs[type_name].path), device="cpu", quantization="int4")
    kinds = {
        layer.kind
        for name, layer in llm.engine.runner.model.named_modules()
        if isinstance(layer, PackedLinear) and name != "lm_head"
    }
    assert kinds == {f"packed {type_name if kept else 'Q4_1'}"}


def test_a_weights_blocks_move_with_the_rows_transformers_moves(tmp_path):
    """llama.cpp permutes a Llama file's query and key rows, and transformers' processor permutes them back: the
    blocks, rows of the file, move with them, and each packed row holds the values transformers reads for it."""
    path = write_tiny_gguf(tmp_path / "q8.gguf", "Q8_0").path
    llm = LLM(model=str(path), device="cpu")
    weights, values = FileWeights(llm.engine.model_dir), CheckpointTensors(llm.engine.model_dir, torch.float32)
    query = weights.blocks("model.layers.0.self_attn.q_proj.weight")
    assert query.order is not None and not np.array_equal(query.order, np.arange(len(query.order)))  # it moves
    assert weights.blocks("model.layers.0.mlp.down_proj.weight").order is None
    assert weights.blocks("model.layers.0.input_layernorm.weight") is None  # 1-D: not blocks of rows
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    parts = [values[n] for n in llm.engine.runner.model.checkpoint_names("layers.0.self_attn.qkv_proj")]
    assert torch.equal(
        llm.engine.runner.kernels.packed_rows(qkv.packed, torch.arange(qkv.out_features)), torch.cat(parts)
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_a_mix_of_types_is_exact_in_float32_against_transformers(tmp_path, arch):
    """A Q4_K_M-like file: each projection its own type. float32 without packing is transformers' output on the
    same dequantized weights, token for token; packed, a layer stacks its parts each in its own type (Phi-3's QKV
    is one tensor of one type). Phi-3's rotated share and LongRoPE factors come from the file."""
    path = write_tiny_gguf(tmp_path / "mix.gguf", MIXED_TYPES, embedding="Q8_0", arch=arch).path
    llm = LLM(model=str(path), dtype="float32", quantization="none")
    if arch == "phi3":
        rope = llm.engine.hf_config.rope_parameters
        assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.5
        assert rope["original_max_position_embeddings"] == PHI3_ORIGINAL_CONTEXT
        assert rope["short_factor"] == pytest.approx(PHI3_ROPE_FACTORS["short"])
        assert rope["long_factor"] == pytest.approx(PHI3_ROPE_FACTORS["long"])
    prompt = llm.engine.tokenize("The quick brown fox")
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    reference = load_hf_model(llm.engine.model_dir, torch.float32)
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.token_ids == expected[0, len(prompt) :].tolist()
    packed = LLM(model=str(path), device="cpu").engine.runner.model
    qkv = "packed Q4_K" if arch == "phi3" else "packed Q4_K+Q5_0+Q6_K"
    assert packed.layers[0].mlp.gate_up_proj.kind == "packed Q4_K" and packed.layers[0].self_attn.qkv_proj.kind == qkv


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_each_tensor_is_read_by_the_name_transformers_model_gives_it(tmp_path, arch):
    """The conversion asks our model which names it reads: the names of transformers' model class for the
    file's tensors (as transformers' GGUF loading maps them, through gguf-py's table), every one."""
    path = write_tiny_gguf(tmp_path / "mix.gguf", MIXED_TYPES, embedding="Q8_0", arch=arch).path
    config = read_gguf_config(path)
    architecture, tensors = tensor_table(path)
    present = {t.name for t in tensors}
    arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    table = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    with torch.device("meta"):
        hf_names = AutoModelForCausalLM.from_config(config).state_dict()
    expected = {}
    for hf_name in hf_names:
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = table.get_name(base)
        if gguf_base is not None and f"{gguf_base}.{suffix}" in present:
            expected[f"{gguf_base}.{suffix}"] = hf_name
    assert _hf_names(architecture, config, present) == expected
    assert set(expected) == present - {"rope_factors_long.weight", "rope_factors_short.weight"}


def test_an_architecture_without_a_metadata_map_is_a_clear_error(tmp_path):
    """llama.cpp writes SmolLM3 as smollm3, which transformers' GGUF reader does not map: without this error its
    keys would be read as nothing, and a default config would take their place."""
    path = write_tiny_gguf(tmp_path / "smollm3.gguf", "Q8_0", arch="smollm3").path
    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'smollm3': transformers has no map of its metadata"):
        LLM(model=str(path), device="cpu")


def test_an_unreadable_type_is_a_clear_error(tmp_path):
    """Q8_1 is a type gguf-py does not dequantize: the error names the tensor and its type."""
    path = write_tiny_gguf(tmp_path / "q8_1.gguf", dict.fromkeys(PROJECTIONS, "Q8_0") | {"ffn_up": "Q8_1"}).path
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight: ggml type Q8_1 \(9\) cannot be read"):
        LLM(model=str(path), device="cpu")


def _hf_name(gguf_name: str) -> str:
    layer, part = gguf_name.split(".")[1:3]
    names = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    return f"model.layers.{layer}.{names[part]}.weight"


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_a_large_tensor_is_dequantized_as_gguf_py_does_it_whole(tiny_ggufs, type_name):
    """The reader hands gguf-py's row dequantization a chunk of rows at a time: the same bits as its
    ``dequantize`` of the whole tensor, across chunk boundaries (the tiny file's rows, repeated)."""
    gguf_name, (written_type, raw) = next((n, t) for n, t in tiny_ggufs[type_name].tensors.items() if "ffn_down" in n)
    rows = np.tile(raw.reshape(raw.shape[0], -1), (2 * DEQUANTIZED_ROWS // raw.shape[0] + 3, 1))
    expected = gguf.dequantize(rows, written_type)
    tensor = GgufTensor(gguf_name, written_type, expected.shape, rows)
    assert rows.shape[0] > 2 * DEQUANTIZED_ROWS and torch.equal(tensor.values(), torch.from_numpy(expected))


def test_a_float32_tensor_is_read_into_a_copy_of_its_own():
    """F32 rows are a view of the file's read-only mapping: the values are a copy, without torch's warning."""
    mapped = np.arange(8, dtype=np.float32).reshape(2, 4).view(np.uint8)
    mapped.flags.writeable = False
    tensor = GgufTensor("blk.0.attn_norm.weight", gguf.GGMLQuantizationType.F32, (2, 4), mapped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = tensor.values()
    values += 1
    assert torch.equal(values, torch.arange(1.0, 9.0).reshape(2, 4)) and mapped.view(np.float32)[0, 0] == 0


@pytest.mark.parametrize("embedding", ["Q8_0", "Q6_K", "Q4_K"])
def test_a_tied_embedding_is_read_from_the_packed_heads_blocks_with_the_same_outputs(tmp_path, monkeypatch, embedding):
    """A tied embedding in a type the kernels read is the LM head's blocks as they are: its rows come from there (the
    float32 table, Gemma 3's 671 MB, is never read), each gguf-py's values bit for bit, and every token is what the
    table gave."""
    path = write_tiny_gguf(tmp_path / f"{embedding}.gguf", MIXED_TYPES, embedding=embedding).path
    read = []
    get = CheckpointTensors.__getitem__
    monkeypatch.setattr(CheckpointTensors, "__getitem__", lambda self, name: read.append(name) or get(self, name))
    for _ in range(2):  # the first load (the conversion), then a later one
        read.clear()
        shared = LLM(model=str(path), device="cpu")
        assert "model.embed_tokens.weight" not in read and read  # the norms were read
    lookup = shared.engine.runner.model.embed_tokens
    assert isinstance(lookup, PackedEmbedding)
    assert shared.engine.runner.model.lm_head.kind == f"packed {embedding}"
    monkeypatch.undo()
    table = CheckpointTensors(shared.engine.model_dir, torch.float32)["model.embed_tokens.weight"]
    ids = torch.tensor([[0, 5, 5, table.shape[0] - 1], [3, 2, 1, 7]])
    assert torch.equal(lookup(ids), table[ids])
    monkeypatch.setattr(model_builder, "share_embedding_with_packed_head", lambda model: False)
    monkeypatch.setattr(CheckpointTensors, "embedding_in_file", lambda self, name: None)
    kept = LLM(model=str(path), device="cpu")
    assert isinstance(kept.engine.runner.model.embed_tokens, torch.nn.Embedding)
    prompts = ["The quick brown fox", "Hello"]
    assert [o.token_ids for o in shared.generate(prompts, GREEDY)] == [
        o.token_ids for o in kept.generate(prompts, GREEDY)
    ]


@pytest.mark.parametrize("embedding", ["F16", "BF16"])
def test_an_embedding_the_head_does_not_hold_is_looked_up_in_the_files_rows(tmp_path, embedding):
    """A 16-bit table, which the head packs as Q8_M of its own, is never held either, nor compared: each lookup
    dequantizes the file's rows (gguf-py), the table's rows bit for bit, and the model's every token is what the
    table gave."""
    path = write_tiny_gguf(tmp_path / f"{embedding}.gguf", MIXED_TYPES, embedding=embedding).path
    llm = LLM(model=str(path), device="cpu")
    lookup = llm.engine.runner.model.embed_tokens
    assert isinstance(lookup, FileEmbedding) and llm.engine.runner.model.lm_head.kind == "packed Q8_M"
    table = CheckpointTensors(llm.engine.model_dir, torch.float32)["model.embed_tokens.weight"]
    ids = torch.tensor([[0, 5, 5, table.shape[0] - 1], [3, 2, 1, 7]])
    assert torch.equal(lookup(ids), table[ids])
    prompts = ["The quick brown fox", "Hello"]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    llm.engine.runner.model.embed_tokens = torch.nn.Embedding.from_pretrained(table)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
