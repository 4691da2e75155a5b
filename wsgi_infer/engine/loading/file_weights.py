"""A converted GGUF's tensors, read from the GGUF itself: their blocks, or their values.

A converted copy keeps no tensor: a weight's values in full (float32, 8 times a 4-bit file: 4.6 GB for a 1B model's
Q4_K_M) would be a second copy of the file, and the CPU kernels read the file's own blocks. So each tensor is read
from the file, mapped, at the place the conversion recorded here: its blocks as they are (``FileBlocks``), or its
values (norms, the embedding's table, a GPU, ``quantization none``, a type the kernels do not read), dequantized by
gguf-py; either way in our row order, as transformers' processor for the architecture reorders them. The conversion
records that order (``ROW_ORDERS_FILE``), and of a vector the processor changes (Gemma's norms) its values as the file
held them and as the processor gave them: so a later load needs transformers' GGUF module only for a matrix the
processor does more than reorder (GPT-2's Conv1D weights), or a vector whose values in the file changed since.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..runtime.cache_files import read_json, write_json
from ..runtime.native_threads import import_for_thread
from .model_paths import ModelLoadError
from .row_orders import kept_arrays, kept_values

if TYPE_CHECKING:  # gguf_file imports gguf, which a load imports only when it reads a file
    from .gguf_file import GgufTensor

FILE_WEIGHTS_FILE = "gguf_weights.json"  # in a converted copy: the file, and where each tensor lies in it
ROW_ORDERS_FILE = "row_orders.npz"  # beside it: our row order of each weight whose rows the processor moves, and kept
PROCESSOR_IMPORTS = ("transformers.modeling_gguf_pytorch_utils",)  # transformers' processors: 0.3 s, its model index


def save_file_weights(
    directory: Path,
    gguf: Path,
    architecture: str,
    config: dict,
    places: dict[str, list],
    orders: dict[str, np.ndarray],
    processed: list[str],
    kept: dict[str, tuple[np.ndarray, np.ndarray]],
) -> None:
    """``places``: each weight's Hugging Face name -> ``GgufTensor.place``; ``orders``: the weights whose rows move,
    -> their order; ``processed``: those the processor changes otherwise (their values are read through it, or
    ``kept``: a vector's values, the file's and the processor's)."""
    record = {"gguf": str(gguf.resolve()), "architecture": architecture, "config": config, "weights": places}
    write_json(directory / FILE_WEIGHTS_FILE, record | {"processed": processed})
    np.savez(directory / ROW_ORDERS_FILE, **orders, **kept_arrays(kept))


def copied_gguf(model_dir: Path) -> Path | None:
    """The GGUF a converted copy reads its weights from; None for any other directory."""
    gguf = (read_json(model_dir / FILE_WEIGHTS_FILE) or {}).get("gguf")
    return None if gguf is None else Path(gguf)


def orphaned_copies(root: Path) -> list[Path]:
    """The converted copies under ``root`` whose GGUF is gone: a copy is named by its file's place, so a file
    deleted (or one in a temporary directory) leaves its copy for nothing to read again."""
    orphans = []
    for record_file in root.glob(f"*/{FILE_WEIGHTS_FILE}"):
        record = read_json(record_file)
        if record is not None and not os.path.exists(record.get("gguf", "")):
            orphans.append(record_file.parent)
    return orphans


@dataclass
class FileBlocks:
    """A 2-D weight's blocks in the mapped file (a ``gguf_file.GgufTensor``), in our row order: ``rows(a, b)`` gives
    rows [a, b) as uint8 [b - a, bytes a row] (our row r being the file's ``order[r]``, where its rows move)."""

    tensor: GgufTensor
    order: np.ndarray | None
    _given: tuple[int, int] | None = field(default=None, init=False)  # rows the last ``rows`` call viewed

    @property
    def ggml_type(self) -> int:
        return self.tensor.ggml_type

    @property
    def shape(self) -> tuple[int, int]:
        return self.tensor.shape

    @property
    def raw(self) -> np.ndarray:
        return self.tensor.raw

    def rows(self, start: int, stop: int) -> np.ndarray | torch.Tensor:
        """A view of the mapping where the rows stay in order (a copy where they move). Rows are asked for in turn,
        each laid out before the next are asked for (``packed_part``): so the pages of those viewed before leave this
        process now, and a large weight's pages leave as it is read, not once it is packed."""
        if self._given is not None:
            self.tensor.rows(*self._given).let_go()
        if self.order is not None:
            return torch.from_numpy(self.raw[self.order[start:stop]])
        self._given = (start, stop)
        return self.raw[start:stop]  # read-only: the kernels read it where it lies (a copy took 0.8 s of a 3B load)

    def let_go(self) -> None:
        """Its pages out of this process, once it is packed (``GgufTensor.let_go``)."""
        self.tensor.let_go()
        self._given = None


class FileWeights(Mapping):
    """A converted copy's tensors, which its GGUF holds, by Hugging Face name, as float32 values (empty for a Hugging
    Face directory). Nothing is mapped or imported until a value is read."""

    def __init__(self, directory: Path) -> None:
        self._record = read_json(directory / FILE_WEIGHTS_FILE) or {"weights": {}}
        self._orders_file = directory / ROW_ORDERS_FILE
        self._orders: dict[str, np.ndarray] | None = None  # read at the first weight asked for
        self._kept: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # with them: the processed vectors' values
        self._blob: np.ndarray | None = None
        self._processor = None

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensor(name)
        try:
            values = tensor.values().numpy()
        except ValueError as exc:  # a type gguf-py cannot read (a conversion refuses it first)
            raise ModelLoadError(f"model {self._record['gguf']}: {exc}") from None
        finally:
            tensor.let_go()  # read: its pages need not stay in this process
        if name in self.processed:
            return torch.from_numpy(np.ascontiguousarray(self._processed(values, name, tensor.name)))
        order = self._order(name)
        return torch.from_numpy(values if order is None else values[order])

    def blocks(self, name: str) -> FileBlocks | None:
        """A 2-D weight's blocks as the file holds them, in our row order (llama.cpp's permutation of the query and
        key rows, undone); None where it is not in the file, or not a matrix of rows (GPT-2's Conv1D weights, which
        the processor transposes)."""
        if name not in self or name in self.processed:
            return None
        tensor = self._tensor(name)
        if len(tensor.shape) != 2:
            return None
        return FileBlocks(tensor, self._order(name))

    def embedding(self, name: str) -> FileEmbedding | None:
        """Token embeddings read from the file's own rows at each lookup, where ``name`` is read from the file and
        kept in the file's row order: no table of the values is held (a 1B model's 49,152 x 2,048 is 400 MB in
        float32, Llama 3.2 3B's 1.6 GB; llama.cpp reads its rows from the file's blocks too)."""
        if self.blocks(name) is None or self._order(name) is not None:
            return None  # not there, or its rows are not the file's
        return FileEmbedding(self._tensor(name))

    @property
    def processed(self) -> list[str]:
        """The weights read through transformers' processor."""
        return self._record.get("processed", [])

    @property
    def needs_processor(self) -> bool:
        """Whether a load of these weights runs transformers' processor: a processed weight's values are not kept
        (those kept are taken while the file holds the same values)."""
        return any(name not in self._kept_values() for name in self.processed)

    def _order(self, name: str) -> np.ndarray | None:
        return self._saved().get(name)

    def _saved(self) -> dict[str, np.ndarray]:
        """The arrays saved beside the record: row orders, kept values."""
        if self._orders is None:  # once: opening the archive for each weight was 40% of a 135M model's load
            self._orders = {}
            if self._orders_file.is_file():
                with np.load(self._orders_file) as orders:
                    self._orders = {key: orders[key] for key in orders.files}
            self._kept = kept_values(self._orders)
        return self._orders

    def _kept_values(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        self._saved()
        return self._kept

    def _processed(self, values: np.ndarray, name: str, gguf_name: str) -> np.ndarray:
        """The processor's output for a weight's values: kept, where the file still holds the values kept with it."""
        kept = self._kept_values().get(name)
        if kept is not None and np.array_equal(kept[0], values):
            return kept[1]
        return self._reorder(values, gguf_name)

    def _tensor(self, name: str):
        from .gguf_file import mapped_file, mapped_tensor

        if self._blob is None:
            path = Path(self._record["gguf"])
            if not os.path.isfile(path):
                raise ModelLoadError(f"{path}: the GGUF this model was converted from is gone (its weights are read)")
            self._blob = mapped_file(path)
        return mapped_tensor(self._blob, self._record["weights"][name])

    def _reorder(self, values: np.ndarray, gguf_name: str) -> np.ndarray:
        """transformers' processor of the architecture, as the conversion applied it (llama.cpp's permutation of
        the query and key rows, undone)."""
        if self._processor is None:
            import_for_thread(PROCESSOR_IMPORTS)  # where the load did not expect it: a kept vector's file changed
            from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

            kind = TENSOR_PROCESSORS.get(self._record["architecture"], TensorProcessor)
            self._processor = kind(config=self._record["config"])
        return self._processor.process(weights=values, name=gguf_name).weights

    def __contains__(self, name: object) -> bool:
        return name in self._record["weights"]

    def __iter__(self) -> Iterator[str]:
        return iter(self._record["weights"])

    def __len__(self) -> int:
        return len(self._record["weights"])


class FileEmbedding(nn.Module):
    """``nn.Embedding``'s lookup from a GGUF tensor's rows, each dequantized by gguf-py when it is looked up: the
    same values the table held (a step's rows cost a few milliseconds, its prefill's tokens at most)."""

    def __init__(self, tensor) -> None:
        super().__init__()
        self.tensor = tensor  # a gguf_file.GgufTensor over the mapped file

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from .gguf_file import GgufTensor

        flat = ids.reshape(-1).cpu().numpy()
        rows = GgufTensor(
            self.tensor.name, self.tensor.ggml_type, (len(flat), self.tensor.shape[1]), self.tensor.raw[flat]
        )
        return rows.values().reshape(*ids.shape, -1)
