"""The weights of a GGUF file under their Hugging Face names: dequantized, and as int4 groups.

transformers reads a GGUF's config and tokenizer (``model_loader``), and names
and reorders its tensors (``get_gguf_hf_weights_map`` and its tensor
processors, which undo llama.cpp's permutation of the query and key rows).
Dequantizing is done here in torch, in about a second where transformers'
numpy path takes about 10 s; and the 4-bit blocks (Q4_0, Q4_1) are kept as they
are, so the int4 kernels serve the file's own weights (``layers.quantization``).
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

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # a 32-weight block: fp16 scale(s), then codes


def read_gguf_weights(gguf_file: Path, config) -> tuple[dict[str, torch.Tensor], dict[str, Int4Groups]]:
    """Every tensor as float32 by its Hugging Face name, and the int4 groups of the 4-bit ones."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = gguf.GGUFReader(gguf_file)
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names = _hf_names(gguf, architecture, config)
    weights, groups = {}, {}
    started = time.monotonic()
    for index, tensor in enumerate(reader.tensors):
        if tensor.name not in names:
            continue  # e.g. precomputed rope frequencies: our model computes them

        def reorder(array: np.ndarray, name: str = tensor.name) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(processor.process(weights=array, name=name).weights))

        name, kind = names[tensor.name], tensor.tensor_type.name
        if kind in ("Q4_0", "Q4_1"):
            found, weight = _read_q4(np.asarray(tensor.data), kind)
            groups[name] = Int4Groups(*(reorder(t.numpy()) for t in (found.q, found.scale, found.zero)))
            weights[name] = reorder(weight.numpy())
        elif kind == "Q8_0":
            weights[name] = reorder(_dequantize_q8_0(np.asarray(tensor.data)).numpy())
        else:
            weights[name] = reorder(gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
        if time.monotonic() - started > 2 and index % 50 == 0:
            log.info("GGUF %s: %d of %d tensors read", gguf_file.name, index, len(reader.tensors))
    return weights, groups


def _hf_names(gguf, architecture: str, config) -> dict[str, str]:
    """GGUF tensor name -> transformers name, through gguf-py's table for the file's architecture
    (what transformers' ``get_gguf_hf_weights_map`` does, without rebuilding the table per module)."""
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


def _blocks(data: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, blocks, bytes] of the raw blocks, and their first fp16 scale as float32."""
    blocks = torch.from_numpy(data.reshape(data.shape[0], -1, _BLOCK_BYTES[kind]).copy())
    return blocks, blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()


def _read_q4(data: np.ndarray, kind: str) -> tuple[Int4Groups, torch.Tensor]:
    """The int4 groups of a 4-bit tensor, and its float32 values computed as gguf-py computes them.

    Q4_1 is ``d * q + m``, Q4_0 ``d * (q - 8)``: in torch's ``(q - 8) * scale + zero``, scale = d
    and zero = m + 8d (or 0). Low nibbles hold a block's first 16 codes, high nibbles the last 16.
    """
    blocks, d = _blocks(data, kind)
    if kind == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
        codes = blocks[..., 4:]
    else:
        m, codes = -8 * d, blocks[..., 2:]
    q = torch.cat([codes & 0xF, codes >> 4], dim=-1)  # [rows, blocks, 32]
    weight = d[..., None] * q.float() + m[..., None] if kind == "Q4_1" else d[..., None] * (q.float() - 8)
    groups = Int4Groups(q.view(data.shape[0], -1), d, m + 8 * d)
    return groups, weight.view(data.shape[0], -1)


def _dequantize_q8_0(data: np.ndarray) -> torch.Tensor:
    blocks, d = _blocks(data, "Q8_0")
    codes = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (codes * d[..., None]).view(data.shape[0], -1)


INT4_GROUPS_FILE = "int4_groups.safetensors"  # beside model.safetensors in a converted GGUF's directory


def save_int4_groups(groups: dict[str, Int4Groups], path: Path) -> None:
    """Two codes per byte (low nibble first), and the groups' scales and zeros."""
    from safetensors.torch import save_file

    tensors = {}
    for name, g in groups.items():
        tensors[f"{name}.q4"] = (g.q[:, 0::2] | (g.q[:, 1::2] << 4)).contiguous()
        tensors[f"{name}.q4_scale"], tensors[f"{name}.q4_zero"] = g.scale.contiguous(), g.zero.contiguous()
    save_file(tensors, path)


class StoredInt4Groups(Mapping):
    """What ``save_int4_groups`` wrote, read one weight at a time (empty if the file is absent), so
    that packing a model never holds more than one layer's codes unpacked."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._names = []
        if path.is_file():
            with safe_open(path, framework="pt") as f:
                self._names = [k.removesuffix(".q4") for k in f.keys() if k.endswith(".q4")]

    def __getitem__(self, name: str) -> Int4Groups:
        if name not in self._names:
            raise KeyError(name)
        with safe_open(self._path, framework="pt") as f:
            packed = f.get_tensor(f"{name}.q4")
            q = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)
            return Int4Groups(q, f.get_tensor(f"{name}.q4_scale"), f.get_tensor(f"{name}.q4_zero"))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
