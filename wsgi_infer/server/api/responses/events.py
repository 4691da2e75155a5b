"""A Responses API response built from the chat formatter's output: its output items (the thought, the text, each
function call) and the typed, numbered events that build them when streamed. Streamed or not, the items come
from the same code."""

from __future__ import annotations

import copy
import re
import time

from ....engine.outputs import CONSTRAINT_FAILED, CONSTRAINT_FAILED_MESSAGE
from ...engine_client.identity import ResponseIdentity
from ...engine_client.streams import RequestStream
from ...streaming import sse
from ..chat.formatters import reply_parts
from ..chat.tools import whole_arguments

# Per kind of text item: its id prefix, the content part it holds, and the names of its delta and done events.
TEXT_ITEMS = {
    "reasoning": ("rs", "reasoning_text", "response.reasoning_text"),
    "message": ("msg", "output_text", "response.output_text"),
}


def response_id(previous: str | None, ids: ResponseIdentity) -> str:
    """A response's id: 16 hex digits naming its conversation (those of the response it continues, or new ones),
    then 16 of its own. A proxy that hashes the conversation's digits (``scripts/nginx/wsgi-infer-hosts.conf``)
    sends every later turn of a conversation to one host, where its prefix is cached."""
    own = ids.hex()
    continued = previous is not None and re.fullmatch(r"resp_[0-9a-f]{32}", previous)
    return f"resp_{previous[5:21] if continued else own[16:]}{own[:16]}"


def usage(stream: RequestStream) -> dict:
    cached = stream.cached_tokens.get(0, 0)
    return {
        "input_tokens": stream.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": stream.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stream.prompt_tokens + stream.completion_tokens,
    }


def chunk_of(final_choice: dict) -> dict:
    """A chat completion's whole choice as one chunk, for a response that is not streamed."""
    message = final_choice["message"]
    calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls", []))]
    delta = {"reasoning_content": message.get("reasoning_content"), "content": message.get("content")}
    return {"delta": {**delta, "tool_calls": calls}, "finish_reason": final_choice["finish_reason"]}


class ResponseBuilder:
    """``response``: the response object, status in_progress and no output yet; ``feed`` grows its output."""

    def __init__(self, response: dict, ids: ResponseIdentity) -> None:
        self.response = response
        self._ids = ids  # its items' ids
        self._sequence = 0
        self._open: dict | None = None  # the item being written
        self._finish_reason: str | None = None  # the chat's, once it ended

    @property
    def output(self) -> list[dict]:
        return self.response["output"]

    def start(self) -> list[str]:
        snapshot = copy.deepcopy(self.response)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, chunk: dict | None) -> list[str]:
        """The events of one chat chunk (None: nothing to show yet)."""
        events = []
        for kind, value, name in reply_parts(chunk):
            if kind == "call":
                item = {"id": self._new_id("fc"), "type": "function_call", "call_id": value, "name": name}
                events += self._add({**item, "arguments": "", "status": "in_progress"})
            elif kind == "arguments":
                self._open["arguments"] += value
                events.append(self._item_event("response.function_call_arguments.delta", delta=value))
            else:
                item_type = "reasoning" if kind == "reasoning" else "message"
                if self._open is None or self._open["type"] != item_type:
                    events += self._start_text(item_type)
                events += self._text(value)
        if chunk is not None and chunk["finish_reason"] is not None:
            self._finish_reason = chunk["finish_reason"]
        return events

    def finish(self, stream: RequestStream) -> list[str]:
        """Close the last item; the response completed, incomplete where the length limit cut it, or failed where
        its constraint could not be completed."""
        if self._finish_reason == CONSTRAINT_FAILED:
            return self.fail(CONSTRAINT_FAILED_MESSAGE, "constraint_failed", stream)
        complete = self._finish_reason != "length"
        events = self._close("completed" if complete else "incomplete")
        self.response.update(status="completed" if complete else "incomplete", usage=usage(stream))
        if complete:  # OpenAI's: only on a response that completed
            self.response["completed_at"] = int(time.time())
        else:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        kind = "response.completed" if complete else "response.incomplete"
        return [*events, self._event(kind, response=copy.deepcopy(self.response))]

    def fail(self, message: str, code: str, stream: RequestStream) -> list[str]:
        events = self._close("incomplete")
        self.response.update(status="failed", error={"code": code, "message": message}, usage=usage(stream))
        return [*events, self._event("response.failed", response=copy.deepcopy(self.response))]

    def _start_text(self, kind: str) -> list[str]:
        prefix, part_type, _ = TEXT_ITEMS[kind]
        item = {"id": self._new_id(prefix), "type": kind, "status": "in_progress", "content": []}
        item.update(role="assistant") if kind == "message" else item.update(summary=[])
        events = self._add(item)
        part = {"type": part_type, "text": ""} | ({"annotations": [], "logprobs": []} if kind == "message" else {})
        item["content"].append(part)
        return [*events, self._item_event("response.content_part.added", content_index=0, part=copy.deepcopy(part))]

    def _text(self, text: str) -> list[str]:
        self._open["content"][0]["text"] += text
        _, _, name = TEXT_ITEMS[self._open["type"]]
        extra = {"logprobs": []} if self._open["type"] == "message" else {}
        return [self._item_event(f"{name}.delta", content_index=0, delta=text, **extra)]

    def _add(self, item: dict) -> list[str]:
        events = self._close("completed")
        self.output.append(item)
        self._open = item
        return [
            *events,
            self._event("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item)),
        ]

    def _close(self, status: str) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        events = []
        if item["type"] == "function_call":
            status = "completed" if whole_arguments(item["arguments"]) else "incomplete"  # whatever ended the response
            done = {"name": item["name"], "arguments": item["arguments"]}
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=len(self.output) - 1,
                    **done,
                )
            )
        else:
            part = item["content"][0]
            _, _, name = TEXT_ITEMS[item["type"]]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            at = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
            events.append(self._event(f"{name}.done", **at, text=part["text"], **extra))
            events.append(self._event("response.content_part.done", **at, part=copy.deepcopy(part)))
        item["status"] = status
        return [
            *events,
            self._event("response.output_item.done", output_index=len(self.output) - 1, item=copy.deepcopy(item)),
        ]

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}_{self._ids.hex()}"

    def _item_event(self, kind: str, **fields) -> str:
        return self._event(kind, item_id=self._open["id"], output_index=len(self.output) - 1, **fields)

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse.event(data, name=kind)
