"""Incremental detokenization with stop-string hold-back.

Built on ``tokenizers.decoders.DecodeStream``, which keeps a small window of
token offsets, so each new token costs constant work and an incomplete UTF-8
character is held until its last byte arrives.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# DecodeStream needs a few prompt tokens of context so the first generated
# token gets its leading space right (SentencePiece/ByteLevel merges).
_PROMPT_CONTEXT_TOKENS = 4


def _clean_prompt_suffix(tokenizer: Tokenizer, prompt_ids: list[int]) -> list[int]:
    """The longest short prompt suffix that decodes to whole characters.

    DecodeStream would otherwise re-emit a half character from the prompt.
    """
    for n in range(min(_PROMPT_CONTEXT_TOKENS, len(prompt_ids)), 0, -1):
        suffix = prompt_ids[-n:]
        if not tokenizer.decode(suffix, skip_special_tokens=False).endswith("\ufffd"):
            return suffix
    return []


class IncrementalDetokenizer:
    """Turns a request's new token ids into text pieces that are safe to send.

    Text that could be the beginning of a stop string is held back until it is
    either completed (the request stops; the stop string is not returned) or
    ruled out. ``matched`` holds the stop string once one matched.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(
            ids=_clean_prompt_suffix(tokenizer, prompt_ids),
            skip_special_tokens=skip_special_tokens,
        )
        self._stop = stop
        self._pending = ""
        self.matched: str | None = None

    def push(self, token_id: int) -> str:
        """Decode one token; return the text that may be released now."""
        piece = self._stream.step(self._tokenizer, token_id)
        if piece:
            self._pending += piece
        if not self._stop:
            return self._release(len(self._pending))
        found = [(i, s) for s in self._stop if (i := self._pending.find(s)) >= 0]
        if found:
            first, self.matched = min(found)
            released = self._pending[:first]
            self._pending = ""
            return released
        return self._release(len(self._pending) - self._held_suffix_len())

    def flush(self) -> str:
        """Release everything held back (the request ended for another reason)."""
        return self._release(len(self._pending))

    def _held_suffix_len(self) -> int:
        """Length of the longest suffix of pending text that starts a stop string."""
        text = self._pending
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        released, self._pending = self._pending[:upto], self._pending[upto:]
        return released
