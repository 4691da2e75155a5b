"""OpenAI's JSON for a request's merged deltas: streamed chunks, final choices and aborts, for completions and
chat completions (tool calls parsed out of chat text)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

from ....engine.text.token_pieces import piece_bytes, shown
from ...engine_client.streams import ChoiceDelta, RequestStream
from .reasoning import ReasoningParser
from .tools import ToolCallParser, ToolPlan, merge_call_entries


class Formatter(ABC):
    """Turns merged deltas into one API's JSON: streamed chunks, final choices, aborts."""

    prefix = ""

    def __init__(self, stream: RequestStream, obj: str, prompt_logprobs: int | None = None) -> None:
        self.id = f"{self.prefix}-{stream.request_id}"
        self.object = obj
        self.created = stream.identity.created
        self.model = stream.model
        self.prompt_logprobs = prompt_logprobs  # vLLM's: how many alternatives each prompt token's entry has

    def envelope(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    @abstractmethod
    def chunk_choice(self, choice: ChoiceDelta) -> dict | None:
        """A streamed choice; None when there is nothing to send yet."""

    @abstractmethod
    def final_choice(self, choice: ChoiceDelta) -> dict: ...

    @abstractmethod
    def abort_choice(self, index: int) -> dict: ...

    def response_fields(self, choices: dict[int, ChoiceDelta]) -> dict:
        """What a whole (not streamed) response has beside its choices."""
        return {}

    def _prompt_logprobs(self, choice: ChoiceDelta) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: None for the first token, then per token a dict of token id to its logprob,
        rank and text: the prompt's own token and the top alternatives."""
        d = choice.delta
        if self.prompt_logprobs is None or d.prompt_logprobs is None:
            return None
        texts = {token_id: shown(piece) for token_id, piece in choice.token_texts.items()}

        def entry(token_id: int, logprob: float, rank: int | None) -> dict:
            return {"logprob": logprob, "rank": rank, "decoded_token": texts.get(token_id, "")}

        return [None] + [
            {
                str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank),
                **{str(t): entry(t, v, rank) for rank, (t, v) in enumerate(lp.top[: self.prompt_logprobs], 1)},
            }
            for lp in d.prompt_logprobs
        ]


