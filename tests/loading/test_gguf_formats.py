"""Every GGUF tensor type gguf-py reads loads; blocks map onto the packed groups as their scales say; and the
packed layers multiply what the file holds."""

from __future__ import annotations

import json
import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import GPT2TensorProcessor, LlamaTensorProcessor

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.kernels.layouts import KernelWeight, int8_kernel_layout
from wsgi_infer.engine.kernels.weight_groups import Int4Groups, Int8Groups
from wsgi_infer.engine.layers import packed_embedding
from wsgi_infer.engine.layers.packed_embedding import PackedEmbedding, holds_exactly, packed_rows
from wsgi_infer.engine.layers.quantization import PackedLinear
from wsgi_infer.engine.loading import gguf_blocks, model_builder
from wsgi_infer.engine.loading.checkpoint_tensors import CheckpointTensors
from wsgi_infer.engine.loading.file_weights import FILE_WEIGHTS_FILE, FileEmbedding
from wsgi_infer.engine.loading.gguf_blocks import BYTE_TYPES, MAPPED_TYPES, dequantize_to, groups_from_blocks
from wsgi_infer.engine.loading.gguf_checkpoint import _hf_names, _moves_rows_only, read_gguf_config
from wsgi_infer.engine.loading.gguf_file import DEQUANTIZED_ROWS, GgufTensor, tensor_table
from wsgi_infer.engine.loading.model_paths import ModelLoadError
from wsgi_infer.engine.loading.packed_groups_file import StoredGroups

from ..conftest import assert_idle
from ..support.batch_runs import GREEDY
from ..support.gguf_files import (
    ALL_TYPES,
    MIXED_TYPES,
    PHI3_ORIGINAL_CONTEXT,
    PHI3_ROPE_FACTORS,
    PROJECTIONS,
    TinyGGUF,
    blocks_of,
    write_tiny_gguf,
)
from ..support.transformers_reference import load_hf_model

# Blocks whose scales the packed groups hold as they are; K-quants' and IQ4_XS's are products rounded to float16.
EXACT = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL}
INT4 = {Q.Q4_0, Q.Q4_1, Q.Q4_K}
HALF_ROUNDING = 2**-11  # float16 keeps 11 significant bits: a rounded value is within 2^-11 of it, relative


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, TinyGGUF]:
    folder = tmp_path_factory.mktemp("gguf")
    return {name: write_tiny_gguf(folder / f"tiny-{name}.gguf", name) for name in ALL_TYPES}


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_every_type_loads_as_gguf_py_reads_it_and_packs_what_it_holds(tiny_ggufs, type_name):
    """The converted weights are gguf-py's values bit for bit (in transformers' row order), kept only as their
    groups where those hold them exactly (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL), the others read from the file
    (``file_weights``). Where the blocks map onto groups, the groups hold those values, exactly or within one
    float16 rounding of each group's scale and low; elsewhere they are made from the values. On the CPU kernels
    every projection is packed (4-bit blocks as int4, other mapped blocks as int8, the rest as 8-bit groups made
    from the values), keeps no full-precision copy, and multiplies the file's
    weights within the float32 rows' 16-bit rounding (within 8-bit rounding where its groups were made from the
    values)."""
    tiny, ggml_type = tiny_ggufs[type_name], Q[type_name]
    llm = LLM(model=str(tiny.path), device="cpu")
    model_dir = llm.engine.model_dir
    values, stored = CheckpointTensors(model_dir, torch.float32), StoredGroups(model_dir)
    processor = LlamaTensorProcessor(config=llm.engine.hf_config.to_dict())
    in_file = json.loads((model_dir / FILE_WEIGHTS_FILE).read_text())["weights"]
    for gguf_name, (written_type, raw) in tiny.tensors.items():
        if not gguf_name.startswith("blk.0."):
            continue
        hf_name = _hf_name(gguf_name)
        read = processor.process(weights=gguf.dequantize(raw, written_type), name=gguf_name).weights
        expected = torch.from_numpy(np.ascontiguousarray(read))
        assert torch.equal(values[hf_name], expected), gguf_name
        assert (hf_name in in_file) == (written_type not in EXACT), gguf_name  # else kept only as groups
        assert isinstance(stored[hf_name], Int4Groups if ggml_type in INT4 else Int8Groups)  # made from values else
        if ggml_type in MAPPED_TYPES:
            _assert_groups_hold(stored[hf_name], expected, exact=ggml_type in EXACT)
    if llm.engine.runner.kernels is None:
        pytest.skip("no C compiler")
    model = llm.engine.runner.model
    torch.manual_seed(0)
    for name, layer in model.named_modules():
        if not isinstance(layer, PackedLinear) or name == "lm_head":
            continue
        assert layer.weight is None and layer.bits == (4 if ggml_type in INT4 else 8), name
        weight = torch.cat([values[n] for n in model.checkpoint_names(name)])
        x = torch.randn(3, layer.in_features)
        expected = x.double() @ weight.double().t()
        error = (layer.packed_mm(x).double() - expected).norm() / expected.norm()
        # the rows' 16-bit rounding; and the float16 rounding of K-quants' scales; or 8-bit codes made from values
        assert error < (2**-12 if ggml_type in EXACT else 2**-10 if ggml_type in MAPPED_TYPES else 2**-7), name
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    assert_idle(llm)


