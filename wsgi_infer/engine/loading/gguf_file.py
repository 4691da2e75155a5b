"""A GGUF file's tensors, mapped and read one at a time: the table of a file, and a tensor's values as gguf-py
dequantizes them.

The conversion reads the table (``tensor_table``); a later load reads the tensors a converted copy does not keep from
the file itself, at the places the conversion recorded (``file_weights``), without parsing its metadata again. The
table and ``array`` need no torch: the process that reads a first start's text files ahead finds the tensors' row
orders with them (``row_orders``).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .gguf_header import file_header
from .model_paths import ModelLoadError

if TYPE_CHECKING:
    import torch

DEQUANTIZED_ROWS = 1024  # a few MB of gguf-py's temporaries at a time
LARGEST_FOLIO = 2 << 20  # the most the page cache holds of a file in one folio (a huge page, on x86)


@dataclass
class GgufTensor:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # in torch's order
    raw: np.ndarray  # its bytes in the mapped file, [rows, bytes per row]
    start: int = 0  # where they begin in the file

    def values(self) -> torch.Tensor:
        """float32 values in torch's shape; ValueError naming a type gguf-py cannot read (``array``)."""
        import torch

        if self.ggml_type == GGMLQuantizationType.Q6_K:
            raw = torch.from_numpy(self.raw.copy())  # writable, as torch wants: a fifth of the values' size
            return _q6_k_values(raw).reshape(self.shape)
        # F32 comes back as a view of the read-only mapping: a copy of its own (torch warns of a shared one)
        return torch.from_numpy(np.require(self.array(), np.float32, "W")).reshape(self.shape)

    def array(self) -> np.ndarray:
        """float32 values as gguf-py dequantizes them, [rows, values a row]; ValueError naming a type it cannot
        read.

        gguf-py's own dequantization of its type's rows, ``DEQUANTIZED_ROWS`` at a time: its ``dequantize`` calls
        that for 16 rows at a time, and took twice as long (0.83 s against 0.43 s for the default model's tensors,
        1.63 s against 0.69 s for Gemma 3 270M's), for the same bits."""
        from gguf import quants

        kind = getattr(quants, self.ggml_type.name, None)  # gguf-py's class for the type, where it has one
        try:
            if kind is None or not hasattr(kind, "dequantize_rows"):  # F32 and F16: a view, a cast
                return quants.dequantize(self.raw, self.ggml_type)
            kind.init_grid()  # the IQ types' tables
            # into one array, chunk by chunk: a list of the chunks, then their concatenation, took twice the
            # values' size (a 1B model's embedding: 800 MB)
            values = np.empty((self.raw.shape[0], int(np.prod(self.shape)) // self.raw.shape[0]), np.float32)
            for r in range(0, self.raw.shape[0], DEQUANTIZED_ROWS):
                values[r : r + DEQUANTIZED_ROWS] = kind.dequantize_rows(self.raw[r : r + DEQUANTIZED_ROWS])
            return values
        except NotImplementedError:
            raise ValueError(
                f"tensor {self.name}: ggml type {self.ggml_type.name} ({int(self.ggml_type)}) cannot be read "
                "(gguf-py does not dequantize it)"
            ) from None

    def rows(self, start: int, stop: int) -> GgufTensor:
        """Rows ``start`` to ``stop`` of a 2-D tensor."""
        raw = self.raw[start:stop]
        return GgufTensor(
            self.name, self.ggml_type, (raw.shape[0], self.shape[1]), raw, self.start + start * raw.shape[1]
        )

    def let_go(self) -> None:
        """Drop its pages from this process (they stay in the page cache): a load reads every tensor once, and the
        mapped file's pages read would all count towards its peak (a 1B model's 640 MB). The range goes out to whole
        folios: the page cache holds a file in folios of up to 2 MB (ext4 on Linux 6.18), and a fault maps all of
        one, so reading a tensor maps its neighbours' pages too, and a range dropped exactly kept those of the ones
        read before (a Gemma 3 270M load held 53 of the file's 253 MB at its end). A neighbour's pages dropped with
        it are only mapped again from the page cache, if it is read."""
        mapping = self.raw.base
        while mapping is not None and not isinstance(mapping, mmap.mmap):  # the mapping the raw bytes are a view of
            mapping = getattr(mapping, "base", None)
        if mapping is not None and self.raw.nbytes:
            first = self.start // LARGEST_FOLIO * LARGEST_FOLIO
            end = min(len(mapping), -(-(self.start + self.raw.nbytes) // LARGEST_FOLIO) * LARGEST_FOLIO)
            mapping.madvise(mmap.MADV_DONTNEED, first, end - first)

    @property
    def place(self) -> list:
        """What ``mapped_tensor`` needs to find it again: JSON-able."""
        return [self.name, int(self.ggml_type), list(self.shape), self.start]


def _q6_k_values(raw: torch.Tensor) -> torch.Tensor:
    """gguf-py's Q6_K dequantization in torch's ops, bit for bit (``(d * scale) * q`` in float32), on both cores: the
    K-quant that most files keep some tensors in (a Q4_K_M's LM head and half its down projections), whose values a
    conversion makes 8-bit groups from (a 1B model's: 2.0 s in gguf-py's numpy, 0.5 s here). A block: 128 bytes of
    low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 values), float16 d."""
    import torch

    blocks = raw.reshape(-1, 210)
    n = blocks.shape[0]
    scale = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()
    d = (d * scale).reshape(n, 16, 1)
    low = blocks[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    q = ((low & 15).reshape(n, 8, 32) | ((high & 3).reshape(n, 8, 32) << 4)).view(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(raw.shape[0], -1)


def mapped_tensor(blob: np.ndarray, place: list) -> GgufTensor:
    """A tensor of the mapped file ``blob`` at a ``place`` that ``GgufTensor.place`` gave."""
    name, type_id, shape, start = place
    ggml_type = GGMLQuantizationType(type_id)
    return _at(blob, name, ggml_type, tuple(shape), start)


def _at(blob: np.ndarray, name: str, ggml_type: GGMLQuantizationType, shape: tuple[int, ...], start: int) -> GgufTensor:
    block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
    row_bytes = shape[-1] // block_weights * block_bytes
    rows = int(np.prod(shape[:-1]))
    if start + rows * row_bytes > len(blob):  # a copy cut short: say so, not what reshaping it raised
        raise ModelLoadError(
            f"the file is truncated: tensor {name} ends at byte {start + rows * row_bytes:,} of {len(blob):,}"
        )
    # A plain array over the mapping: gguf-py slices it per row group, and a memmap's every slice costs a
    # Python-level finalizer (0.5 s of a 6 s conversion).
    raw = np.asarray(blob[start : start + rows * row_bytes]).reshape(rows, row_bytes)
    return GgufTensor(name, ggml_type, shape, raw, start)


def mapped_file(gguf_file: Path) -> np.ndarray:
    """The file as bytes, mapped: pages are read only where a tensor's are."""
    return np.memmap(gguf_file, mode="r", dtype=np.uint8)


def tensor_table(gguf_file: Path) -> tuple[str, list[GgufTensor]]:
    """The file's architecture and tensors, mapped, not read. Parsed with transformers' fast GGUF reader, which
    walks past the vocabulary's strings: gguf-py's ``GGUFReader`` builds a field for each (3.3 s per file), and the
    tensor table's byte counts come from gguf-py's sizes of every type, where transformers' cover fewer."""
    blob = mapped_file(gguf_file)
    metadata, entries, data_start = file_header(gguf_file)
    tensors = []
    for name, shape, type_id, offset in entries:
        try:
            ggml_type = GGMLQuantizationType(type_id)
            GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name}: ggml type {type_id} is unknown to gguf-py") from None
        tensors.append(_at(blob, name, ggml_type, shape, data_start + offset))
    return metadata["general.architecture"], tensors
