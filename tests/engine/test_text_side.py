"""A load reads a model's tokenizer before its weights (what reading it holds for a while then comes before the
weights' memory, not on top of it), also where its files are still to come (a GGUF's copy committed while another
process reads its tokenizer ahead), and reads none where the model's text side was kept."""

from __future__ import annotations

import shutil

import pytest

from wsgi_infer.engine import text_side as text_sides
from wsgi_infer.engine.loading.text_files import TOKENIZER_MARK

VOCABULARY = 49_152


@pytest.fixture
def order(monkeypatch) -> list[str]:
    """What a load did, in turn: "tokenizer" for each tokenizer read."""
    done: list[str] = []
    read = text_sides.load_tokenizer
    monkeypatch.setattr(text_sides, "load_tokenizer", lambda model_dir: done.append("tokenizer") or read(model_dir))
    return done


def load(model_dir, kept, order: list[str]):
    return text_sides.with_weights(model_dir, kept, VOCABULARY, lambda: order.append("weights") or "the weights")


def test_a_tokenizer_whose_files_are_all_there_is_read_before_the_weights(default_model_dir, order):
    weights, text = load(default_model_dir, None, order)
    assert order == ["tokenizer", "weights"] and weights == "the weights"
    assert text.model_dir == default_model_dir and text.tokens == VOCABULARY


def test_a_tokenizer_still_to_come_is_read_before_the_weights(tmp_path, default_model_dir, order):
    copy = tmp_path / default_model_dir.name
    shutil.copytree(default_model_dir, copy)
    (copy / TOKENIZER_MARK).unlink()  # as a copy committed while another process reads its tokenizer
    weights, text = load(copy, None, order)
    assert order == ["tokenizer", "weights"] and (copy / TOKENIZER_MARK).is_file()
    words = "Hello there, 世界"
    assert text.tokenizer.encode(words) == text_sides.load_tokenizer(default_model_dir).encode(words)


def test_a_kept_text_side_is_not_read_again(default_model_dir, order):
    kept = text_sides.text_side(default_model_dir, None, VOCABULARY)
    order.clear()
    weights, text = load(default_model_dir, kept, order)
    assert order == ["weights"] and text is kept
