"""A checkpoint's tensors by name, read one at a time: from its safetensors files, or for a converted GGUF from the
GGUF itself."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .file_weights import FileBlocks, FileEmbedding, FileWeights
from .model_paths import ModelLoadError

MAPPED_BYTES = 64 << 20  # see CheckpointTensors.__getitem__


class CheckpointTensors(Mapping):
    """The checkpoint's tensors by name, read one at a time from its safetensors files; for a converted GGUF, from the
    GGUF (``file_weights``).

    Our models copy (and fuse) weights from this mapping, so loading never holds
    more than our model plus one tensor, unlike instantiating the transformers
    model first.
    """

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        self._files = _checkpoint_files(model_dir)
        self._in_gguf = FileWeights(model_dir)
        self._names = list(dict.fromkeys([*self._files, *self._in_gguf]))
        if not self._names:
            raise ModelLoadError(f"model {model_dir}: expected model.safetensors (or a sharded index) in the directory")
        self._dtype = dtype
        self._handles: dict[Path, safe_open] = {}  # one per file: opening one parses its header each time
        self._mapped: dict[Path, int] = {}  # bytes read through each handle's mapping

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._files.get(name)
        if path is None:
            return self._in_gguf[name].to(self._dtype)
        if path not in self._handles:
            self._handles[path], self._mapped[path] = _opened(path), 0
        tensor = self._handles[path].get_tensor(name)
        self._mapped[path] += tensor.nbytes
        if self._mapped[path] > MAPPED_BYTES:
            # The pages read stay in this process's memory while the file is mapped: a float32 checkpoint's
            # 538 MB counted towards the worker's peak (1.29 GB). Reopening costs a header's parse, 2 ms.
            del self._handles[path]
        return tensor.to(self._dtype)

    def embedding_in_file(self, name: str) -> FileEmbedding | None:
        """Lookups of the table ``name`` from the GGUF's own rows, where the table is read from the file."""
        return None if name in self._files else self._in_gguf.embedding(name)

    def blocks(self, name: str) -> FileBlocks | None:
        """A weight's blocks in the GGUF, where it is read from one (``FileWeights.blocks``)."""
        return None if name in self._files else self._in_gguf.blocks(name)

    def __contains__(self, name: object) -> bool:
        return name in self._files or name in self._in_gguf  # without reading the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def require_weights(model_dir: Path) -> None:
    """Raise where the directory holds no weights, before a model of its config is allocated: a config alone may
    describe a 7B model, whose float32 parameters would take 27 GB before the load found nothing to read."""
    CheckpointTensors(model_dir, torch.float32)


def _checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Each tensor's safetensors file: a sharded index's map, or the one file's names (none: neither exists)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    if (model_dir / "model.safetensors").is_file():
        with _opened(model_dir / "model.safetensors") as f:
            return dict.fromkeys(f.keys(), model_dir / "model.safetensors")
    return {}


def _opened(path: Path) -> safe_open:
    """The safetensors file, opened; a truncated or corrupt one is a ModelLoadError naming it (safetensors' own
    error named no file)."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as exc:
        raise ModelLoadError(f"model file {path}: {exc}") from None
