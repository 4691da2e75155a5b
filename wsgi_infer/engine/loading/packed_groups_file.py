"""The packed groups of a converted GGUF's weights, kept beside its checkpoint, and read back one weight at a time.

Its own module, so that loading a converted copy imports nothing of gguf-py (0.12 s).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import astuple
from pathlib import Path

from safetensors import safe_open

from ..kernels.weight_groups import Int4Groups, Int8Groups, WeightGroups

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
        # One handle for every read: opening the file parses its header, 2 ms a time, 0.5 s for every weight.
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
        return kind(*(self._file.get_tensor(k) if k in self._keys else None for k in keys))

    def __iter__(self) -> Iterator[str]:
        return iter(self._formats)

    def __len__(self) -> int:
        return len(self._formats)
