"""A checkpoint written a shard at a time, in Hugging Face's sharded safetensors layout.

A GGUF's conversion dequantizes tensor after tensor; holding them all for one ``save_file`` made its peak memory
four times the float32 model (Gemma 3 270M: 5.5 GB). Shards of ``SHARD_BYTES`` and the index that
``CheckpointTensors`` (and transformers) read keep it near one shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 256 << 20
INDEX_FILE = "model.safetensors.index.json"


class ShardedCheckpoint:
    """``add`` tensors, then ``close`` (or leave the ``with`` block): the last shard and the index are written."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._weight_map: dict[str, str] = {}
        self._shards = 0
        self._total_bytes = 0  # the index's total_size: the tensors' bytes

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += tensor.nbytes
        self._total_bytes += tensor.nbytes
        if self._pending_bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        self._shards += 1
        file = f"model-{self._shards:05d}.safetensors"
        save_file(self._pending, self._directory / file, metadata={"format": "pt"})
        self._weight_map.update(dict.fromkeys(self._pending, file))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(self._weight_map.items()))}
        (self._directory / INDEX_FILE).write_text(json.dumps(index, indent=1))

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
