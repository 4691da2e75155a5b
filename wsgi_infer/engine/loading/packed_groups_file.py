"""The packed groups of a converted GGUF's weights, kept beside its checkpoint in shards, and read back one weight at
a time.

Its own module, so that loading a converted copy imports nothing of gguf-py (0.12 s).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from ..kernels.weight_groups import Int4Groups, Int8Groups, WeightGroups, group_tensors
from ..runtime.heap import release_free_heap

MAPPED_BYTES = 64 << 20  # see StoredGroups.__init__
SHARD_BYTES = 64 << 20  # see GroupsWriter
SHARDS = "packed_groups-*.safetensors"  # in a converted GGUF's directory, beside model.safetensors
# The tensors of each format's fields, by suffix: ``{name}.q4`` and so on (an absent offset is no offset). Scales and
# lows are float16 values (``weight_groups``), kept as float16: 2 bytes a group, not 4 (a 1B Q4_K_M's copy 888 -> 760
# MB).
_SUFFIXES = {Int4Groups: ("q4", "q4_scale", "q4_low"), Int8Groups: ("q8", "q8_scale", "q8_low")}


class GroupsWriter:
    """``add`` each weight's groups as the conversion makes them, then ``close`` (or leave the ``with`` block): written
    in shards of ``SHARD_BYTES``, so a conversion never holds them all (a 1B model's 888 MB, beside the tensor it
    works on, took its first start's peak RSS to 2.65 GB)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards = 0

    def add(self, name: str, groups: WeightGroups) -> None:
        codes, *halves = group_tensors(groups)
        for suffix, t in zip(_SUFFIXES[type(groups)], [codes] + [h if h is None else h.half() for h in halves]):
            if t is not None:
                self._pending[f"{name}.{suffix}"] = t.contiguous()
                self._pending_bytes += t.nbytes
        if self._pending_bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self._pending:
            self._shards += 1
            save_file(self._pending, self._directory / SHARDS.replace("*", f"{self._shards:05d}"))
            self._pending, self._pending_bytes = {}, 0
            release_free_heap()  # the shard's groups, freed: else the heap keeps them (a 1B model's peak +600 MB)

    def close(self) -> None:
        self._flush()

    def __enter__(self) -> GroupsWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()


def has_stored_groups(directory: Path) -> bool:
    return any(directory.glob(SHARDS))


class StoredGroups(Mapping):
    """What ``GroupsWriter`` wrote in ``directory``, read one weight at a time (empty where it wrote nothing)."""

    def __init__(self, directory: Path) -> None:
        # One handle for many reads: opening a shard parses its header, 2 ms a time, 0.5 s for every weight. But
        # the pages read stay in the process while it is mapped: a 1B model's 1.3 GB of groups counted twice
        # towards its peak (the copies packed for the kernels beside them), so it is let go every MAPPED_BYTES.
        self._shard_of: dict[str, Path] = {}
        for shard in sorted(directory.glob(SHARDS)):
            with safe_open(shard, framework="pt") as f:
                self._shard_of |= dict.fromkeys(f.keys(), shard)
        self._formats = {}
        for kind, (codes, *_) in _SUFFIXES.items():
            self._formats |= {k.removesuffix(f".{codes}"): kind for k in self._shard_of if k.endswith(f".{codes}")}
        self._open: tuple[Path, object] | None = None
        self._mapped = 0

    def format_of(self, name: str) -> type[WeightGroups] | None:
        """The format a weight's groups are kept in, without reading them."""
        return self._formats.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._formats  # without reading the weight (Mapping's default would)

    def __getitem__(self, name: str) -> WeightGroups:
        kind = self._formats[name]
        keys = [f"{name}.{suffix}" for suffix in _SUFFIXES[kind]]
        read = [self._read(k) if k in self._shard_of else None for k in keys]
        groups = kind(read[0], *(h if h is None else h.float() for h in read[1:]))
        self._mapped += sum(t.nbytes for t in read if t is not None)
        if self._mapped > MAPPED_BYTES:
            self._open, self._mapped = None, 0
        return groups

    def _read(self, key: str) -> torch.Tensor:
        shard = self._shard_of[key]
        if self._open is None or self._open[0] != shard:
            self._open = (shard, safe_open(shard, framework="pt"))
        return self._open[1].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._formats)

    def __len__(self) -> int:
        return len(self._formats)
