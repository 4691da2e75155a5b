"""Tiny Llama GGUF files of every tensor type, written with gguf-py, sharing the default model's tokenizer.

gguf-py quantizes F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 itself. For the other types a block is built
from the format's definition: its codes and sub-block scales are any bits (every pattern is a valid block), and its
float16 super-block scales (``d``, ``dmin``, at the offsets ggml's structs give) are set so the weights come out
near the magnitudes a trained layer has. What the engine reads of these blocks is then checked against gguf-py's own
dequantization of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from wsgi_infer.engine.loading.model_paths import default_model_path

# Every type gguf-py reads that the issue asks for; gguf-py quantizes the first eight itself.
QUANTIZED_BY_GGUF_PY = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
BUILT_FROM_DEFINITION = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
ALL_TYPES = QUANTIZED_BY_GGUF_PY + BUILT_FROM_DEFINITION

# Per type: the byte offsets of its float16 scales in a block, and the size each should have.
_HALF_SCALES = {
    Q.Q2_K: {80: 2e-3, 82: 3e-3},  # d, dmin
    Q.Q3_K: {108: 8e-4},  # d
    Q.Q4_K: {0: 1e-4, 2: 8e-4},  # d, dmin
    Q.Q5_K: {0: 5e-5, 2: 8e-4},
    Q.Q6_K: {208: 2.5e-5},
    Q.IQ4_NL: {0: 8e-4},
    Q.IQ4_XS: {0: 2.5e-5},
    Q.Q8_1: {0: 1e-3},  # a type gguf-py does not read
}

# Like a Q4_K_M file of a small model: each projection its own type (4-bit, 5-bit, 6-bit and 8-bit blocks).
MIXED_TYPES = {
    "attn_q": "Q4_K",
    "attn_k": "Q5_0",
    "attn_v": "Q6_K",
    "attn_output": "Q8_0",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q5_K",
}

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # K-quants need rows of 256
PHI3_ORIGINAL_CONTEXT = 4096  # of its 8,192: the short factors serve short prompts, scaled for the long context
PHI3_ROPE_FACTORS = {  # one per rotated pair (16 of a head's 64 dims)
    "long": [1.0 + 0.5 * i for i in range(16)],
    "short": [1.0 + 0.1 * i for i in range(16)],
}
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def blocks_of(ggml_type: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks [rows, bytes] of a type gguf-py cannot quantize: any codes, scales of a trained size."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(rows, cols // block_weights, block_bytes), dtype=np.uint8)
    for offset, size in _HALF_SCALES[ggml_type].items():
        halves = (size * rng.uniform(0.5, 1.0, size=blocks.shape[:2])).astype(np.float16)
        blocks[..., offset : offset + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def encoded(values: np.ndarray, ggml_type: Q, rng: np.random.Generator) -> np.ndarray:
    """A 2-D weight in ``ggml_type``: values quantized by gguf-py, or blocks built from the definition."""
    if ggml_type in _HALF_SCALES:
        return blocks_of(ggml_type, *values.shape, rng)
    return gguf.quants.quantize(values, ggml_type)


@cache
def _tokenizer_fields() -> list[tuple[str, object, list]]:
    """The default model's tokenizer metadata (reading it takes gguf-py 3 s: once per run)."""
    source = gguf.GGUFReader(default_model_path())
    return [(key, f.contents(), f.types) for key, f in source.fields.items() if key.startswith("tokenizer.")]


class _Writer(gguf.GGUFWriter):
    """Packs each metadata list once per run: gguf-py packs the 49,152 tokens and their merges item by item,
    0.5 s a file. The cache keeps each list it packed, so an id is never taken by another list."""

    _packed: ClassVar[dict[tuple[int, bool], tuple[list, bytes]]] = {}

    def _pack_val(self, val: Any, vtype: gguf.GGUFValueType, add_vtype: bool, sub_type: Any = None) -> bytes:
        if not isinstance(val, list):
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        key = id(val), add_vtype
        if key not in self._packed:
            self._packed[key] = val, super()._pack_val(val, vtype, add_vtype, sub_type)
        return self._packed[key][1]


@dataclass
class TinyGGUF:
    path: Path
    tensors: dict[str, tuple[Q, np.ndarray]]  # each 2-D tensor's type and bytes [rows, bytes per row], as written


EMBEDDING = "token_embd.weight"