def _assert_groups_hold(g: Int4Groups | Int8Groups, values: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(g.dequantize(), values)
        return
    scale, low = _per_weight(g.scale), _per_weight(_low(g))
    codes = g.q if isinstance(g, Int4Groups) else g.codes
    bound = 2 * HALF_ROUNDING * (scale.abs() * codes.float().abs() + low.abs()) + 1e-12
    assert ((g.dequantize() - values).abs() <= bound).all()


def test_byte_for_byte_blocks_give_gguf_pys_values_bit_for_bit_whatever_their_scales():
    """Q4_0, Q4_1 and Q8_0 groups are the blocks' bytes, and dequantize as gguf-py does (``q * d + m`` in float32),
    so their values are never needed, even where d and m lie 2^13 apart (d = 1024, m = 2^-14: 28 bits, which a
    zero of ``m + 8d`` lost)."""
    rng = np.random.default_rng(2)
    raw = gguf.quantize(rng.normal(0, 0.05, size=(4, 64)).astype(np.float32), Q.Q4_1).reshape(4, 2, 20)
    raw[0, 0, 0:4] = np.array([1024, 2**-14], dtype=np.float16).view(np.uint8)
    raw = raw.reshape(4, -1)
    any_bytes = rng.integers(0, 256, size=(2, 68), dtype=np.uint8)  # two Q8_0 blocks a row
    any_bytes[:, 0:2] = any_bytes[:, 34:36] = np.array([0.01], dtype=np.float16).view(np.uint8)  # finite scales
    for blocks, ggml_type in [(raw, Q.Q4_1), (any_bytes, Q.Q8_0), (any_bytes[:, :36], Q.Q4_0)]:
        assert ggml_type in BYTE_TYPES  # so the conversion reads no values for it
        groups = groups_from_blocks(torch.from_numpy(blocks), ggml_type, lambda: pytest.fail("needs no values"))
        assert torch.equal(groups.dequantize(), torch.from_numpy(gguf.dequantize(blocks, ggml_type)))


def test_groups_are_kept_only_where_transformers_moves_a_tensors_rows_alone():
    """llama.cpp permutes a Llama file's query and key rows, and transformers' processor permutes them back: the
    groups, rows of the file, move with them. GPT-2's processor transposes its Conv1D weights: no groups there,
    and the values are read from the file."""
    llama = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    query = GgufTensor("blk.0.attn_q.weight", Q.Q8_0, (64, 64), None)  # only its name and shape are read
    rows = np.arange(64, dtype=np.float32)[:, None]
    assert not np.array_equal(llama.process(weights=rows, name=query.name).weights, rows)  # it does move them
    assert _moves_rows_only(llama, query)
    assert not _moves_rows_only(GPT2TensorProcessor(), GgufTensor("blk.0.attn_qkv.weight", Q.Q8_0, (192, 64), None))
    assert _moves_rows_only(GPT2TensorProcessor(), GgufTensor("token_embd.weight", Q.Q8_0, (100, 64), None))


def test_groups_are_compared_with_values_a_chunk_of_rows_at_a_time(monkeypatch):
    monkeypatch.setattr(gguf_blocks, "CHUNK_ROWS", 3)
    for groups in (Int8Groups.from_weight(torch.randn(10, 64)), Int4Groups.from_weight(torch.randn(10, 64))):
        values = groups.dequantize()
        assert dequantize_to(groups, values)
        values[9, 5] += 1e-3  # the last chunk's only row
        assert not dequantize_to(groups, values)


def test_q4_k_maps_onto_int4_groups_block_by_block():
    """Each super-block's 8 sub-blocks become 8 groups: codes exactly the block's nibbles (sub-block 2c in the low
    nibbles of bytes 32c..32c+31, 2c + 1 in the high ones), scale d * sc and low -dmin * m, each rounded once to
    float16. Extremes included: sub-block scales and mins of 0 and 63. The values are never asked for."""
    rng = np.random.default_rng(1)
    raw = blocks_of(Q.Q4_K, 4, 512, rng)
    blocks = raw.reshape(4, 2, 144)
    blocks[0, :, 4:16] = 0  # every scale and min 0: the blocks are all zeros
    blocks[1, :, 4:16] = 0xFF  # every scale and min 63
    values = torch.from_numpy(gguf.dequantize(raw, Q.Q4_K))
    groups = groups_from_blocks(torch.from_numpy(raw), Q.Q4_K, lambda: pytest.fail("the values were read"))
    assert isinstance(groups, Int4Groups)
    qs = torch.from_numpy(raw).view(4, 2, 144)[..., 16:].reshape(4, 2, 4, 32).long()  # [rows, blocks, chunk, byte]
    nibbles = torch.stack([qs & 15, qs >> 4], dim=3)  # [rows, blocks, chunk, half, byte]: sub-block 2c + half
    assert torch.equal(groups.q.long(), nibbles.reshape(4, 512))  # from the bits: a scale of 0 keeps its nibbles
    d, dmin = (torch.from_numpy(blocks[..., at : at + 2].copy()).view(torch.float16).float() for at in (0, 2))
    assert (groups.scale[0] == 0).all() and (groups.low[0] == 0).all()
    assert torch.equal(groups.scale[1], (d[1] * 63).half().float().repeat_interleave(8))
    assert torch.equal(groups.low[1], (-dmin[1] * 63).half().float().repeat_interleave(8))
    _assert_groups_hold(groups, values, exact=False)
    assert torch.equal(groups.dequantize()[0], values[0])  # a block of zeros stays zeros


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_a_mix_of_types_is_exact_in_float32_against_transformers(tmp_path, arch):
    """A Q4_K_M-like file: each projection its own type. float32 without packing is transformers' output on the
    same dequantized weights, token for token; packed, a layer stacking 4- and 8-bit parts is 8-bit (Phi-3's QKV
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
    if isinstance(packed.layers[0].mlp.gate_up_proj, PackedLinear):
        qkv_bits = 4 if arch == "phi3" else 8
        assert packed.layers[0].mlp.gate_up_proj.bits == 4 and packed.layers[0].self_attn.qkv_proj.bits == qkv_bits


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
    assert _hf_names(architecture, config, present)[0] == expected
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


def _per_weight(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(32, dim=1)


def _low(g: Int4Groups | Int8Groups) -> torch.Tensor:
    return g.low if g.low is not None else torch.zeros_like(g.scale)


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


@pytest.mark.parametrize("with_low", [False, True])
def test_a_packed_head_holds_a_table_exactly_as_its_rows_read_back(with_low):
    """The load's whole-table check (by tiles) agrees with the lookups' rows, padding past the last row included."""
    rows, k = 4096 + 37, 64
    scale = torch.rand(rows, k // 32).half().float()
    low = torch.randn(rows, k // 32).half().float() if with_low else None
    groups = Int8Groups(torch.randint(-127, 128, (rows, k), dtype=torch.int8), scale, low)
    weight = KernelWeight(8, *int8_kernel_layout(groups))
    table = packed_rows(weight, torch.arange(rows))
    expected = groups.codes.float().view(rows, -1, 32) * scale[..., None] + (0 if low is None else low[..., None])
    assert torch.equal(table, expected.view(rows, k))
    assert torch.equal(groups.dequantize(), table)  # why a table kept only as the head's groups is never compared
    assert holds_exactly(weight, table)
    for row in (0, 4095, rows - 1):
        changed = table.clone()
        changed[row, 5] = torch.nextafter(changed[row, 5], torch.tensor(float("inf")))
        assert not holds_exactly(weight, changed), row


def test_a_q8_0_embedding_is_read_from_the_packed_head_with_the_same_outputs(tmp_path, monkeypatch):
    """A tied Q8_0 embedding is the LM head's int8 groups as they are: its rows come from there (the float32 table,
    Gemma 3's 671 MB, is let go) and every token is what the table gave. An F16 embedding, which the head packs
    into groups of its own, does not: its rows come from the file (the last test here)."""
    path = write_tiny_gguf(tmp_path / "q8.gguf", MIXED_TYPES, embedding="Q8_0").path
    shared = LLM(model=str(path), device="cpu")
    assert isinstance(shared.engine.runner.model.embed_tokens, PackedEmbedding)
    monkeypatch.setattr(model_builder, "share_embedding_with_packed_head", lambda model, known_exact=False: None)
    kept = LLM(model=str(path), device="cpu")
    assert isinstance(kept.engine.runner.model.embed_tokens, torch.nn.Embedding)
    prompts = ["The quick brown fox", "Hello"]
    expected = [o.token_ids for o in kept.generate(prompts, GREEDY)]
    assert [o.token_ids for o in shared.generate(prompts, GREEDY)] == expected
    monkeypatch.undo()
    f16 = write_tiny_gguf(tmp_path / "f16.gguf", MIXED_TYPES, embedding="F16").path
    assert not isinstance(LLM(model=str(f16), device="cpu").engine.runner.model.embed_tokens, PackedEmbedding)


def test_no_load_reads_a_table_kept_only_as_the_groups_the_head_packs(tmp_path, monkeypatch):
    """A tied Q8_0 embedding is kept only as its groups, which the LM head packs as they are: no load, the first
    included, reads the float32 table or compares it (that its rows give the table's tokens: the test above). Nor
    is an F16 embedding's, which the head packs into groups of its own: its rows are looked up in the file."""
    path = write_tiny_gguf(tmp_path / "q8.gguf", MIXED_TYPES, embedding="Q8_0").path
    read, compared = [], []
    get, holds = CheckpointTensors.__getitem__, packed_embedding.holds_exactly
    monkeypatch.setattr(CheckpointTensors, "__getitem__", lambda self, name: read.append(name) or get(self, name))
    monkeypatch.setattr(packed_embedding, "holds_exactly", lambda *args: compared.append(args) or holds(*args))
    for _ in range(2):  # the first load, then a later one
        read.clear()
        assert isinstance(LLM(model=str(path), device="cpu").engine.runner.model.embed_tokens, PackedEmbedding)
        assert "model.embed_tokens.weight" not in read and not compared and read  # the norms were read
    f16 = write_tiny_gguf(tmp_path / "f16.gguf", MIXED_TYPES, embedding="F16").path
    for _ in range(2):
        read.clear()
        assert isinstance(LLM(model=str(f16), device="cpu").engine.runner.model.embed_tokens, FileEmbedding)
        assert "model.embed_tokens.weight" not in read and not compared


@pytest.mark.parametrize("embedding", ["F16", "Q6_K", "Q4_K", "BF16"])
def test_an_embedding_the_head_does_not_hold_is_looked_up_in_the_files_rows(tmp_path, embedding):
    """On the CPU kernels a table that its groups do not hold bit for bit is never held: each lookup dequantizes the
    file's rows (gguf-py), the table's rows bit for bit, and the model's every token is what the table gave."""
    path = write_tiny_gguf(tmp_path / f"{embedding}.gguf", MIXED_TYPES, embedding=embedding).path
    llm = LLM(model=str(path), device="cpu")
    if llm.engine.runner.kernels is None:
        pytest.skip("no C compiler")
    lookup = llm.engine.runner.model.embed_tokens
    assert isinstance(lookup, FileEmbedding)
    table = CheckpointTensors(llm.engine.model_dir, torch.float32)["model.embed_tokens.weight"]
    ids = torch.tensor([[0, 5, 5, table.shape[0] - 1], [3, 2, 1, 7]])
    assert torch.equal(lookup(ids), table[ids])
    prompts = ["The quick brown fox", "Hello"]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    llm.engine.runner.model.embed_tokens = torch.nn.Embedding.from_pretrained(table)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
