"""A token's text on its own, as logprobs show it.

A token may hold part of a character (byte-level BPE splits an emoji or a CJK character over two or three tokens;
SentencePiece falls back to byte tokens such as ``<0xF0>``): decoded alone it reads "\ufffd", and APIs give its
``bytes`` so that a client can put the character together again. Such a token's text carries its bytes as
surrogate escapes (PEP 383): ``piece.encode("utf-8", "surrogateescape")`` gives them back, whole.
"""

from __future__ import annotations

import re
from functools import cache

from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte-to-character table

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte stands as one printable character in a token's string."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_piece(tokenizer, token_id: int) -> str:
    """Token ``token_id``'s text alone; where that is part of a character, its bytes as surrogate escapes."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text
    raw = _raw_bytes(tokenizer, token_id)
    return text if raw is None else raw.decode("utf-8", "surrogateescape")


def piece_bytes(piece: str) -> bytes:
    """A piece's bytes: the token's own, also where it holds part of a character."""
    return piece.encode("utf-8", "surrogateescape")


def shown(piece: str) -> str:
    """A piece as text: part of a character reads "\ufffd", as the token decoded alone does."""
    return piece_bytes(piece).decode("utf-8", "replace")


def _raw_bytes(tokenizer, token_id: int) -> bytes | None:
    """The bytes a token stands for, where its tokenizer's format says (None: it does not)."""
    string = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(string, str):
        return None
    if found := _BYTE_TOKEN.fullmatch(string):
        return bytes([int(found.group(1), 16)])
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if isinstance(decoder, decoders.ByteLevel):
        alphabet = _byte_of_char()
        if all(char in alphabet for char in string):
            return bytes(alphabet[char] for char in string)
    return None
