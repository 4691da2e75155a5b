"""A GGUF file's config, and its tensors under their Hugging Face names as a converted copy keeps them.

The config comes from the file's metadata through transformers' key mapping
and fast reader. Each tensor our model reads becomes: its float32 values where
it is 1-D (norms), and its packed groups where it is 2-D, the blocks' own where
they map onto the packed formats (``gguf_blocks``), else made from gguf-py's
values; transformers' tensor processors reorder them (undoing llama.cpp's
permutation of the query and key rows). A 2-D weight's values are never kept:
where its groups do not give them bit for bit, its place in the file is, for a
load to read them there (``file_weights``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ..kernels.weight_groups import Int8Groups, WeightGroups, group_tensors
from ..models import allocate_model
from .gguf_blocks import BYTE_TYPES, ROUNDED_TYPES, dequantize_to, groups_from_blocks
from .gguf_file import GgufTensor, tensor_table

log = logging.getLogger(__name__)


# As the legacy reader: a GGUF of these holds the text backbone only, whose config is of its own type.
TEXT_BACKBONES = {"gemma3": "gemma3_text"}


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
    if architecture not in renames:  # e.g. smollm3: the metadata's names would be read as nothing, silently
        raise ValueError(
            f"GGUF architecture {architecture!r}: transformers has no map of its metadata "
            "(the model's Hugging Face directory may load)"
        )
    values = {}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        prefix = architecture if prefix == file_architecture else prefix
        name = renames.get(prefix, {}).get(rest)
        if name is not None and name != -1:
            values[name] = architecture if name == "model_type" else value
    values["tie_word_embeddings"] = "output.weight" not in tensor_names
    key_length = metadata.get(f"{file_architecture}.attention.key_length")
    if key_length is not None:  # llama.cpp writes a head's size; transformers' map skips it for some (Qwen3)
        values.setdefault("head_dim", key_length)
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}).items():
        values.setdefault(key, value)
    values.setdefault("vocab_size", metadata.get("tokenizer.ggml.tokens"))  # the reader gives its length
    values["model_type"] = TEXT_BACKBONES.get(architecture, architecture)
    if architecture == "phi3":
        values.update(_phi3_rope(gguf_file, metadata, values))
    return AutoConfig.for_model(**values)


def _phi3_rope(gguf_file: Path, metadata: dict, values: dict) -> dict:
    """What transformers' map leaves out of a Phi-3 file (Phi-3.5-mini, Phi-4-mini): the rotated share of each
    head (``rope.dimension_count``) and LongRoPE, whose factors llama.cpp keeps as two tensors."""
    head_dim = values["hidden_size"] // values["num_attention_heads"]
    rotary = metadata.get("phi3.rope.dimension_count", head_dim)
    rope = {"rope_theta": values.get("rope_theta", 10000.0), "partial_rotary_factor": rotary / head_dim}
    factors = {t.name: t for t in tensor_table(gguf_file)[1] if t.name.startswith("rope_factors_")}
    if factors:
        rope |= {
            "rope_type": "longrope",
            "short_factor": factors["rope_factors_short.weight"].values().tolist(),
            "long_factor": factors["rope_factors_long.weight"].values().tolist(),
            "original_max_position_embeddings": metadata["phi3.rope.scaling.original_context_length"],
        }
        rope["factor"] = values["max_position_embeddings"] / rope["original_max_position_embeddings"]
    else:
        rope["rope_type"] = "default"
    return {"rope_parameters": rope, "partial_rotary_factor": rope["partial_rotary_factor"]}


VALUES_ROWS = 4096  # rows of a tensor whose groups are made from its values, at a time


@dataclass
class ConvertedTensor:
    """What a converted copy keeps of one tensor, under its Hugging Face name: its float32 ``values`` (a norm's, a
    bias's: 1-D), its packed ``groups``, and, where these do not give its values bit for bit, the ``place`` in the
    file to read them from (``file_weights``)."""

    name: str
    values: torch.Tensor | None = None
    groups: WeightGroups | None = None
    place: list | None = None


def gguf_tensors(gguf_file: Path, config) -> tuple[str, Iterator[ConvertedTensor]]:
    """Each tensor the model reads, one at a time, so that a converter can write each away before the next is read
    (holding them all took 5.5 GB for Gemma 3 270M). A 2-D tensor's values are never kept: its groups are the
    blocks' own where they map (``gguf_blocks``), else made from its values as a load would make them, for the
    tensors our linear layers read; Q4_0, Q4_1 and Q8_0 blocks are not even dequantized (0.9 s of the default
    model's first start), nor are the tensors no linear layer reads. Returns the file's architecture too."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    architecture, tensors = tensor_table(gguf_file)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names, packed = _hf_names(architecture, config, {t.name for t in tensors})
    return architecture, _converted(gguf_file, tensors, processor, names, packed)


def _converted(
    gguf_file: Path, tensors: list[GgufTensor], processor, names: dict[str, str], packed: set[str]
) -> Iterator[ConvertedTensor]:
    started = time.monotonic()
    for index, tensor in enumerate(tensors):
        if tensor.name not in names:
            continue  # e.g. precomputed rope frequencies: our model computes them

        def reorder(t: torch.Tensor, name: str = tensor.name) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(processor.process(weights=t.numpy(), name=name).weights))

        name = names[tensor.name]
        if len(tensor.shape) != 2:
            yield ConvertedTensor(name, values=reorder(tensor.values()))
            continue
        groups, exact = None, False
        if _moves_rows_only(processor, tensor) and (name in packed or tensor.ggml_type in BYTE_TYPES):
            groups, exact = _groups(tensor)
        if groups is not None:
            groups = type(groups)(*(None if t is None else reorder(t) for t in group_tensors(groups)))
        yield ConvertedTensor(name, groups=groups, place=None if exact else tensor.place)
        tensor.let_go()
        if time.monotonic() - started > 2 and index % 50 == 0:
            log.info("GGUF %s: %d of %d tensors read", gguf_file.name, index, len(tensors))


def _moves_rows_only(processor, tensor: GgufTensor) -> bool:
    """Whether transformers' processor of the architecture at most permutes this 2-D tensor's rows (llama.cpp's
    query and key permutation, undone): then the groups of its blocks, which are rows of the file, move with
    them. Found by processing a column of row numbers: GPT-2's processor transposes its Conv1D weights, and
    their groups would be garbage."""
    rows = np.arange(tensor.shape[0], dtype=np.float32)[:, None]
    moved = processor.process(weights=rows, name=tensor.name).weights
    return moved.shape == rows.shape and np.array_equal(np.sort(moved, axis=0), rows)


def _groups(tensor: GgufTensor) -> tuple[WeightGroups, bool]:
    """A 2-D tensor's groups in the file's row order, and whether they give its values bit for bit: known from the
    blocks for Q4_0, Q4_1 and Q8_0, which are then not dequantized at all; compared for the types whose codes come
    from the values (Q5_0, Q5_1, IQ4_NL hold them; K-quants round their scales). A type whose blocks do not map
    gets 8-bit groups made from its values, as a load makes them for a layer (``packing``)."""
    raw = torch.from_numpy(tensor.raw.copy())
    if tensor.ggml_type in BYTE_TYPES:
        return groups_from_blocks(raw, tensor.ggml_type, lambda: None), True
    values = cache(tensor.values)  # not at all for Q4_K, whose codes come from its bits
    try:
        found = groups_from_blocks(raw, tensor.ggml_type, values)
    except ValueError as exc:
        raise ValueError(f"tensor {tensor.name} ({tensor.ggml_type.name}): {exc}") from exc
    if found is None:  # a chunk of rows at a time: a 1B model's Q6_K embedding is 400 MB of float32 values
        chunks = range(0, tensor.shape[0], VALUES_ROWS)
        return Int8Groups.cat([Int8Groups.from_weight(tensor.rows(r, r + VALUES_ROWS).values()) for r in chunks]), False
    return found, tensor.ggml_type not in ROUNDED_TYPES and dequantize_to(found, values())


def _hf_names(architecture: str, config, present: set[str]) -> tuple[dict[str, str], set[str]]:
    """GGUF tensor name -> the transformers name our model reads it by, for the tensors it reads; and the names its
    linear layers read (their groups are what the CPU kernels multiply).

    Our model, allocated and never written, loads from a mapping that translates each name it asks for through
    gguf-py's table for the architecture (as transformers' ``get_gguf_hf_weights_map`` does) and keeps it, while
    every torch call is inert. transformers' model class on the meta device gave the same names, but importing
    it took 1.3 s of a first start (dynamo, generation)."""
    import gguf

    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    asked = _NamesAsked(gguf.get_tensor_name_map(arch, config.num_hidden_layers), present)
    model = allocate_model(config, torch.device("cpu"), torch.bfloat16)  # memory never touched, so never taken
    with _Inert():
        model.load_hf_state_dict(asked)
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return asked.names, {part for name in linear for part in model.checkpoint_names(name)}


class _NamesAsked(Mapping):
    """A checkpoint of the GGUF's tensor names, by transformers' names: it keeps each name read, and reads as an
    empty tensor (``_Inert`` makes any use of it a no-op)."""

    def __init__(self, table, present: set[str]) -> None:
        self._table, self._present, self.names = table, present, {}
        self._empty = torch.empty(())

    def _gguf_name(self, name: str) -> str | None:
        base, _, suffix = name.rpartition(".")
        gguf_base = self._table.get_name(base)
        return None if gguf_base is None else f"{gguf_base}.{suffix}"

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._gguf_name(name) in self._present

    def __getitem__(self, name: str) -> torch.Tensor:
        gguf_name = self._gguf_name(name)
        if gguf_name not in self._present:
            raise KeyError(f"the file has no tensor for {name}")
        self.names[gguf_name] = name
        return self._empty

    def __iter__(self) -> Iterator[str]:
        return iter(self.names.values())

    def __len__(self) -> int:
        return len(self.names)


class _Inert(TorchFunctionMode):
    """Every torch call on a tensor returns that tensor (the first of a list) and does nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for arg in (*args, *(kwargs or {}).values()):
            if isinstance(arg, (list, tuple)) and arg:
                arg = arg[0]
            if isinstance(arg, torch.Tensor):
                return arg
        return func(*args, **(kwargs or {}))
