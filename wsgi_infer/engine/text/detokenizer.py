"""Incremental detokenization with stop-string hold-back.

Built on ``tokenizers.decoders.DecodeStream``, which keeps a small window of
token offsets, so each new token costs constant work and an incomplete UTF-8
character is held until its last byte arrives.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ..sampling_params import SamplingParams

# DecodeStream needs a few prompt tokens of context so the first generated
# token gets its leading space right (SentencePiece/ByteLevel merges).
_PROMPT_CONTEXT_TOKENS = 4
# A character has at most 4 UTF-8 bytes, so a prompt ends inside one at most 3 tokens back.
_MAX_CHAR_TOKENS = 3


def _split_prompt_end(tokenizer: Tokenizer, prompt_ids: list[int], skip: bool) -> tuple[list[int], list[int]]:
    """The prompt's last few tokens as (context, tail): the context decodes to whole characters, and the tail
    holds the start of a character the prompt ends inside (empty when the prompt ends on a whole character).

    The tail goes through the stream too, so the output tokens that complete its character emit it whole.
    """
    window = prompt_ids[-(_PROMPT_CONTEXT_TOKENS + _MAX_CHAR_TOKENS) :]
    for cut in range(len(window), 0, -1):
        if not tokenizer.decode(window[:cut], skip_special_tokens=skip).endswith("\ufffd"):
            return window[:cut], window[cut:]
    return [], window


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class IncrementalDetokenizer:
    """Turns a request's new token ids into text pieces that are safe to send.

    Text that could be the beginning of a stop string is held back until it is
    either completed (the request stops; the stop string is returned only with
    ``include_stop``) or ruled out. ``matched`` holds the stop string once one matched. The text of the first
    ``min_tokens`` tokens is released as it comes, searched for no stop string.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        context, tail = _split_prompt_end(tokenizer, prompt_ids, skip_special_tokens)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # The tail's text as the prompt shows it: its whole characters, then U+FFFD for the one it ends inside.
        # Every step over it ends in U+FFFD (the context is the longest clean cut), so the stream emits nothing yet.
        self._prompt_tail: str | None = None
        if tail:
            for token_id in tail:
                self._stream.step(tokenizer, token_id)
            whole = tokenizer.decode(context + tail, skip_special_tokens=skip_special_tokens)
            self._prompt_tail = whole[len(tokenizer.decode(context, skip_special_tokens=skip_special_tokens)) :]
        self._skip = skip_special_tokens
        self._unsent = 0  # tokens stepped since the stream last gave text (bytes of an unfinished character)
        self._stop, self._include_stop = stop, include_stop
        self._pending = ""
        self._held = [0] * len(stop)  # per stop, the pending text's longest end that starts it (``_held_end``)
        self._unsearched = min_tokens  # tokens still to come whose text no stop string is searched in
        self.matched: str | None = None

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        """The detokenizer of a request's output, with its stop strings and settings."""
        stop, skip, include = params.stop, params.skip_special_tokens, params.include_stop_str_in_output
        return cls(tokenizer, prompt_ids, stop, skip, include, params.min_tokens)

    def push(self, token_id: int) -> str:
        """Decode one token; return the text that may be released now.

        A stop string that matches now, or may start at the text's end, starts within what was held for it or in
        the new text: each is searched from there, so a token costs the stops' held and new text, not the square
        of what is held (64 stop strings of 15,000 characters held back made every stream of the worker 13x slower).
        """
        searched_to = len(self._pending)
        self._take(token_id)
        if self._unsearched > 0 or not self._stop:
            self._unsearched = max(self._unsearched - 1, 0)
            return self._release(len(self._pending))
        starts = [searched_to - held for held in self._held]
        found = [(i, stop) for stop, start in zip(self._stop, starts) if (i := self._pending.find(stop, start)) >= 0]
        if found:  # the earliest; of two at one place, the one listed first (as vLLM's)
            first, self.matched = min(found, key=lambda place: place[0])
            released = self._pending[: first + (len(self.matched) if self._include_stop else 0)]
            self._pending = ""
            return released
        self._held = [_held_end(self._pending, stop, start) for stop, start in zip(self._stop, starts)]
        return self._release(len(self._pending) - max(self._held))

    def _take(self, token_id: int) -> None:
        """Decode one token into the pending text."""
        piece = self._step(token_id)
        if piece and self._prompt_tail is not None:
            # The first piece repeats the tail's whole characters, which the prompt already holds; where the
            # prompt showed U+FFFD for its unfinished character, this piece has the character itself.
            piece = piece[_common_prefix_len(piece, self._prompt_tail) :]
            self._prompt_tail = None
        if piece:
            self._pending += piece

    def _step(self, token_id: int) -> str | None:
        """The stream's step. A byte-fallback tokenizer (Llama's, Gemma's) decodes a whole character of byte tokens,
        then, once a stray byte and another token follow, the run as U+FFFDs: the text sent is no longer a prefix,
        and the stream raises (it killed the engine thread). As vLLM does, a new stream goes on from the token;
        the stray bytes, never sent, are one U+FFFD."""
        try:
            piece = self._stream.step(self._tokenizer, token_id)
        except Exception as exc:  # tokenizers raises a plain Exception
            if "Invalid prefix" not in str(exc):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            piece = "\ufffd" * self._unsent + (self._stream.step(self._tokenizer, token_id) or "")
        self._unsent = 0 if piece else self._unsent + 1
        return piece

    def flush(self, last_token: int | None = None) -> str:
        """Release everything held back (the request ended for another reason), and ``last_token``'s text where
        the stop token that ended it is to be shown (include_stop_str_in_output, as vLLM's): no stop string is
        searched in it."""
        if last_token is not None:
            self._take(last_token)
        return self._release(len(self._pending))

    def _release(self, upto: int) -> str:
        released, self._pending = self._pending[:upto], self._pending[upto:]
        return released


def _held_end(text: str, stop: str, start: int) -> int:
    """The length of ``text``'s longest end, from ``start`` on, that begins ``stop`` (and is not all of it)."""
    at = max(start, len(text) - len(stop) + 1)
    while (at := text.find(stop[0], at)) >= 0:
        if stop.startswith(text[at:]):
            return len(text) - at
        at += 1
    return 0
