"""A GGUF file's header, its metadata and tensor table, read without torch.

The values are those transformers' fast reader gives (``transformers.integrations.gguf.reader``: an array of
strings by its length unless asked for, the tensor table's shapes in torch's order), but that module imports torch,
and a process that reads a config and a tokenizer needs nothing else of it (``text_files``): without torch,
transformers resolves a config's class in 0.74 s where with it, importing torch's distributed tensors, it took 2.1 s
(Intel Xeon, 2026-12-01). The tests compare the two readers on every file they have.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import struct
from collections.abc import Container
from pathlib import Path

VERSIONS = (2, 3)  # v1 counted tensors in 32 bits
STRING, ARRAY = 8, 9
# the fixed-size value types: u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64
LENGTH = struct.Struct("<Q")  # a string's
FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Cursor:
    """Little-endian reads from a position of the mapped file."""

    def __init__(self, blob: mmap.mmap) -> None:
        self.blob, self.pos = blob, 0

    def read(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.blob, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        return self.strings(1, decoded=True)[0]

    def value(self, kind: int, keep_strings: bool):
        if kind in FIXED:
            return self.read(FIXED[kind])[0]
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise ValueError(f"GGUF metadata holds a value of type {kind}, which this reader cannot read")
        element, count = self.read("IQ")
        if element in FIXED:
            return list(self.read(f"{count}{FIXED[element]}"))
        if element != STRING:
            raise ValueError(f"GGUF metadata holds an array of type {element}, which this reader cannot read")
        return self.strings(count, decoded=keep_strings)

    def strings(self, count: int, decoded: bool) -> list[str] | int:
        """``count`` strings one after another, or their count where not ``decoded`` (variable lengths: walked). One
        loop for all (Gemma 3's header, 262,144 tokens, in 0.08 s; string by string 0.13, Intel Xeon)."""
        blob, pos, length_at, strings = self.blob, self.pos, LENGTH.unpack_from, []
        for _ in range(count):
            start = pos + 8
            pos = start + length_at(blob, pos)[0]
            if decoded:
                strings.append(blob[start:pos].decode("utf-8"))
        self.pos = pos
        return strings if decoded else count


def read_header(gguf_file: Path, string_arrays: Container[str] = ()) -> tuple[dict, list, int]:
    """(metadata, the tensor table's ``(name, shape, ggml type, offset)`` entries, where the tensors' data starts);
    the arrays of strings named in ``string_arrays`` as lists, the others by their length."""
    if Path(gguf_file).stat().st_size < 4:
        raise ValueError(f"{gguf_file} is empty or too short to be a GGUF file")
    with open(gguf_file, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        if blob[:4] != b"GGUF":
            raise ValueError(f"{gguf_file} does not start with the GGUF magic bytes, so it is not a GGUF file")
        cursor = _Cursor(blob)
        cursor.pos = 4
        try:
            metadata, entries = _metadata_and_table(gguf_file, cursor, string_arrays)
        except struct.error:
            truncated = f"{gguf_file} is truncated: its header goes past the file's {len(blob):,} bytes"
            raise ValueError(truncated) from None
    alignment = metadata.get("general.alignment", 32)
    return metadata, entries, (cursor.pos + alignment - 1) // alignment * alignment


def _metadata_and_table(gguf_file: Path, cursor: _Cursor, string_arrays: Container[str]) -> tuple[dict, list]:
    version, tensor_count, metadata_count = cursor.read("IQQ")
    if version not in VERSIONS:
        raise ValueError(f"{gguf_file} is GGUF v{version}; this reader reads v2 and v3")
    metadata = {}
    for _ in range(metadata_count):
        key = cursor.string()
        (kind,) = cursor.read("I")
        metadata[key] = cursor.value(kind, key in string_arrays)
    if "general.architecture" not in metadata:
        raise ValueError(f"{gguf_file} has no general.architecture in its metadata")
    entries = []
    for _ in range(tensor_count):
        name = cursor.string()
        (dims,) = cursor.read("I")
        shape = tuple(reversed(cursor.read(f"{dims}Q")))  # ggml's fastest-moving dimension first, torch's last
        ggml_type, offset = cursor.read("IQ")
        entries.append((name, shape, ggml_type, offset))
    return metadata, entries


def file_header(gguf_file: Path) -> tuple[dict, list, int]:
    """``read_header``'s, no string array read: parsed once per file as it is now, for its digest, config, table and
    KV cache's size (Gemma 3 270M's header was parsed four times in a first start, 0.07 s each)."""
    stat = gguf_file.stat()
    return _parsed_header(str(gguf_file.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed_header(path: str, size: int, mtime_ns: int) -> tuple[dict, list, int]:
    return read_header(Path(path))


def header_digest(gguf_file: Path) -> str:
    """A digest of the file's place, size and header (its metadata and tensor table): what a converted copy is made
    of (config, tokenizer, where each tensor lies) and the file it reads every tensor from, at each load. A few MB
    hashed, where the whole file took 0.5 s at 1B and 1.5 s at 3B."""
    data_start = file_header(gguf_file)[2]
    place = f"{gguf_file.resolve()}\0{gguf_file.stat().st_size}\0".encode()
    with open(gguf_file, "rb") as file:
        return hashlib.sha256(place + file.read(data_start)).hexdigest()[:16]
