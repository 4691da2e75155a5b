"""vLLM's bad_words as token ids: each word as it would start the text and as it would follow a space (torch-free:
the server tokenizes them on its front-end thread, ``sampling.token_bans`` bars them)."""

from __future__ import annotations

Spellings = tuple[tuple[int, ...], ...]  # each bad word's spellings as token ids


def spellings(tokenizer, words: list[str]) -> Spellings:
    """Each bad word's token ids at the start of the text and after a space."""
    texts = [lead + word.lstrip() for word in words for lead in ("", " ")]
    return tuple(sorted({tuple(tokenizer.encode(text, add_special_tokens=False)) for text in texts}))
