"""A GGUF file's tokenizer, built as transformers builds it from the file, from metadata read faster.

transformers' ``get_gguf_tokenizer`` reads the vocabulary and merges through a numpy memmap, whose every string slice
costs a Python-level finalizer: 0.51 s for a 49,152-token vocabulary and its merges (1B shape, Zen 3). Read from a
plain mapping of the file (``gguf_header``), they take 0.15 s. The tokenizer is then what transformers makes of them
(``convert_gguf_tokenizer``, the backend class), so it stays the tokenizer transformers' GGUF loading gives: the tests
compare the two files for a BPE vocabulary (SmolLM2, ``test_model_loader``) and a SentencePiece one (Gemma 3,
``test_gemma3_270m``). ``tokenizer_metadata`` repeats ``get_gguf_tokenizer``'s few rules (that function takes a path
only); a rule transformers adds there shows in those comparisons only for the tokenizer types they hold.

A file that lists no merges (Gemma's SentencePiece vocabulary) has them recovered as transformers' ``generate_merges``
recovers them, faster (``vocabulary_merges``), which takes its place for this conversion only.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

from .gguf_header import read_header
from .vocabulary_merges import vocabulary_merges

STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")  # the only arrays of strings a tokenizer reads


def read_gguf_tokenizer(gguf_file: Path) -> tuple[object, list[tuple[str, ...]]]:
    """The ``TokenizersBackend`` that ``TokenizersBackend.from_pretrained(..., gguf_file=...)`` gives, but its BPE
    model built without merges, and the merges: ``tokenizer_json`` writes them into its ``tokenizer.json``."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_merges
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    architecture, tokenizer_dict, settings = tokenizer_metadata(gguf_file)
    merges = []

    def merges_apart(*args, **kwargs) -> list:
        merges.extend(get_merges(*args, **kwargs))
        return []

    with (
        mock.patch.object(gguf_tokenizer_mapping, "generate_merges", vocabulary_merges),
        mock.patch.object(gguf_tokenizer_mapping, "get_merges", merges_apart),
    ):
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    # As transformers' own tokenizer classes do, the backend is in place before the base class's __init__: given as
    # ``tokenizer_object`` it would be deep-copied (a JSON round trip: 2.2 s for Gemma 3's 262,144 tokens).
    tokenizer = TokenizersBackend.__new__(TokenizersBackend)
    tokenizer._tokenizer = backend
    tokenizer.__init__(**settings, **extra)
    return tokenizer, merges


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
