"""Tool calling: what the model is told, what it may write, and how its text becomes calls.

Each model family writes calls in its own format (``tool_formats``), chosen by the chat template. With
``tool_choice`` "required" or a named function the output is constrained to such calls, whose arguments follow
each function's ``parameters`` schema (compact JSON). With "auto" the model may also write text, which must not
start as a call does; once it does start a call, the call is constrained. Tools go to the chat template when it
takes them; otherwise a system prompt of ours describes them and the format.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

from ....engine.sampling_params import StructuredOutput
from ...engine_client.identity import ResponseIdentity
from .tool_formats import HERMES, ToolFormat

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
    format: ToolFormat = HERMES

    def constraint(self, answer: StructuredOutput | None = None) -> StructuredOutput:
        """A Lark grammar: calls only, or (auto) text that is not a call, or calls. ``answer``: the JSON schema a
        reply that calls nothing follows (response_format beside tools, as OpenAI takes them)."""
        fmt, allowed = self.format, self.functions if self.mode in ("auto", "required") else [self._named()]
        key = json.dumps(fmt.arguments_key)
        rules = [
            f"fn_{i}: {_literal(fmt.call_start + f['name'] + chr(34) + ', ' + key + ': ')} %json {_schema(f)} "
            f"{_literal('}' + fmt.close)}"
            for i, f in enumerate(allowed)
        ]
        call = f"call: {' | '.join(f'fn_{i}' for i in range(len(allowed)))}"
        several = self.parallel and not self.named and fmt.separator is not None
        more = f" ({_literal(fmt.separator)} call)*" if several else ""
        calls = f"calls: {fmt.lark(fmt.begin)} call{more} {fmt.lark(fmt.end)}"
        text = f"start: TEXT | calls\nTEXT: /(.|\\n)+/ & ~/{fmt.marker}(.|\\n)*/"
        if answer is not None:
            text = f"start: answer | calls\nanswer: {answer.lark_json()}"
        start = text if self.mode == "auto" else "start: calls"
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
            f'{HERMES.open}{{"name": <tool name>, "arguments": <JSON object>}}{HERMES.close}'
        )

    def _named(self) -> dict:
        return next(f for f in self.functions if f["name"] == self.mode)


def _schema(function: dict) -> str:
    parameters = {"type": "object", **(function.get("parameters") or {})}  # an object where no type is given
    return json.dumps({**parameters, "x-guidance": _COMPACT}, ensure_ascii=False)


def _literal(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text, ensure_ascii=False)


def call_text(name: str, arguments: str) -> str:
    """A call as our system prompt asks for it (an assistant message in the history, for a template without
    tools: those that take tools render the calls themselves)."""
    return HERMES.call(name, arguments)


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

    Until the text can no longer become a call's start nothing is released; then
    it is either plain content, or calls whose arguments grow as they arrive (a
    call's arguments end where their JSON object closes). With ``calls_only``
    (tool_choice "required" or a named function) the text can only be calls: a
    choice cut before its first call's name is nothing, never content.
    """

    format: ToolFormat = HERMES
    ids: ResponseIdentity = field(default_factory=ResponseIdentity.new)  # its calls' ids
    calls_only: bool = False
    text: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    _content_sent: int = 0

    def feed(self, piece: str) -> dict:
        """The OpenAI ``delta`` for this piece: ``content`` or ``tool_calls``, or {} to hold."""
        self.text += piece
        if self.format.start.startswith(self.text):
            return {}
        return self.finish()

    def finish(self) -> dict:
        """The rest of the delta once the choice has ended: held-back text is content after all (unless only
        calls could follow)."""
        if self._is_calls:
            return self._call_deltas()
        if self.calls_only:
            return {}
        new, self._content_sent = self.text[self._content_sent :], len(self.text)
        return {"content": new} if new else {}

    @property
    def _is_calls(self) -> bool:
        return self.text.startswith(self.format.start)

    @property
    def content(self) -> str | None:
        """The whole text when the choice wrote text rather than calls."""
        return None if self._is_calls or self.calls_only else self.text

    @property
    def called(self) -> bool:
        """Whether the choice wrote calls, each of them whole."""
        return bool(self.calls) and all(call.complete for call in self.calls)

    def _call_deltas(self) -> dict:
        """One entry per call that grew, as OpenAI streams them: a new call's id and name come with the first
        of its arguments (clients merge entries across chunks by index, but read two of one index in one chunk
        as two calls)."""
        deltas, at, head = [], len(self.format.begin), self.format.head()
        for index in itertools.count():
            found = head.match(self.text, at)
            if found is None:
                break
            end = _object_end(self.text, found.end())
            arguments = self.text[found.end() : end]
            entry: dict = {"index": index, "function": {"arguments": ""}}
            if index == len(self.calls):
                self.calls.append(ParsedCall(self.format.call_id(self.ids), found.group(1), ""))
                entry = {"index": index, "id": self.calls[index].id, "type": "function", "function": {}}
                entry["function"] = {"name": found.group(1), "arguments": ""}
            call = self.calls[index]
            if len(arguments) > len(call.arguments):
                entry["function"]["arguments"], call.arguments = arguments[len(call.arguments) :], arguments
            call.complete = end is not None
            if "id" in entry or entry["function"]["arguments"]:
                deltas.append(entry)
            if end is None:
                break
            at = end + len("}" + self.format.close + (self.format.separator or ""))
        return {"tool_calls": deltas} if deltas else {}


def whole_arguments(arguments: str) -> bool:
    """Whether a call's arguments are whole (a call the length limit cut has a JSON object that does not parse)."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def _object_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``start`` ends (strings and nesting followed), or None: not yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = char == "\\", char != '"'
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def broken_tool_turn(messages: list[dict]) -> tuple[int, str] | None:
    """The first message that breaks OpenAI's rule for tool turns, and why: an assistant message's tool calls are
    answered by the tool messages right after it, one for each call, before anything else is said (a conversation
    may end on calls not yet answered). A template would render a broken history as if the model had asked."""
    waiting: set[str] | None = None  # the calls of the assistant message before, not answered yet
    asked_at = 0
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if waiting is None:
                return i, "a tool message must answer a tool call of the assistant message before it"
            if call_id is None and None not in waiting:
                return i, "a tool message needs the tool_call_id it answers"
            if call_id not in waiting:
                return i, f"tool_call_id {call_id!r} names no unanswered tool call of the assistant message before it"
            waiting.discard(call_id)
            continue
        if waiting:
            return asked_at, _unanswered(waiting)
        calls = message.get("tool_calls") or []
        waiting, asked_at = ({call.get("id") for call in calls} if calls else None), i
    if waiting and asked_at < len(messages) - 1:
        return asked_at, _unanswered(waiting)
    return None


def _unanswered(calls: set[str | None]) -> str:
    ids = ", ".join(sorted(str(call_id) for call_id in calls))
    return f"an assistant message's tool calls must each be answered by a tool message after it; none answers {ids}"


def merge_call_entries(entries: list[dict]) -> list[dict]:
    """Entries of one chunk, one per index: a later entry's arguments appended to the earlier one's."""
    merged: dict[int, dict] = {}
    for entry in entries:
        if entry["index"] not in merged:
            merged[entry["index"]] = {**entry, "function": dict(entry["function"])}
        else:
            merged[entry["index"]]["function"]["arguments"] += entry["function"].get("arguments", "")
    return list(merged.values())