class CompletionFormatter(Formatter):
    """``echo`` holds each prompt's text: it starts that prompt's choices; ``logprobs``, how many alternatives each
    token's legacy entry has."""

    prefix = "cmpl"

    def __init__(
        self,
        stream: RequestStream,
        obj: str,
        echo: list[str] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        super().__init__(stream, obj, prompt_logprobs)
        self._text_offset: dict[int, int] = {}
        self._echo = echo
        self._top = logprobs or 0
        self._n = stream.choices_per_prompt
        self._echoed: set[int] = set()

    def chunk_choice(self, choice: ChoiceDelta) -> dict:
        d = choice.delta
        text = d.text
        if self._echo is not None and choice.index not in self._echoed:
            self._echoed.add(choice.index)
            text = self._echo[choice.index // self._n] + text
        body = {
            "index": choice.index,
            "text": text,
            "logprobs": self._logprobs(choice),
            "finish_reason": d.finish_reason,
        }
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
        texts = {token_id: shown(piece) for token_id, piece in choice.token_texts.items()}
        tokens = [texts.get(token_id, "") for token_id, _, _ in entries]
        offsets, offset = [], self._text_offset.get(choice.index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offset[choice.index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [None if top is None else _by_text(top, texts) for _, _, top in entries],
            "text_offset": offsets,
        }


class ChatFormatter(Formatter):
    """Where the template thinks, each choice's thought is split from its answer (``ReasoningParser``); with
    tools, the answer goes through a ``ToolCallParser``: content or tool calls."""

    prefix = "chatcmpl"

    def __init__(
        self,
        stream: RequestStream,
        obj: str,
        tools: ToolPlan | None = None,
        thinks: bool = False,
        opened: bool = False,
        prompt_logprobs: int | None = None,
    ) -> None:
        """``tools``: how the model may call them (their format, and whether it may write text instead);
        ``thinks``: the template thinks; ``opened``: its prompt opened the thought already."""
        super().__init__(stream, obj, prompt_logprobs)
        self._role_sent: set[int] = set()
        self._parsers = (
            {
                i: ToolCallParser(tools.format, stream.identity, calls_only=tools.mode != "auto")
                for i in range(stream.num_choices)
            }
            if tools
            else None
        )
        self._thoughts = {i: ReasoningParser(opened) for i in range(stream.num_choices)} if thinks else None

    def _split(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of a piece of choice ``index``'s text; ``final``: the choice's last piece."""
        if self._thoughts is None:
            return "", text
        reasoning, answer = self._thoughts[index].feed(text)
        if final:
            more = self._thoughts[index].finish()
            reasoning, answer = reasoning + more[0], answer + more[1]
        return reasoning, answer

    def chunk_choice(self, choice: ChoiceDelta) -> dict | None:
        finish_reason = choice.delta.finish_reason
        reasoning, answer = self._split(choice.index, choice.delta.text, finish_reason is not None)
        delta: dict = {"content": answer} if answer or not reasoning else {}
        if self._parsers is not None:
            parser = self._parsers[choice.index]
            delta = parser.feed(answer)
            if finish_reason is not None:
                delta = _merge_deltas(delta, parser.finish())
                finish_reason = _finish_reason(parser, finish_reason)
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        if not delta and finish_reason is None:
            return None  # held: nothing to show yet
        if choice.index not in self._role_sent:  # the role comes with the first real token
            self._role_sent.add(choice.index)
            delta = {"role": "assistant", **delta}
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": self._logprobs(choice),
            "finish_reason": finish_reason,
        }

    def final_choice(self, choice: ChoiceDelta) -> dict:
        reasoning, answer = self._split(choice.index, choice.delta.text, final=True)
        message: dict = {"role": "assistant", "content": answer}
        if self._thoughts is not None:
            message["reasoning_content"] = reasoning or None
        finish_reason = choice.delta.finish_reason
        if self._parsers is not None:
            parser = self._parsers[choice.index]
            parser.feed(answer)
            parser.finish()
            message["content"] = parser.content
            calls = [c.as_openai() for c in parser.calls]  # as streamed: a call the length limit cut too
            if calls:
                message["tool_calls"] = calls
            finish_reason = _finish_reason(parser, finish_reason)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice),
            "finish_reason": finish_reason,
        }

    def abort_choice(self, index: int) -> dict:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": "abort"}

    def response_fields(self, choices: dict[int, ChoiceDelta]) -> dict:
        """vLLM's prompt_logprobs, once for the conversation (every choice reads the same prompt)."""
        prompt_logprobs = self._prompt_logprobs(choices[0]) if choices else None
        return {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}

    @staticmethod
    def _logprobs(choice: ChoiceDelta) -> dict | None:
        if choice.delta.logprobs is None:
            return None
        texts = choice.token_texts

        def entry(token_id: int, logprob: float) -> dict:
            piece = texts.get(token_id, "")  # its own bytes, also where it holds part of a character
            return {"token": shown(piece), "logprob": logprob, "bytes": list(piece_bytes(piece))}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in choice.delta.logprobs
            ]
        }


def _by_text(top: list[tuple[int, float]], texts: dict[int, str]) -> dict[str, float]:
    """The legacy shape's top logprobs, keyed by text: where two tokens read alike (pieces of one character both
    read "\ufffd"), the likelier one's, not the last one's."""
    by_text: dict[str, float] = {}
    for token_id, logprob in sorted(top, key=lambda entry: -entry[1]):
        by_text.setdefault(texts.get(token_id, ""), logprob)
    return by_text


def _finish_reason(parser: ToolCallParser, finish_reason: str) -> str:
    """A choice that ended its calls, each of them whole (not cut by the length limit or a stop sequence), finished
    with "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" and parser.called else finish_reason


def _merge_deltas(first: dict, second: dict) -> dict:
    """Two parser deltas of one chunk: content concatenated, tool-call entries one per index."""
    merged = {**first}
    for key, value in second.items():
        merged[key] = merged[key] + value if key in merged else value
    if "tool_calls" in merged:
        merged["tool_calls"] = merge_call_entries(merged["tool_calls"])
    return merged


def reply_parts(chunk: dict | None) -> Iterator[tuple[str, str, str | None]]:
    """A chat chunk's pieces in the order its reply wrote them, which other APIs build blocks or items from:
    ("reasoning", text, None), ("content", text, None), ("call", call id, name) where a tool call starts, and
    ("arguments", text, None). None: nothing to show yet."""
    if chunk is None:
        return
    delta = chunk["delta"]
    for kind in ("reasoning", "content"):
        if text := delta.get("reasoning_content" if kind == "reasoning" else "content"):
            yield kind, text, None
    for entry in delta.get("tool_calls", []):
        function = entry.get("function", {})
        if "id" in entry:
            yield "call", entry["id"], function["name"]
        if function.get("arguments"):
            yield "arguments", function["arguments"], None
