"""Incremental detokenization: whole characters only, nothing lost, stop strings held back."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models

from wsgi_infer.engine.loading.model_loader import load_tokenizer
from wsgi_infer.engine.text.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello 😀 world, 🎉🎉 party!",
    "日本語のテキストと中文文本 mixed with English",
    "Zürich, São Paulo, Kraków — naïve café",
    "👩‍👩‍👧‍👦 family emoji and 🇫🇷 flag",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir).backend_tokenizer


def test_texts_split_characters_across_tokens(tokenizer):
    """Precondition of the next test: byte-level BPE cuts these characters between tokens."""
    for text in (TEXTS[0], TEXTS[1], TEXTS[3]):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids), text


@pytest.mark.parametrize("text", TEXTS)
def test_utf8_pieces_are_whole_and_complete(tokenizer, text):
    prompt = tokenizer.encode("Say:").ids
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=[])
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_across_multibyte_characters(tokenizer):
    ids = tokenizer.encode("tea 🍵 then 日本 and more", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, [], stop=["and", "🍵 then 日"])
    pieces = []
    for i in ids:
        pieces.append(detok.push(i))
        if detok.matched is not None:
            break
    assert detok.matched == "🍵 then 日"  # the one that matched, not the first listed
    assert "".join(pieces) == "tea "


@pytest.mark.parametrize("stop", [["then", "the"], ["the", "then"]])
def test_of_two_stop_strings_found_at_one_place_the_one_listed_first_ends_the_text(tokenizer, stop):
    """As vLLM's (the shorter won: the pair's order as tuples)."""
    ids = tokenizer.encode("We went home then", add_special_tokens=False).ids
    assert tokenizer.decode([ids[-1]]) == " then"  # both complete in one token's text
    detok = IncrementalDetokenizer(tokenizer, [], stop=stop, include_stop=True)
    assert "".join(detok.push(i) for i in ids) == "We went home " + stop[0] and detok.matched == stop[0]


def _mid_character_splits(tokenizer, text: str) -> list[tuple[list[int], list[int]]]:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return [(ids[:n], ids[n:]) for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd")]


@pytest.mark.parametrize("text", ["x 😀😀", TEXTS[0], TEXTS[1], TEXTS[3]])
def test_prompt_ending_mid_character_is_not_repeated(tokenizer, text):
    """A prompt of token ids may end inside a character: the output completes it, whole, and repeats nothing."""
    splits = _mid_character_splits(tokenizer, text)
    assert splits, text  # the tokenizer cuts a character of this text between tokens
    for prompt, output in splits:
        detok = IncrementalDetokenizer(tokenizer, prompt, stop=[])
        pieces = [detok.push(i) for i in output] + [detok.flush()]
        assert not any("\ufffd" in p for p in pieces), (prompt, pieces)
        # The prompt shows its unfinished character as one U+FFFD; the output is the rest of the full text.
        prompt_text = tokenizer.decode(prompt).removesuffix("\ufffd")
        full_text = tokenizer.decode(prompt + output)
        assert full_text.startswith(prompt_text)
        assert "".join(pieces) == full_text[len(prompt_text) :], prompt


def test_a_stray_byte_after_a_whole_character_of_byte_tokens_is_one_replacement_character():
    """A byte-fallback tokenizer (Gemma's, Llama's) decodes a run of byte tokens whole, then as U+FFFDs once a stray
    byte and another token follow: tokenizers' DecodeStream raised "Invalid prefix", which killed the engine thread
    and every stream of its worker (one request could: a prompt of byte tokens and a logit_bias)."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<unk>": 256, "\u2581hi": 257, "a": 258}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    detok = IncrementalDetokenizer(tokenizer, [258], stop=[])
    pieces = [detok.push(i) for i in [*"\U0001d541".encode(), 0xE0, 257, 258]]
    assert "".join(pieces) == "\U0001d541\ufffd hia"


def _held_back_as_before(pending: str, stops: list[str]) -> int:
    """The hold-back as it was first written, every stop's every prefix tried at each token: the reference."""
    return max((n for stop in stops for n in range(1, len(stop)) if pending.endswith(stop[:n])), default=0)


def test_stop_strings_searched_from_what_each_held_release_what_a_search_of_everything_would():
    """Each token searches a stop from where the text held for it began (the text held back by 64 stops of
    15,000 characters cost the square of its length a token, on the engine thread); over texts and stops of two
    letters that overlap themselves every way, each piece equals that of a search of the whole pending text."""
    import random

    letters = "ab"
    tokenizer = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(letters)}, unk_token="a"))
    tokenizer.decoder = decoders.Fuse()
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice(letters) for _ in range(rng.randint(1, 40)))
        detok, pending = IncrementalDetokenizer(tokenizer, [], stop=stops), ""
        for at, letter in enumerate(text):
            pending += letter
            found = [(i, stop) for stop in stops if (i := pending.find(stop)) >= 0]
            if found:
                first, matched = min(found, key=lambda place: place[0])
                expected, pending = pending[:first], ""
            else:
                held = _held_back_as_before(pending, stops)
                expected, pending, matched = pending[: len(pending) - held], pending[len(pending) - held :], None
            assert detok.push(letters.index(letter)) == expected, (stops, text, at)
            assert detok.matched == matched
            if matched:
                break
