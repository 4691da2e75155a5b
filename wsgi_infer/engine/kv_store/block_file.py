"""A stored block's frame: a header naming what it is (format, namespace, key, length) and a checksum of its
payload, so a reader takes only whole blocks of its own model and settings. CRC-32 finds torn writes and flipped
bits at 3.5 GB/s here (blake2b: 0.8); what a block is for is the header's business, not the checksum's."""

from __future__ import annotations

import struct
import zlib

MAGIC = b"WIKV"
VERSION = 1
# magic, version, namespace, key, payload length, payload CRC-32; 80 bytes, so a payload starts 16-byte aligned
_HEADER = struct.Struct("<4sI32s16sQI12x")


class CorruptBlock(ValueError):
    """Not a whole block of this namespace and key."""


def frame(namespace: bytes, key: bytes, payload: memoryview) -> list[memoryview]:
    """The header and the payload, to be written in this order."""
    header = _HEADER.pack(MAGIC, VERSION, namespace, key, payload.nbytes, zlib.crc32(payload))
    return [memoryview(header), payload]


def unframe(namespace: bytes, key: bytes, data: bytes) -> memoryview:
    """The payload of ``data``, which must be this namespace's block ``key``, whole."""
    if len(data) < _HEADER.size:
        raise CorruptBlock("shorter than its header")
    magic, version, found_namespace, found_key, length, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock("not a block of this format")
    if found_namespace != namespace or found_key != key:
        raise CorruptBlock("a block of another model, setting or prefix")
    payload = memoryview(data)[_HEADER.size :]
    if payload.nbytes != length:
        raise CorruptBlock(f"{payload.nbytes} payload bytes, {length} expected")
    if zlib.crc32(payload) != crc:
        raise CorruptBlock("checksum mismatch")
    return payload
