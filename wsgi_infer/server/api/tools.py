"""Tool calling: what the model is told, what it may write, and how its text becomes calls.

One format, the Hermes/Qwen convention that many chat models are trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city":"Paris"}}
    </tool_call>

With ``tool_choice`` "required" or a named function the output is constrained
to such calls, whose arguments follow each function's ``parameters`` schema
(compact JSON). With "auto" the model may also write text, which must not
start with ``<tool_call>``; once it does start a call, the call is constrained.
Tools go to the chat template when it takes them; otherwise a system prompt
of ours describes them and the format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ...engine.sampling_params import StructuredOutput

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_HEAD = re.compile(r'<tool_call>\n\{"name": "([A-Za-z0-9_.-]+)", "arguments": ')
_ARGS_END = "}" + CALL_CLOSE  # the wrapper's brace, then the closing tag
_COMPACT = {"whitespace_flexible": False}  # arguments as compact JSON, as OpenAI sends them


@dataclass
class ToolPlan:
    """The tools a request offers and how it lets the model use them.

    ``functions`` are OpenAI function definitions (name, description, parameters);
    ``mode`` is "auto", "required" or the one function's name that must be called.
    """

    functions: list[dict]
    mode: str
    parallel: bool = True

    def constraint(self) -> StructuredOutput:
        """A Lark grammar: calls only, or (auto) text that is not a call, or calls."""
        allowed = self.functions if self.mode in ("auto", "required") else [self._named()]
        rules = [
            f'fn_{i}: "{{\\"name\\": \\"{f["name"]}\\", \\"arguments\\": " %json {_schema(f)} "}}"'
            for i, f in enumerate(allowed)
        ]
        call = f'call: "<tool_call>\\n" ({" | ".join(f"fn_{i}" for i in range(len(allowed)))}) "\\n</tool_call>"'
        calls = 'calls: call ("\\n" call)*' if self.parallel and not self.named else "calls: call"
        start = (
            "start: TEXT | calls\nTEXT: /(.|\\n)+/ & ~/<tool_call>(.|\\n)*/" if self.mode == "auto" else "start: calls"
        )
        return StructuredOutput("grammar", "\n".join([start, calls, call, *rules]), source="tools")

    @property
    def named(self) -> bool:
        """tool_choice named one function: exactly one call of it, whatever parallel_tool_calls says (as OpenAI
        and vLLM do; clients that take structured output through a forced function rely on it)."""
        return self.mode not in ("auto", "required")

    def system_prompt(self) -> str:
        """For chat templates that do not take tools: the tools and the call format."""
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in self.functions)
        how = "call one or more of them" if self.parallel and not self.named else "call one of them"
        return (
            f"You have access to these tools:\n{listing}\n\nTo {how}, reply with nothing but, for each call:\n"
            f'{CALL_OPEN}{{"name": <tool name>, "arguments": <JSON object>}}{CALL_CLOSE}'
        )

    def _named(self) -> dict:
        return next(f for f in self.functions if f["name"] == self.mode)


def _schema(function: dict) -> str:
    parameters = function.get("parameters") or {"type": "object"}
    return json.dumps({**parameters, "x-guidance": _COMPACT}, ensure_ascii=False)


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (for an assistant message in the history)."""
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": {arguments}}}{CALL_CLOSE}'


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # as much as is certain so far
    complete: bool = False

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallParser:
    """One choice's text, fed piece by piece, split into content and tool calls.

    Until the text can no longer become ``<tool_call>`` nothing is released; then
    it is either plain content, or calls whose arguments grow as they arrive.
    """

    text: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    _content_sent: int = 0

    def feed(self, piece: str) -> dict:
        """The OpenAI ``delta`` for this piece: ``content`` or ``tool_calls``, or {} to hold."""
        self.text += piece
        if CALL_OPEN.startswith(self.text):
            return {}
        return self.finish()

    def finish(self) -> dict:
        """The rest of the delta once the choice has ended: held-back text is content after all."""
        if self.text.startswith(CALL_OPEN):
            return self._call_deltas()
        new, self._content_sent = self.text[self._content_sent :], len(self.text)
        return {"content": new} if new else {}

    @property
    def content(self) -> str | None:
        """The whole text when the choice wrote text rather than calls."""
        return None if self.text.startswith(CALL_OPEN) else self.text

    def _call_deltas(self) -> dict:
        """One entry per call that grew, as OpenAI streams them: a new call's id and name come with the first
        of its arguments (clients merge entries across chunks by index, but read two of one index in one chunk
        as two calls)."""
        deltas = []
        for index, head in enumerate(_HEAD.finditer(self.text)):
            start = head.end()
            end = self.text.find(_ARGS_END, start)
            arguments = self.text[start:end] if end >= 0 else _without_partial_end(self.text[start:])
            entry: dict = {"index": index, "function": {"arguments": ""}}
            if index == len(self.calls):
                self.calls.append(ParsedCall(f"call_{uuid.uuid4().hex[:24]}", head.group(1), ""))
                entry = {"index": index, "id": self.calls[index].id, "type": "function", "function": {}}
                entry["function"] = {"name": head.group(1), "arguments": ""}
            call = self.calls[index]
            if len(arguments) > len(call.arguments):
                entry["function"]["arguments"], call.arguments = arguments[len(call.arguments) :], arguments
            call.complete = end >= 0
            if "id" in entry or entry["function"]["arguments"]:
                deltas.append(entry)
        return {"tool_calls": deltas} if deltas else {}


def merge_call_entries(entries: list[dict]) -> list[dict]:
    """Entries of one chunk, one per index: a later entry's arguments appended to the earlier one's."""
    merged: dict[int, dict] = {}
    for entry in entries:
        if entry["index"] not in merged:
            merged[entry["index"]] = {**entry, "function": dict(entry["function"])}
        else:
            merged[entry["index"]]["function"]["arguments"] += entry["function"].get("arguments", "")
    return list(merged.values())


def _without_partial_end(arguments: str) -> str:
    """Hold back a tail that may be the start of the wrapper's end rather than argument text."""
    for n in range(min(len(_ARGS_END), len(arguments)), 0, -1):
        if _ARGS_END.startswith(arguments[-n:]):
            return arguments[:-n]
    return arguments
