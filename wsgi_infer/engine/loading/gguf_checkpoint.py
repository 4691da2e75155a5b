"""A GGUF file's tensors under their Hugging Face names, as a converted copy keeps them.

Each tensor our model reads becomes its place in the file, for a load to read its
blocks or values there (``file_weights``), with what transformers' tensor processor
does to it (``row_orders``): no tensor is copied. (The config: ``gguf_config``.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ..models import allocate_model
from .gguf_file import GgufTensor, tensor_table
from .row_orders import RowOrders


@dataclass
class ConvertedTensor:
    """What a converted copy keeps of one tensor, under its Hugging Face name: the ``place`` in the file to read it
    from (``file_weights``), with the order transformers' processor puts a matrix's rows in (``order``: our row r is
    the file's ``order[r]``; None: the file's), or ``processed`` where the processor does more than move its rows
    (GPT-2 transposes its Conv1D weights; Gemma's norms are stored less one), with a vector's values as the file
    holds them and as the processor gave them (``kept``)."""

    name: str
    place: list
    order: np.ndarray | None = None
    processed: bool = False
    kept: tuple[np.ndarray, np.ndarray] | None = None


def gguf_tensors(gguf_file: Path, config, row_orders: RowOrders) -> tuple[str, Iterator[ConvertedTensor]]:
    """Each tensor the model reads, one at a time, so that a converter can write each away before the next is read.
    Returns the file's architecture too."""
    architecture, tensors = tensor_table(gguf_file)
    names = _hf_names(architecture, config, {t.name for t in tensors})
    return architecture, _converted(tensors, row_orders, names)


def _converted(tensors: list[GgufTensor], row_orders: RowOrders, names: dict[str, str]) -> Iterator[ConvertedTensor]:
    for tensor in tensors:
        if tensor.name not in names:
            continue  # e.g. precomputed rope frequencies: our model computes them
        first = tensor.rows(0, 1) if len(tensor.shape) == 2 else tensor  # a norm's, a bias's: small
        first.values()  # a type gguf-py cannot read is refused now, by name, not at a later load
        order, processed = row_orders.orders.get(tensor.name), tensor.name in row_orders.processed
        kept = row_orders.kept.get(tensor.name)
        yield ConvertedTensor(names[tensor.name], tensor.place, order=order, processed=processed, kept=kept)


def _hf_names(architecture: str, config, present: set[str]) -> dict[str, str]:
    """GGUF tensor name -> the transformers name our model reads it by, for the tensors it reads.

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
    return asked.names


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
