"""The weights of a GGUF file under their Hugging Face names: dequantized, and as int4 groups.

The config comes from the file's metadata through transformers' key mapping;
transformers' fast reader maps the file, and its tensor processors reorder
tensors (undoing llama.cpp's permutation of the query and key rows); gguf-py
names them.
Dequantizing is done here in torch, exactly as gguf-py computes it; and the
4-bit blocks (Q4_0, Q4_1) are kept as they are, so the int4 kernels serve the
file's own weights (``layers.quantization``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from .layers.quantization import Int4Groups

log = logging.getLogger(__name__)

# ggml type ids, and the bytes of their 32-weight blocks: fp16 scale (and min for Q4_1), then codes.
_Q4_0, _Q4_1, _Q8_0 = 2, 3, 8
_Q4_TYPES = (_Q4_0, _Q4_1)
_BLOCK_BYTES = {_Q4_0: 18, _Q4_1: 20, _Q8_0: 34}


def read_gguf_config(gguf_file: Path):
    """The transformers config of a GGUF file, from its metadata as transformers' legacy reader maps it
    (``load_gguf_checkpoint``), but read with its fast reader: 0.01 s instead of about 4 s."""
    from transformers import AutoConfig
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_TO_TRANSFORMERS_MAPPING

    metadata, tensor_names = read_gguf_metadata(str(gguf_file))
    architecture = file_architecture = metadata["general.architecture"]
    if architecture == "llama" and metadata.get("general.name") == "mistral":
        architecture = "mistral"  # the legacy reader's one rule for Mistral, which llama.cpp files as llama
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    values = {}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        prefix = architecture if prefix == file_architecture else prefix
        name = renames.get(prefix, {}).get(rest)
        if name is not None and name != -1:
            values[name] = architecture if name == "model_type" else value
    values["tie_word_embeddings"] = "output.weight" not in tensor_names
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}).items():
        values.setdefault(key, value)
    values.setdefault("vocab_size", metadata.get("tokenizer.ggml.tokens"))  # the reader gives its length
    return AutoConfig.for_model(**values)


def read_gguf_weights(gguf_file: Path, config) -> tuple[dict[str, torch.Tensor], dict[str, Int4Groups]]:
    """Every tensor as float32 by its Hugging Face name, and the int4 groups of the 4-bit ones."""
    from transformers.integrations.gguf import GgufHeader, load_gguf_state_dict
    from transformers.integrations.gguf.dequant import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    header = GgufHeader.from_file(str(gguf_file))
    stored = load_gguf_state_dict(header)  # lazy: each tensor is read from the mapped file when asked
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config.to_dict())
    names = _hf_names(header.architecture, config)
    weights, groups = {}, {}
    started = time.monotonic()
    for index, info in enumerate(header.tensors):
        if info.name not in names:
            continue  # e.g. precomputed rope frequencies: our model computes them

        def reorder(tensor: torch.Tensor, name: str = info.name) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(processor.process(weights=tensor.numpy(), name=name).weights))

        name, raw = names[info.name], stored[info.name][()]
        if info.ggml_type in _Q4_TYPES:
            found, weight = _read_q4(raw, info.ggml_type)
            groups[name] = Int4Groups(*(reorder(t) for t in (found.codes, found.scale, found.zero)))
            weights[name] = reorder(weight)
        elif info.ggml_type == _Q8_0:
            weights[name] = reorder(_dequantize_q8_0(raw))
        elif raw.is_floating_point():
            weights[name] = reorder(raw.float())
        else:
            weights[name] = reorder(dequantize(raw.reshape(-1), info.ggml_type).view(info.shape))
        if time.monotonic() - started > 2 and index % 50 == 0:
            log.info("GGUF %s: %d of %d tensors read", gguf_file.name, index, len(header.tensors))
    return weights, groups


def _hf_names(architecture: str, config) -> dict[str, str]:
    """GGUF tensor name -> transformers name, through gguf-py's table for the file's architecture
    (what transformers' ``get_gguf_hf_weights_map`` does, without rebuilding the table per module)."""
    import gguf
    from transformers import AutoModelForCausalLM

    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    table = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    with torch.device("meta"):
        hf_names = AutoModelForCausalLM.from_config(config).state_dict()
    names = {}
    for hf_name in hf_names:
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _blocks(raw: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, blocks, bytes] of a tensor's raw blocks, and their first fp16 scale as float32."""
    blocks = raw.reshape(raw.shape[0], -1, _BLOCK_BYTES[ggml_type])
    return blocks, blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()


def _read_q4(raw: torch.Tensor, ggml_type: int) -> tuple[Int4Groups, torch.Tensor]:
    """The int4 groups of a 4-bit tensor, and its float32 values computed as gguf-py computes them.

    Q4_1 is ``d * q + m``, Q4_0 ``d * (q - 8)``: in torch's ``(q - 8) * scale + zero``, scale = d
    and zero = m + 8d (or 0). Low nibbles hold a block's first 16 codes, high nibbles the last 16.
    """
    blocks, d = _blocks(raw, ggml_type)
    if ggml_type == _Q4_1:
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
        codes = blocks[..., 4:]
    else:
        m, codes = -8 * d, blocks[..., 2:]
    q = torch.cat([codes & 0xF, codes >> 4], dim=-1)  # [rows, blocks, 32]
    weight = d[..., None] * q.float() + m[..., None] if ggml_type == _Q4_1 else d[..., None] * (q.float() - 8)
    groups = Int4Groups(codes.reshape(raw.shape[0], -1), d, m + 8 * d)
    return groups, weight.view(raw.shape[0], -1)


def _dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks, d = _blocks(raw, _Q8_0)
    codes = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (codes * d[..., None]).view(raw.shape[0], -1)


INT4_GROUPS_FILE = "int4_groups.safetensors"  # beside model.safetensors in a converted GGUF's directory


def save_int4_groups(groups: dict[str, Int4Groups], path: Path) -> None:
    """The groups' codes as GGUF's blocks hold them (``Int4Groups``), and their scales and zeros."""
    from safetensors.torch import save_file

    tensors = {}
    for name, g in groups.items():
        tensors[f"{name}.q4"] = g.codes.contiguous()
        tensors[f"{name}.q4_scale"], tensors[f"{name}.q4_zero"] = g.scale.contiguous(), g.zero.contiguous()
    save_file(tensors, path)


class StoredInt4Groups(Mapping):
    """What ``save_int4_groups`` wrote, read one weight at a time (empty if the file is absent)."""

    def __init__(self, path: Path) -> None:
        # One handle for every read: opening the file parses its header, 2 ms a time, 0.5 s for every weight.
        self._file = safe_open(path, framework="pt") if path.is_file() else None
        keys = self._file.keys() if self._file is not None else []
        self._names = frozenset(k.removesuffix(".q4") for k in keys if k.endswith(".q4"))

    def __contains__(self, name: object) -> bool:
        return name in self._names  # without reading the weight (Mapping's default would)

    def __getitem__(self, name: str) -> Int4Groups:
        if name not in self._names:
            raise KeyError(name)
        return Int4Groups(*(self._file.get_tensor(f"{name}.{suffix}") for suffix in ("q4", "q4_scale", "q4_zero")))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
