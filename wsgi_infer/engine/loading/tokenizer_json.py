"""A converted tokenizer's ``tokenizer.json`` in the form that tokenizers reads fastest, with the least memory.

tokenizers reads a model through untagged enums, so the whole model is first held as generic JSON values, and a BPE
model's merges, written as pairs (``["a","b"]``), are three values each. Gemma 3's 514,906 merges so took
``Tokenizer.from_file`` 1.4-2.0 s and 356 MB at its peak, 193 MB of it left to the heap (Intel Xeon). Written as "a b"
strings, the form tokenizers wrote before 0.20 and still reads, and without indentation, they take 1.1 s and 163 MB:
the same tokenizer (``Tokenizer.to_str`` gives the same text for both). That form cannot hold a part with a space,
so a tokenizer with one keeps its pairs.
"""

from __future__ import annotations

import os
from pathlib import Path

MERGES = b'"merges":'


def save_tokenizer_json(
    tokenizer, save_directory: str | os.PathLike, file_names: tuple[str, ...], legacy_format=None, filename_prefix=None
) -> tuple[str, ...]:
    """transformers' ``TokenizersBackend._save_pretrained`` (which writes the backend's ``tokenizer.json``, indented,
    its merges as pairs), writing it in this form instead: a conversion saves its tokenizer with this in its place."""
    path = Path(save_directory, f"{filename_prefix}-tokenizer.json" if filename_prefix else "tokenizer.json")
    path.write_bytes(merges_as_strings(tokenizer.backend_tokenizer.to_str().encode()))
    return (*file_names, str(path))


def merges_as_strings(text: bytes) -> bytes:
    """``text``, a tokenizer as ``Tokenizer.to_str`` writes it (compact, a BPE model's merges last), with the merges
    as "a b" strings; ``text`` itself where a part of a merge has a space, or where it holds no list of pairs."""
    start = text.rfind(MERGES) + len(MERGES)
    if start < len(MERGES) or not text.endswith(b"}}") or b" " in text[start:]:  # JSON escapes no space
        return text
    # Backslashes and quotes within the strings as \u escapes (the same strings): every quote left is the list's, so
    # that the pieces between quotes are its punctuation and its strings in turn: [[ a , b ],[ a , b ... ]]
    pieces = text[start:-2].replace(b"\\\\", b"\\u005c").replace(b'\\"', b"\\u0022").split(b'"')
    punctuation = pieces[0::2]
    within, between = punctuation[1::2], punctuation[2:-1:2]  # a pair's comma, the list's
    if len(pieces) < 5 or len(pieces) % 4 != 1 or (punctuation[0], punctuation[-1]) != (b"[[", b"]]"):
        return text
    if within.count(b",") != len(within) or between.count(b"],[") != len(between):
        return text
    joined = b'","'.join(map(b" ".join, zip(pieces[1::4], pieces[3::4])))
    return b'%s["%s"]%s' % (text[:start], joined, text[-2:])
