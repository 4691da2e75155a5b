"""A conversion's ``tokenizer.json`` holds its merges as "a b" strings, and tokenizers reads the same tokenizer from
it: ``Tokenizer.to_str`` of what it reads is the text it was made from. Tokens with quotes, backslashes and the list's
own punctuation in them are what a text substitution gets wrong (``"],["`` is a token of Gemma 3's)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, models

from wsgi_infer.engine.loading.gguf_tokenizer import read_gguf_tokenizer
from wsgi_infer.engine.loading.model_paths import default_model_path
from wsgi_infer.engine.loading.tokenizer_json import merges_as_strings

PUNCTUATION = ['"', "\\", ",", "[", "]", "],[", '","', '"],["', "\\u0022", "\n", "\t", "▁", "é", "世"]


def bpe_text(parts: list[str], seed: int = 0) -> bytes:
    """A BPE tokenizer whose merges join random pairs of ``parts`` (and what they made), compact."""
    rng = random.Random(seed)
    vocab = {part: index for index, part in enumerate(dict.fromkeys(parts))}
    merges = []
    for _ in range(300):
        left, right = rng.choice(list(vocab)), rng.choice(list(vocab))
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    return Tokenizer(models.BPE(vocab=vocab, merges=merges)).to_str().encode()


def read_again(text: bytes) -> bytes:
    return Tokenizer.from_str(text.decode()).to_str().encode()


@pytest.mark.parametrize("seed", range(4))
def test_merges_of_quotes_backslashes_and_brackets_are_read_as_the_same_tokenizer(seed):
    text = bpe_text([*PUNCTUATION, "a", "b"], seed)
    written = merges_as_strings(text)
    merges = json.loads(written)["model"]["merges"]
    assert len(merges) > 200 and all(isinstance(merge, str) for merge in merges)
    assert read_again(written) == text


def test_the_shipped_vocabulary_is_read_as_the_same_tokenizer():
    text = read_gguf_tokenizer(default_model_path()).backend_tokenizer.to_str().encode()
    written = merges_as_strings(text)
    assert len(written) < 0.9 * len(text) and json.loads(written)["model"]["merges"][0].count(" ") == 1
    assert read_again(written) == text


def test_a_merge_with_a_space_in_a_part_keeps_them_all_as_pairs():
    text = bpe_text(["a", "b", " ", "c"])
    assert merges_as_strings(text) == text


@pytest.mark.parametrize(
    "model",
    [
        models.BPE(vocab={"a": 0}, merges=[]),  # no merges
        models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"),
        models.Unigram([("a", -1.0), ("b", -2.0)], 0, False),
    ],
)
def test_a_model_without_merges_to_rewrite_is_left_as_it_is(model):
    text = Tokenizer(model).to_str().encode()
    assert merges_as_strings(text) == text


def test_merges_already_strings_are_left_as_they_are():
    written = merges_as_strings(bpe_text(["a", "b", '"', "\\"]))
    assert merges_as_strings(written) == written
