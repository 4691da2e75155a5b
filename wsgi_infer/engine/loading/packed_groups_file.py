"""The packed groups of a converted GGUF's weights, kept beside its checkpoint, and read back one weight at a time.

Its own module, so that loading a converted copy imports nothing of gguf-py (0.12 s).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import astuple
from pathlib import Path

from safetensors import safe_open

from ..kernels.weight_groups import Int4Groups, Int8Groups, WeightGroups

MAPPED_BYTES = 64 << 20  # see StoredGroups.__init__
PACKED_GROUPS_FILE = "packed_groups.safetensors"  # beside model.safetensors in a converted GGUF's directory
# The tensors of each format's fields, by suffix: ``{name}.q4`` and so on (an absent offset is no offset).
_SUFFIXES = {Int4Groups: ("q4", "q4_scale", "q4_zero"), Int8Groups: ("q8", "q8_scale", "q8_low")}


def save_packed_groups(groups: dict[str, WeightGroups], path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, g in groups.items():
        for suffix, t in zip(_SUFFIXES[type(g)], astuple(g)):
            if t is not None:
                tensors[f"{name}.{suffix}"] = t.contiguous()
    save_file(tensors, path)


class StoredGroups(Mapping):
    """What ``save_packed_groups`` wrote, read one weight at a time (empty if the file is absent)."""

    def __init__(self, path: Path) -> None:
        # One handle for many reads: opening the file parses its header, 2 ms a time, 0.5 s for every weight. But
        # the pages read stay in the process while it is mapped: a 1B model's 1.3 GB of groups counted twice
        # towards its peak (the copies packed for the kernels beside them), so it is let go every MAPPED_BYTES.
        self._path, self._mapped = path, 0
        self._file = safe_open(path, framework="pt") if path.is_file() else None
        self._keys = frozenset(self._file.keys() if self._file is not None else [])
        self._formats = {}
        for kind, (codes, *_) in _SUFFIXES.items():
            self._formats |= {k.removesuffix(f".{codes}"): kind for k in self._keys if k.endswith(f".{codes}")}

    def __contains__(self, name: object) -> bool:
        return name in self._formats  # without reading the weight (Mapping's default would)

    def format_of(self, name: str) -> type[WeightGroups] | None:
        """The format a weight's groups are kept in, without reading them."""
        return self._formats.get(name)

    def __getitem__(self, name: str) -> WeightGroups:
        kind = self._formats[name]
        keys = [f"{name}.{suffix}" for suffix in _SUFFIXES[kind]]
        if self._file is None:
            self._file = safe_open(self._path, framework="pt")
        groups = kind(*(self._file.get_tensor(k) if k in self._keys else None for k in keys))
        self._mapped += sum(t.nbytes for t in astuple(groups) if t is not None)
        if self._mapped > MAPPED_BYTES:
            self._file, self._mapped = None, 0
        return groups

    def __iter__(self) -> Iterator[str]:
        return iter(self._formats)

    def __len__(self) -> int:
        return len(self._formats)