@cache
def _first_embedding(seed: int, shape: tuple[int, int], ggml_type: str) -> tuple[np.ndarray, dict]:
    """A file's token embedding, its first tensor: 12.6 million random values for the default vocabulary, most of a
    file's writing (0.3 of 0.42 s). Drawn once per process and kind, with the generator's state after it, so that
    every file's later tensors are drawn as they would be after drawing it (the files are the same bytes)."""
    rng = np.random.default_rng(seed)
    raw = encoded(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05), Q[ggml_type], rng)
    raw.flags.writeable = False  # shared by every file of its kind
    return raw, rng.bit_generator.state


def write_tiny_gguf(
    path: Path,
    types: dict[str, str] | str,
    seed: int = 0,
    embedding: str = "F16",
    arch: str = "llama",
    user_defined_tokens: int = 0,
) -> TinyGGUF:
    """A 2-layer Llama (or Qwen3: with per-head q/k norms; or Phi-3: QKV and gate-up fused, as llama.cpp writes
    them, the attention's and the up projection's types, half of each head rotated by LongRoPE's factors) whose
    projections are of ``types`` (one name, or one per projection of ``PROJECTIONS``), its embedding (tied to the
    LM head) of ``embedding``, its norms F32; the default vocabulary and ``user_defined_tokens`` more
    (``<extra_0>``...: what llama.cpp's converter writes for a tokenizer's added tokens that are not special)."""
    rng = np.random.default_rng(seed)
    per_projection = dict.fromkeys(PROJECTIONS, types) if isinstance(types, str) else types
    fields = _tokenizer_fields()
    if user_defined_tokens:
        extra = {
            "tokenizer.ggml.tokens": [f"<extra_{i}>" for i in range(user_defined_tokens)],
            "tokenizer.ggml.token_type": [int(gguf.TokenType.USER_DEFINED)] * user_defined_tokens,
        }
        fields = [(key, value + extra[key] if key in extra else value, types) for key, value, types in fields]
    vocab = len(next(value for key, value, _ in fields if key == "tokenizer.ggml.tokens"))
    writer = _Writer(path, arch=arch)
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(2 * PHI3_ORIGINAL_CONTEXT if arch == "phi3" else 2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS // (2 if arch == "phi3" else 1))
    if arch == "phi3":  # LongRoPE (Phi-3 128k, Phi-4-mini): short factors up to the original context, then long
        writer.add_rope_scaling_orig_ctx_len(PHI3_ORIGINAL_CONTEXT)
        for kind, factors in PHI3_ROPE_FACTORS.items():
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(factors, dtype=np.float32))
    if arch == "qwen3":  # as llama.cpp writes Qwen3 files: its config's head_dim is not hidden / heads
        writer.add_key_length(HIDDEN // HEADS)
        writer.add_value_length(HIDDEN // HEADS)
    writer.add_vocab_size(vocab)
    for key, value, types in fields:
        writer.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)

    written = {}

    def add(name: str, shape: tuple[int, ...], ggml_type: str) -> None:
        if name == EMBEDDING:
            raw, state = _first_embedding(seed, shape, ggml_type)
            rng.bit_generator.state = state
        else:
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)
            if len(shape) == 1:
                writer.add_tensor(name, 1.0 + values)  # norms near one
                return
            raw = encoded(values, Q[ggml_type], rng)
        writer.add_tensor(name, raw, raw_dtype=Q[ggml_type])
        written[name] = (Q[ggml_type], raw.view(np.uint8).reshape(shape[0], -1))

    add(EMBEDDING, (vocab, HIDDEN), embedding)
    add("output_norm.weight", (HIDDEN,), "F32")
    head_dim = HIDDEN // HEADS
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTERMEDIATE, HIDDEN),
        "ffn_up": (INTERMEDIATE, HIDDEN),
        "ffn_down": (HIDDEN, INTERMEDIATE),
    }
    if arch == "phi3":
        qkv = (HIDDEN + 2 * KV_HEADS * head_dim, HIDDEN)
        shapes = {"attn_qkv": qkv, "attn_output": shapes["attn_output"]} | {
            "ffn_up": (2 * INTERMEDIATE, HIDDEN),
            "ffn_down": shapes["ffn_down"],
        }
        per_projection = per_projection | {"attn_qkv": per_projection["attn_q"]}
    for layer in range(LAYERS):
        add(f"blk.{layer}.attn_norm.weight", (HIDDEN,), "F32")
        add(f"blk.{layer}.ffn_norm.weight", (HIDDEN,), "F32")
        if arch == "qwen3":
            add(f"blk.{layer}.attn_q_norm.weight", (head_dim,), "F32")
            add(f"blk.{layer}.attn_k_norm.weight", (head_dim,), "F32")
        for projection, shape in shapes.items():
            add(f"blk.{layer}.{projection}.weight", shape, per_projection[projection])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, written)
