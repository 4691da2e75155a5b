"""OpenAI's JSON for a request's merged deltas: streamed chunks, final choices and aborts (``Formatter``; chat
completions' here, tool calls parsed out of their text), with vLLM's additions where a request asks for them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from ....engine.text.token_pieces import piece_bytes, shown
from ...engine_client.streams import ChoiceDelta, RequestStream
from .reasoning import ReasoningParser
from .tools import ToolCallParser, ToolPlan, merge_call_entries


@dataclass(frozen=True)
class VllmFields:
    """What vLLM adds to a response, where the request asks: ``prompt_logprobs`` (how many alternatives each prompt
    token's entry has), ``return_token_ids`` (the prompt's and each choice's token ids) and
    ``return_tokens_as_token_ids`` (logprobs' tokens written "token_id:N")."""

    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    @classmethod
    def of(cls, request: object) -> VllmFields:
        """A request's, where it gave them (None: a field left out)."""
        given = {name: getattr(request, name) for name in FIELDS}
        return cls(**{name: value for name, value in given.items() if value is not None})


FIELDS = tuple(VllmFields.__dataclass_fields__)
PLAIN = VllmFields()  # none of them


class Formatter(ABC):
    """Turns merged deltas into one API's JSON: streamed chunks, final choices, aborts."""

    prefix = ""

    def __init__(self, stream: RequestStream, obj: str, vllm: VllmFields = PLAIN) -> None:
        self.id = f"{self.prefix}-{stream.request_id}"
        self.object = obj
        self.created = stream.identity.created
        self.model = stream.model
        self.vllm = vllm
        self.prompt_ids = stream.prompt_ids  # each prompt's, as submitted

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

    def token_text(self, token_id: int, texts: dict[int, str]) -> str:
        """A token as logprobs show it: its text, or "token_id:N" where the request asked for ids."""
        return f"token_id:{token_id}" if self.vllm.return_tokens_as_token_ids else shown(texts.get(token_id, ""))

    def token_ids(self, choice: ChoiceDelta) -> dict:
        """vLLM's token_ids of a chunk or a choice, where asked for."""
        return {"token_ids": choice.delta.token_ids} if self.vllm.return_token_ids else {}

    def _prompt_logprobs(self, choice: ChoiceDelta) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: None for the first token, then per token a dict of token id to its logprob,
        rank and text: the prompt's own token and the top alternatives."""
        d, n = choice.delta, self.vllm.prompt_logprobs
        if n is None or d.prompt_logprobs is None:
            return None
        texts = choice.token_texts

        def entry(token_id: int, logprob: float, rank: int | None) -> dict:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.token_text(token_id, texts)}

        return [None] + [
            {
                str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank),
                **{str(t): entry(t, v, rank) for rank, (t, v) in enumerate(lp.top[:n], 1)},
            }
            for lp in d.prompt_logprobs
        ]


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
        vllm: VllmFields = PLAIN,
    ) -> None:
        """``tools``: how the model may call them (their format, and whether it may write text instead);
        ``thinks``: the template thinks; ``opened``: its prompt opened the thought already."""
        super().__init__(stream, obj, vllm)
        self._enveloped = False
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
        if reasoning:  # under both names: vLLM's reasoning, and reasoning_content as DeepSeek's API and SGLang
            delta = {"reasoning": reasoning, "reasoning_content": reasoning, **delta}
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
            **self.token_ids(choice),
            **({"stop_reason": choice.delta.stop_reason} if finish_reason is not None else {}),
        }

    def final_choice(self, choice: ChoiceDelta) -> dict:
        reasoning, answer = self._split(choice.index, choice.delta.text, final=True)
        message: dict = {"role": "assistant", "content": answer}
        if self._thoughts is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning or None
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
            "stop_reason": choice.delta.stop_reason,
            **self.token_ids(choice),
        }

    def abort_choice(self, index: int) -> dict:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": "abort"}

    def envelope(self, choices: list[dict], usage: dict | None = None) -> dict:
        """vLLM's prompt_token_ids, where asked for, in the first (a stream's first chunk, or the response)."""
        body = super().envelope(choices, usage)
        if self.vllm.return_token_ids and not self._enveloped:
            body["prompt_token_ids"] = self.prompt_ids[0]
        self._enveloped = True
        return body

    def response_fields(self, choices: dict[int, ChoiceDelta]) -> dict:
        """vLLM's prompt_logprobs, once for the conversation (every choice reads the same prompt)."""
        prompt_logprobs = self._prompt_logprobs(choices[0]) if choices else None
        return {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}

    def _logprobs(self, choice: ChoiceDelta) -> dict | None:
        if choice.delta.logprobs is None:
            return None
        texts = choice.token_texts

        def entry(token_id: int, logprob: float) -> dict:
            token = self.token_text(token_id, texts)
            # its own bytes, also where it holds part of a character; an id's, as vLLM gives them
            raw = token.encode() if self.vllm.return_tokens_as_token_ids else piece_bytes(texts.get(token_id, ""))
            return {"token": token, "logprob": logprob, "bytes": list(raw)}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in choice.delta.logprobs
            ]
        }


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
