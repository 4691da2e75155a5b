"""A thinking model's reply split into its thought and its answer, as vLLM and llama-server do: text in a leading
``<think>…</think>`` is ``reasoning_content``, the rest is ``content`` (where tool calls are then parsed).

Templates that think (Qwen3, SmolLM3, DeepSeek-R1 distills) mention both tags; their replies open with
``<think>``. A reply cut inside its thought has only reasoning; one without the tag is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....engine.text.chat_template import THINK_CLOSE, THINK_OPEN


@dataclass
class ReasoningParser:
    """One choice's text, fed piece by piece; each feed returns the (reasoning, answer) pieces ready to send.

    Text that may still become a tag is held: leading text that may become ``<think>``, a thought's tail that
    may become ``</think>``, and the whitespace between the thought and the answer, which is dropped.
    """

    opened: bool = False  # the prompt opened the thought: the reply starts inside it
    _held: str = ""
    _state: str = "start"  # start, thought, gap (after the thought, before the answer) or answer

    def __post_init__(self) -> None:
        if self.opened:
            self._state = "thought"

    _thought_sent: bool = False

    def feed(self, piece: str) -> tuple[str, str]:
        self._held += piece
        if self._state == "start":
            opening = self._held.lstrip()
            if THINK_OPEN.startswith(opening):
                return "", ""  # may still open a thought
            if not opening.startswith(THINK_OPEN):
                self._state = "answer"
                return "", self._take()
            self._state, self._held = "thought", opening[len(THINK_OPEN) :]
        if self._state == "thought":
            if not self._thought_sent:  # the newline after <think> is the tag's, not the thought's
                self._held = self._held.lstrip("\n")
            end = self._held.find(THINK_CLOSE)
            if end < 0:  # newlines that may precede </think> are held too
                body = self._held[: len(self._held) - _partial_suffix(self._held, THINK_CLOSE)]
                cut = len(body.rstrip("\n"))
                thought, self._held = self._held[:cut], self._held[cut:]
                self._thought_sent = self._thought_sent or bool(thought)
                return thought, ""
            thought, self._held = self._held[:end].rstrip("\n"), self._held[end + len(THINK_CLOSE) :]
            self._state = "gap"
            return thought, self._after_gap()
        if self._state == "gap":
            return "", self._after_gap()
        return "", self._take()

    def finish(self) -> tuple[str, str]:
        """What was held, once the choice has ended: a thought's tail is reasoning, leading text the answer."""
        if self._state == "thought":
            return self._take(), ""
        return "", "" if self._state == "gap" else self._take()

    def _after_gap(self) -> str:
        self._held = self._held.lstrip()
        if not self._held:
            return ""
        self._state = "answer"
        return self._take()

    def _take(self) -> str:
        text, self._held = self._held, ""
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a start of ``tag`` (so may become it)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
