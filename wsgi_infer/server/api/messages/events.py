"""Anthropic's Messages shapes of a chat's output, translated from the chat formatter's OpenAI ones: the message
(thinking, text and tool-use content blocks) and its streamed events."""

from __future__ import annotations

import json

from ...engine_client.streams import RequestStream
from ...streaming import sse
from ..chat.formatters import reply_parts
from ..chat.tools import whole_arguments

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str | None, stop_string: str | int | None) -> dict:
    """``stop_reason`` and ``stop_sequence``: a stop string that ended the text is named (a stop token is not a
    sequence)."""
    if finish_reason == "stop" and isinstance(stop_string, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_string}
    return {"stop_reason": STOP_REASONS.get(finish_reason or "stop", "end_turn"), "stop_sequence": None}


def usage(stream: RequestStream) -> dict:
    """Anthropic counts prompt tokens read from the cache apart from the others."""
    cached = stream.cached_tokens.get(0, 0)
    return {
        "input_tokens": stream.prompt_tokens - cached,
        "output_tokens": stream.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def message(message_id: str, model: str) -> dict:
    """The message before its content and usage (what ``message_start`` carries, and the body's frame)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
    }


def content_blocks(chat_message: dict, omit_thinking: bool = False) -> list[dict]:
    """A chat completion's message as content blocks: its thought (its text left out with ``omit_thinking``), its
    text, its tool calls."""
    blocks = []
    if chat_message.get("reasoning_content"):
        thought = "" if omit_thinking else chat_message["reasoning_content"]
        blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
    if chat_message.get("content"):
        blocks.append({"type": "text", "text": chat_message["content"]})
    for call in chat_message.get("tool_calls", []):
        function = call["function"]
        if not whole_arguments(function["arguments"]):
            continue  # cut by max_tokens: its input is no object yet (a stream shows the part that came)
        blocks.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": json.loads(function["arguments"])}
        )
    return blocks


class MessageEvents:
    """The streamed events of one message, from the chat formatter's chunks: a block opens where the kind of
    output changes (thought, text, each tool call), and closes before the next one opens. ``omit_thinking``: a
    thinking block opens and closes without deltas (Anthropic's ``thinking.display: "omitted"``)."""

    # Per kind of text part: its block, how the block starts, its delta's type.
    _TEXT_BLOCKS = {
        "reasoning": ("thinking", {"type": "thinking", "thinking": "", "signature": ""}, "thinking_delta"),
        "content": ("text", {"type": "text", "text": ""}, "text_delta"),
    }

    def __init__(self, omit_thinking: bool = False) -> None:
        self._omit_thinking = omit_thinking
        self._index = -1
        self._open: str | None = None  # the kind of the open block: "thinking", "text" or "tool_use"
        self.finish_reason: str | None = None  # the chat's, once it ended ("tool_calls" after calls)

    def of(self, chunk: dict | None) -> list[str]:
        """The events of one chat chunk (None: nothing to show yet)."""
        events = []
        for kind, value, name in reply_parts(chunk):
            if kind == "call":
                events += self._start("tool_use", {"type": "tool_use", "id": value, "name": name, "input": {}})
            elif kind == "arguments":
                events.append(self._delta({"type": "input_json_delta", "partial_json": value}))
            else:
                block, start, delta_type = self._TEXT_BLOCKS[kind]
                if self._open != block:
                    events += self._start(block, start)
                if not (kind == "reasoning" and self._omit_thinking):
                    events.append(self._delta({"type": delta_type, block: value}))
        if chunk is not None and chunk["finish_reason"] is not None:
            self.finish_reason = chunk["finish_reason"]
            events += self._stop()
        return events

    def _start(self, kind: str, block: dict) -> list[str]:
        events = self._stop()
        self._index, self._open = self._index + 1, kind
        return [*events, _event({"type": "content_block_start", "index": self._index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return _event({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _stop(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [_event({"type": "content_block_stop", "index": self._index})]


def opening(message_frame: dict) -> list[str]:
    return [_event({"type": "message_start", "message": message_frame}), _event({"type": "ping"})]


def closing(finish_reason: str | None, stop_string: str | None, stream: RequestStream) -> list[str]:
    """``message_delta`` with why the message ended and its usage, then ``message_stop``."""
    delta = {"type": "message_delta", "delta": stop_reason(finish_reason, stop_string), "usage": usage(stream)}
    return [_event(delta), _event({"type": "message_stop"})]


def _event(data: dict) -> str:
    return sse.event(data, name=data["type"])
