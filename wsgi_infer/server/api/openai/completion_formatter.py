"""/v1/completions' JSON for a request's merged deltas: text choices, echo and the legacy logprobs' shape, with
vLLM's additions where asked for (``Formatter``)."""

from __future__ import annotations

from collections.abc import Callable

from ...engine_client.streams import ChoiceDelta, RequestStream
from ..chat.formatters import PLAIN, Formatter, VllmFields


class CompletionFormatter(Formatter):
    """``echo`` holds each prompt's text: it starts that prompt's choices; ``logprobs``, how many alternatives each
    token's legacy entry has. vLLM's prompt_logprobs, prompt_token_ids and token_ids are the choice's own."""

    prefix = "cmpl"

    def __init__(
        self,
        stream: RequestStream,
        obj: str,
        echo: list[str] | None = None,
        logprobs: int | None = None,
        vllm: VllmFields = PLAIN,
    ) -> None:
        super().__init__(stream, obj, vllm)
        self._text_offset: dict[int, int] = {}
        self._echo = echo
        self._top = logprobs or 0
        self._n = stream.choices_per_prompt
        self._begun: set[int] = set()

    def chunk_choice(self, choice: ChoiceDelta) -> dict:
        d, prompt = choice.delta, choice.index // self._n
        first = choice.index not in self._begun
        self._begun.add(choice.index)
        body = {
            "index": choice.index,
            "text": self._echo[prompt] + d.text if self._echo is not None and first else d.text,
            "logprobs": self._logprobs(choice),
            "finish_reason": d.finish_reason,
            **self.token_ids(choice),
        }
        if d.finish_reason is not None:
            body["stop_reason"] = d.stop_reason
        if first and self.vllm.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids[prompt]
        prompt_logprobs = self._prompt_logprobs(choice)
        return body if prompt_logprobs is None else {**body, "prompt_logprobs": prompt_logprobs}

    final_choice = chunk_choice

    def abort_choice(self, index: int) -> dict:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": "abort"}

    def _logprobs(self, choice: ChoiceDelta) -> dict | None:
        """The legacy shape; prompt tokens first when echoed (the first one has no logprob)."""
        d = choice.delta
        prompt = d.prompt_logprobs if self._echo is not None else None  # else they may be vLLM's alone
        if d.logprobs is None and prompt is None:
            return None
        entries: list[tuple[int, float | None, list | None]] = []
        if prompt is not None:
            entries.append((d.prompt_token_ids[0], None, None))
            entries += [(lp.token_id, lp.logprob, lp.top[: self._top]) for lp in prompt]
        entries += [(lp.token_id, lp.logprob, lp.top) for lp in d.logprobs or []]

        def text(token_id: int) -> str:
            return self.token_text(token_id, choice.token_texts)

        tokens = [text(token_id) for token_id, _, _ in entries]
        offsets, offset = [], self._text_offset.get(choice.index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offset[choice.index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [None if top is None else _by_text([*top, (id_, lp)], text) for id_, lp, top in entries],
            "text_offset": offsets,
        }


def _by_text(top: list[tuple[int, float]], text: Callable[[int], str]) -> dict[str, float]:
    """The legacy shape's top logprobs, keyed by text, the sampled token's among them (OpenAI's "up to logprobs+1
    elements", as vLLM gives them): where two tokens read alike (pieces of one character both read "\ufffd"), the
    likelier one's, not the last one's."""
    by_text: dict[str, float] = {}
    for token_id, logprob in sorted(top, key=lambda entry: -entry[1]):
        by_text.setdefault(text(token_id), logprob)
    return by_text
