"""A GGUF file's tokenizer, built as transformers builds it from the file, from metadata read faster, and its
``tokenizer.json`` in the form that tokenizers reads fastest.

transformers' ``get_gguf_tokenizer`` reads the vocabulary and merges through a numpy memmap, whose every string slice
costs a Python-level finalizer: 0.51 s for a 49,152-token vocabulary and its merges (1B shape, Zen 3). Read from a
plain mapping of the file (``gguf_header``), they take 0.15 s. The tokenizer is then what transformers makes of them
(``convert_gguf_tokenizer``, the backend class), so it stays the tokenizer transformers' GGUF loading gives: the tests
compare the two files for a BPE vocabulary (SmolLM2, ``test_model_loader``) and a SentencePiece one (Gemma 3,
``test_gemma3_270m``). ``tokenizer_metadata`` repeats ``get_gguf_tokenizer``'s few rules (that function takes a path
only); a rule transformers adds there shows in those comparisons only for the tokenizer types they hold.

transformers' converter asks the tokenizer's vocabulary whether it holds each token the file marks user-defined, and
the tokenizer copies its whole vocabulary into a Python dict to answer (0.23-0.34 s of Gemma 3's 262,144 tokens,
Zen 4): here the vocabulary answers by asking the tokenizer (``TokenLookup``), token by token.

A file that lists no merges (Gemma's SentencePiece vocabulary) has them recovered as transformers' ``generate_merges``
recovers them, faster (``vocabulary_merges``), which takes its place for this conversion only.

The merges are then written into the ``tokenizer.json`` here, not by tokenizers: the tokenizer is built without them
and they are handed over apart, since handing 514,906 pairs to tokenizers and reading them back out of its text took
0.65 s of a first start's 2.4 s of tokenizer work (Gemma 3, Intel Xeon). tokenizers reads a model through untagged
enums, so the whole model is first held as generic JSON values, and a BPE model's merges, written as pairs
(``["a","b"]``), are three values each: Gemma 3's 514,906 merges so took ``Tokenizer.from_file`` 1.4-2.0 s and 356 MB
at its peak, 193 MB of it left to the heap (Intel Xeon). Written as "a b" strings, the form tokenizers wrote before
0.20 and still reads, and without indentation, they take 1.1 s and 163 MB: the same tokenizer. That form cannot hold
a part with a space, so a tokenizer with one keeps its pairs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from unittest import mock

from .gguf_header import read_header
from .vocabulary_merges import MergeList, vocabulary_merges

STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")  # the only arrays of strings a tokenizer reads


def read_gguf_tokenizer(gguf_file: Path) -> tuple[object, list[tuple[str, ...]]]:
    """The ``TokenizersBackend`` that ``TokenizersBackend.from_pretrained(..., gguf_file=...)`` gives, but its BPE
    model built without merges, and the merges: ``tokenizer_json`` writes them into its ``tokenizer.json``."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_merges
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    architecture, tokenizer_dict, settings = tokenizer_metadata(gguf_file)
    found = []

    def merges_apart(*args, **kwargs) -> list:
        found.append(get_merges(*args, **kwargs))  # as they are: a ``MergeList`` writes its own JSON
        return []

    with (
        mock.patch.object(gguf_tokenizer_mapping, "generate_merges", vocabulary_merges),
        mock.patch.object(gguf_tokenizer_mapping, "get_merges", merges_apart),
        mock.patch.object(TokenizersBackend, "get_vocab", lambda tokenizer: TokenLookup(tokenizer.backend_tokenizer)),
    ):
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    # As transformers' own tokenizer classes do, the backend is in place before the base class's __init__: given as
    # ``tokenizer_object`` it would be deep-copied (a JSON round trip: 2.2 s for Gemma 3's 262,144 tokens).
    tokenizer = TokenizersBackend.__new__(TokenizersBackend)
    tokenizer._tokenizer = backend
    tokenizer.__init__(**settings, **extra)
    return tokenizer, found[0] if found else []


class TokenLookup(Mapping):
    """A ``tokenizers.Tokenizer``'s vocabulary, its added tokens included, as ``get_vocab(with_added_tokens=True)``
    gives it, but a token looked up in the tokenizer itself: the dict is made only where it is walked."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __getitem__(self, token: str) -> int:
        index = self.backend.token_to_id(token) if isinstance(token, str) else None
        if index is None:
            raise KeyError(token)
        return index

    def __contains__(self, token: object) -> bool:
        return isinstance(token, str) and self.backend.token_to_id(token) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.backend.get_vocab(with_added_tokens=True))

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def tokenizer_metadata(gguf_file: Path) -> tuple[str, dict, dict]:
    """``(architecture, tokenizer_dict, tokenizer_config)`` as transformers' ``get_gguf_tokenizer`` gives them."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import _SPECIAL_TOKENS, GGUF_TOKENIZER_MAPPING

    metadata = read_header(gguf_file, STRING_ARRAYS)[0]
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, settings = grouped["tokenizer"], grouped["tokenizer_config"]
    # transformers' two rules by tokenizer type: llama.cpp adds BOS to a sentencepiece vocabulary that does not say
    # otherwise; Gemma 4's chat template writes its own BOS.
    if tokenizer.get("tokenizer_type") == "llama":
        settings.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":
        settings["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        settings[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return metadata["general.architecture"], tokenizer, settings


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
    if isinstance(merges, MergeList):
        return merges.json()
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
