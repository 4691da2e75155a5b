"""A conversion's ``tokenizer.json``: its tokenizer, built without merges, with the merges written in as "a b"
strings (as pairs where a part has a space), which tokenizers reads as the tokenizer built with them: ``to_str`` of
what it reads is that tokenizer's text. Tokens with quotes, backslashes and JSON's own punctuation in them are what a
text substitution gets wrong (``"],["`` is a token of Gemma 3's)."""

from __future__ import annotations

import ctypes
import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, models

from wsgi_infer.engine.kernels.build import kernels_library
from wsgi_infer.engine.loading.gguf_tokenizer import TokenLookup, read_gguf_tokenizer, tokenizer_json
from wsgi_infer.engine.loading.model_paths import default_model_path
from wsgi_infer.engine.loading.vocabulary_merges import MergeList, library_merges

PUNCTUATION = ['"', "\\", ",", "[", "]", "],[", '","', '"],["', "\\u0022", "\n", "\t", "▁", "é", "世", "\x00"]


def bpe_parts(parts: list[str], seed: int = 0) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A BPE vocabulary whose merges join random pairs of ``parts`` (and what they made)."""
    rng = random.Random(seed)
    vocab = {part: index for index, part in enumerate(dict.fromkeys(parts))}
    merges = []
    for _ in range(300):
        left, right = rng.choice(list(vocab)), rng.choice(list(vocab))
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    return vocab, merges


def written_and_expected(vocab: dict[str, int], merges: list[tuple[str, str]]) -> tuple[str, str]:
    written = tokenizer_json(Tokenizer(models.BPE(vocab=vocab, merges=[])), merges)
    return written, Tokenizer(models.BPE(vocab=vocab, merges=merges)).to_str()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("parts", [PUNCTUATION, ["▁", "é", "世", "\x7f"]], ids=["escaped", "plain"])
def test_merges_of_quotes_backslashes_and_brackets_are_read_as_the_same_tokenizer(seed, parts):
    written, expected = written_and_expected(*bpe_parts([*parts, "a", "b"], seed))
    merges = json.loads(written)["model"]["merges"]
    assert len(merges) > 200 and all(isinstance(merge, str) for merge in merges)
    assert Tokenizer.from_str(written).to_str() == expected


def test_a_merge_with_a_space_in_a_part_keeps_them_all_as_pairs():
    written, expected = written_and_expected(*bpe_parts(["a", "b", " ", "c"]))
    merges = json.loads(written)["model"]["merges"]
    assert any(" " in part for merge in merges for part in merge) and all(len(merge) == 2 for merge in merges)
    assert Tokenizer.from_str(written).to_str() == expected


@pytest.mark.parametrize("parts", [PUNCTUATION, [*PUNCTUATION, " "]], ids=["strings", "pairs"])
def test_merges_the_library_recovers_are_written_from_its_pairs_of_indices_as_from_their_strings(parts):
    """The merges the kernels' library recovers (Gemma's) are pairs of the vocabulary's indices, written from the
    tokens' escaped bytes: the same text as those pairs' strings written one by one, in either form."""
    vocab, _ = bpe_parts([*parts, "a", "b"])
    order = sorted(vocab, key=vocab.__getitem__)
    merges = library_merges(ctypes.CDLL(str(kernels_library(build=True))), vocab, order, best_first=False)
    assert isinstance(merges, MergeList) and len(merges) > 200
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    written = tokenizer_json(backend, merges)
    assert written == tokenizer_json(backend, list(merges))
    assert all(isinstance(merge, list) for merge in json.loads(written)["model"]["merges"]) == (" " in parts)


def test_the_shipped_vocabulary_is_written_with_its_merges_as_strings():
    tokenizer, merges = read_gguf_tokenizer(default_model_path())
    assert len(merges) > 40_000 and json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"] == []
    written = json.loads(tokenizer_json(tokenizer.backend_tokenizer, merges))["model"]["merges"]
    assert written == [f"{left} {right}" for left, right in merges]


@pytest.mark.parametrize(
    "model",
    [
        models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"),
        models.Unigram([("a", -1.0), ("b", -2.0)], 0, False),
        models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]),  # merges of its own already
    ],
)
def test_merges_for_a_model_with_no_place_for_them_are_refused(model):
    tokenizer = Tokenizer(model)
    assert tokenizer_json(tokenizer, []) == tokenizer.to_str()
    with pytest.raises(ValueError, match="no place"):
        tokenizer_json(tokenizer, [("a", "b")])


def test_a_token_lookup_is_the_vocabulary_with_its_added_tokens():
    """What transformers' converter reads of ``get_vocab()`` (whether a token is in it, its id, the whole dict) is
    what the lookup that replaces it gives: added tokens included, one that is no token nowhere."""
    backend = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[]))
    backend.add_tokens([AddedToken("<think>", special=False)])
    backend.add_special_tokens([AddedToken("<|end|>", special=True)])
    lookup, vocab = TokenLookup(backend), backend.get_vocab(with_added_tokens=True)
    assert dict(lookup) == vocab and len(lookup) == len(vocab) == 5
    for token in [*vocab, "abc", "", "<think", 3, None]:
        assert (token in lookup) == (token in vocab), token
        assert lookup.get(token) == vocab.get(token), token
