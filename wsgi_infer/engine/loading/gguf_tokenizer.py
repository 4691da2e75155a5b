"""A GGUF file's tokenizer, built as transformers builds it from the file, from metadata read faster.

transformers' ``get_gguf_tokenizer`` reads the vocabulary and merges through a numpy memmap, whose every string slice
costs a Python-level finalizer: 0.51 s for a 49,152-token vocabulary and its merges (1B shape, Zen 3). Read from a
plain mapping of the file (``gguf_header``), they take 0.15 s. The tokenizer is then what transformers makes of them
(``convert_gguf_tokenizer``, the backend class), so it stays the tokenizer transformers' GGUF loading gives: the tests
compare the two files for a BPE vocabulary (SmolLM2, ``test_model_loader``) and a SentencePiece one (Gemma 3,
``test_gemma3_270m``). ``tokenizer_metadata`` repeats ``get_gguf_tokenizer``'s few rules (that function takes a path
only); a rule transformers adds there shows in those comparisons only for the tokenizer types they hold.

A file that lists no merges (Gemma's SentencePiece vocabulary) has them recovered by transformers' ``generate_merges``
(every cut of every token into two tokens, sorted by the token's score): 1.1 s of Gemma 3's 262,144 tokens (Intel
Xeon), 0.5 s of it sorting. ``vocabulary_merges`` gives the same list in 0.7 s where no two scores tie, as in every
file whose merges follow its tokens' order, and takes the place of transformers' for this conversion only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from unittest import mock

from .gguf_header import read_header

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


def vocabulary_merges(
    vocab: Mapping[str, int], vocab_scores: Mapping[str, float] | None = None, skip_tokens: Collection[str] = ()
) -> list[tuple[str, str]]:
    """transformers' ``generate_merges``: each token's cuts into two tokens, best token first (the highest score, or
    the lowest id without scores), then by the left part's length (longest first with scores). Where no two scores
    tie, that order is the tokens' sorted once and their cuts' in turn, and the ids that break ties never count; where
    some do, transformers' own."""
    from transformers.tokenization_utils_base import generate_merges

    scores = dict(vocab_scores) if vocab_scores is not None else vocab
    distinct = set(scores.values())
    if skip_tokens or len(distinct) < len(scores) or any(score != score for score in distinct):  # ties, NaN
        return generate_merges(vocab, vocab_scores, skip_tokens)
    best_first = vocab_scores is not None
    merges = []
    for merge in sorted(scores, key=scores.__getitem__, reverse=best_first):
        for index in range(len(merge) - 1, 0, -1) if best_first else range(1, len(merge)):
            left = merge[:index]
            if left in vocab:
                right = merge[index:]
                if right in vocab:
                    merges.append((left, right))
    return merges
