"""A checkpoint's tensors by name, read one at a time: from its safetensors files, or for a converted GGUF from its
packed groups (where they hold the values bit for bit) or the GGUF itself."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from .file_weights import FileEmbedding, FileWeights
from .model_paths import ModelLoadError
from .packed_groups_file import StoredGroups

MAPPED_BYTES = 64 << 20  # see CheckpointTensors.__getitem__


class CheckpointTensors(Mapping):
    """The checkpoint's tensors by name, read one at a time from its safetensors files; for a converted GGUF,
    dequantized from the packed groups where they hold a weight bit for bit, else read from the GGUF
    (``file_weights``).

    Our models copy (and fuse) weights from this mapping, so loading never holds
    more than our model plus one tensor, unlike instantiating the transformers
    model first.
    """

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        self._files = _checkpoint_files(model_dir)
        self._in_gguf = FileWeights(model_dir)
        self._groups = StoredGroups(model_dir)
        self._names = list(dict.fromkeys([*self._files, *self._in_gguf, *self._groups]))
        if not self._names:
            raise ModelLoadError(f"model {model_dir}: expected model.safetensors (or a sharded index) in the directory")
        self._dtype = dtype
        self._handles: dict[Path, safe_open] = {}  # one per file: opening one parses its header each time
        self._mapped: dict[Path, int] = {}  # bytes read through each handle's mapping

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._files.get(name)
        if path is None:
            weight = self._in_gguf[name] if name in self._in_gguf else self._groups[name].dequantize()
            return weight.to(self._dtype)
        if path not in self._handles:
            self._handles[path], self._mapped[path] = safe_open(path, framework="pt"), 0
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

    def only_as_groups(self, name: str) -> bool:
        """Whether the weight is read back from its packed groups, which hold it bit for bit."""
        return name not in self._files and name not in self._in_gguf and name in self._groups

    def __contains__(self, name: object) -> bool:
        return name in self._files or name in self._in_gguf or name in self._groups  # without reading the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Each tensor's safetensors file: a sharded index's map, or the one file's names (none: neither exists)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    if (model_dir / "model.safetensors").is_file():
        with safe_open(model_dir / "model.safetensors", framework="pt") as f:
            return dict.fromkeys(f.keys(), model_dir / "model.safetensors")
    return {}
