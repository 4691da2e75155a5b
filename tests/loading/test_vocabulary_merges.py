"""``vocabulary_merges`` gives transformers' ``generate_merges`` list, element for element, cut by the CPU kernels'
library and by Python where there is none: on the shipped vocabulary and on random ones of 1- to 4-byte characters,
with distinct scores (its own order), tied ones and none (transformers' then)."""

from __future__ import annotations

import random

import pytest
from transformers.tokenization_utils_base import generate_merges

from wsgi_infer.engine.kernels.build import kernels_library
from wsgi_infer.engine.loading import vocabulary_merges as merges_module
from wsgi_infer.engine.loading.gguf_tokenizer import tokenizer_metadata
from wsgi_infer.engine.loading.model_paths import default_model_path
from wsgi_infer.engine.loading.vocabulary_merges import vocabulary_merges

ALPHABET = "ab▁cé😀"  # 1, 1, 3, 1, 2 and 4 bytes: cuts between bytes of a character are no cuts


@pytest.fixture(params=["library", "python"], autouse=True)
def cut_by(request, monkeypatch):
    library = kernels_library(build=True) if request.param == "library" else None
    assert library is not None or request.param == "python"
    monkeypatch.setattr(merges_module, "kernels_library_now", lambda: library)
    calls = []
    monkeypatch.setattr(merges_module, "python_merges", lambda *a: calls.append(a) or python_merges(*a))
    yield
    tied = request.node.callspec.params.get("scores") == "tied"  # transformers' own list
    assert bool(calls) == (request.param == "python" and not tied)  # the path named was the path taken


python_merges = merges_module.python_merges


def random_vocabulary(seed: int) -> dict[str, int]:
    """Tokens over a small alphabet, so that most tokens cut into two others, some in several ways."""
    rng = random.Random(seed)
    tokens = list(ALPHABET) + ["".join(rng.choices(ALPHABET, k=rng.randint(2, 7))) for _ in range(3000)]
    return {token: index for index, token in enumerate(dict.fromkeys(tokens))}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scores", ["positions", "random", "tied", "none"])
def test_it_is_transformers_list_for_random_vocabularies(seed, scores):
    vocab = random_vocabulary(seed)
    rng = random.Random(seed)
    vocab_scores = {
        "positions": {token: -index for token, index in vocab.items()},  # Gemma's rule: the file's order
        "random": {token: rng.random() for token in vocab},
        "tied": {token: float(rng.randint(0, 20)) for token in vocab},
        "none": None,
    }[scores]
    expected = generate_merges(vocab, vocab_scores)
    assert len(expected) > len(vocab)
    assert vocabulary_merges(vocab, vocab_scores) == expected


def test_it_is_transformers_list_for_the_shipped_vocabulary():
    tokens = tokenizer_metadata(default_model_path())[1]["tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    by_position = {token: -index for index, token in enumerate(tokens)}
    assert vocabulary_merges(vocab, by_position) == generate_merges(vocab, by_position)
    assert vocabulary_merges(vocab) == generate_merges(vocab)
