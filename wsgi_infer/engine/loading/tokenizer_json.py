"""A converted tokenizer's ``tokenizer.json``, in the form that tokenizers reads fastest, with the least memory.

tokenizers reads a model through untagged enums, so the whole model is first held as generic JSON values, and a BPE
model's merges, written as pairs (``["a","b"]``), are three values each. Gemma 3's 514,906 merges so took
``Tokenizer.from_file`` 1.4-2.0 s and 356 MB at its peak, 193 MB of it left to the heap (Intel Xeon). Written as "a b"
strings, the form tokenizers wrote before 0.20 and still reads, and without indentation, they take 1.1 s and 163 MB:
the same tokenizer. That form cannot hold a part with a space, so a tokenizer with one keeps its pairs.

The merges are written here, not by tokenizers: the conversion builds its tokenizer without them and hands them over
apart (``gguf_tokenizer``), since handing 514,906 pairs to tokenizers and reading them back out of its text took 0.65 s
of a first start's 2.4 s of tokenizer work (Gemma 3, Intel Xeon).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

NO_MERGES = '"merges":[]}}'  # how Tokenizer.to_str ends a BPE model built without merges


def tokenizer_json(backend, merges: Sequence[tuple[str, ...]]) -> str:
    """``backend``'s (a ``tokenizers.Tokenizer``) compact text with ``merges`` in its BPE model, which has none: as
    "a b" strings, or as pairs where a part has a space."""
    text = backend.to_str()
    if not merges:
        return text
    if not text.endswith(NO_MERGES):
        raise ValueError("the tokenizer's model is not a BPE model without merges, so the merges have no place in it")
    return f'{text[: -len(NO_MERGES)]}"merges":{_listed(merges)}}}}}'


def _listed(merges: Sequence[tuple[str, ...]]) -> str:
    """The merges as a JSON list of "a b" strings, or of pairs where a part has a space (or a merge is no pair)."""
    joined = list(map(" ".join, merges))
    if set(map(len, merges)) == {2} and "".join(joined).count(" ") == len(joined):  # no space in a part
        return json.dumps(joined, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(merges, ensure_ascii=False, separators=(",", ":"))


def tokenizer_json_saver(merges: Sequence[tuple[str, ...]]) -> Callable[..., tuple[str, ...]]:
    """transformers' ``TokenizersBackend._save_pretrained`` (which writes the backend's ``tokenizer.json``, indented,
    its merges as pairs), writing ``tokenizer_json`` instead: a conversion saves its tokenizer with this in its
    place."""

    def save(tokenizer, save_directory: str | os.PathLike, file_names, legacy_format=None, filename_prefix=None):
        path = Path(save_directory, f"{filename_prefix}-tokenizer.json" if filename_prefix else "tokenizer.json")
        path.write_text(tokenizer_json(tokenizer.backend_tokenizer, merges), encoding="utf-8")
        return (*file_names, str(path))

    return save
