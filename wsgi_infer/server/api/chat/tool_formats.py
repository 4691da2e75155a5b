"""The formats model families write tool calls in, and which one a chat template asks for.

- Hermes/Qwen's, which most chat templates with tools use (and our own system prompt, where the template
  takes no tools)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city":"Paris"}}
      </tool_call>

- Llama 3.1 and 3.2's JSON, one call per reply (their template raises for more):
  ``{"name": "get_weather", "parameters": {"city":"Paris"}}``.
- Mistral's list after its ``[TOOL_CALLS]`` token: ``[TOOL_CALLS] [{"name": "get_weather", "arguments": {...}}]``.
- Phi-4-mini's list between its ``<|tool_call|>`` and ``<|/tool_call|>`` tokens.

The last two open with special tokens: the grammar asks for those very tokens (``<[text]>``, see
``engine/sampling/grammar.py``), and the reply's text keeps them, so that a call is told from text that merely looks
like one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...engine_client.identity import ResponseIdentity

_NAME = "[A-Za-z0-9_.-]+"


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes calls: ``{begin}`` then each ``{open}{"name": "f", "<arguments_key>": {...}}
    {close}``, apart by ``separator`` where it writes several, then ``{end}``."""

    name: str
    open: str
    close: str
    separator: str | None  # None: one call per reply
    arguments_key: str
    marker: str  # the regular expression that text starting a call matches (what "auto" text must not start with)
    begin: str = ""
    end: str = ""
    special: tuple[str, ...] = ()  # the special tokens among begin and end
    short_ids: bool = False  # call ids of 9 letters or digits, which Mistral's template checks

    def call(self, name: str, arguments: str) -> str:
        return f'{self.open}{{"name": "{name}", "{self.arguments_key}": {arguments}}}{self.close}'

    @property
    def call_start(self) -> str:
        """What each call's text starts with, up to its name."""
        return f'{self.open}{{"name": "'

    @property
    def start(self) -> str:
        """What a reply of calls starts with, up to the first one's name."""
        return self.begin + self.call_start

    def head(self) -> re.Pattern:
        """A call's text up to its arguments, its name the group."""
        return re.compile(f'{re.escape(self.call_start)}({_NAME})", "{self.arguments_key}": ')

    def call_id(self, ids: ResponseIdentity) -> str:
        return ids.hex(9) if self.short_ids else f"call_{ids.hex(24)}"

    def lark(self, text: str) -> str:
        """``text`` (begin or end) as a Lark sequence: its special tokens as tokens, the rest as literals."""
        if not self.special:
            return json.dumps(text, ensure_ascii=False) if text else ""
        parts = [part for part in re.split("(" + "|".join(map(re.escape, self.special)) + ")", text) if part]
        return " ".join(f"<[{p}]>" if p in self.special else json.dumps(p, ensure_ascii=False) for p in parts)


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments", "<tool_call>")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", None, "parameters", r'\{"name"')
MISTRAL = ToolFormat(
    "mistral", "", "", ", ", "arguments", r"\[TOOL_CALLS\]", "[TOOL_CALLS] [", "]", ("[TOOL_CALLS]",), True
)
PHI4_MINI = ToolFormat(
    "phi4_mini",
    "",
    "",
    ", ",
    "arguments",
    r"<\|tool_call\|>",
    "<|tool_call|>[",
    "]<|/tool_call|>",
    ("<|tool_call|>", "<|/tool_call|>"),
)
# Llama 3.1 / 3.2's template tells the model this (transformers' and Meta's copies alike).
_LLAMA3_MARK = '"parameters": dictionary of argument name and its value'


def tool_format_of(chat_template: str | None) -> ToolFormat:
    """The format a model's chat template asks for."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if template_tools(template) == "system message":
        return PHI4_MINI
    return LLAMA3_JSON if _LLAMA3_MARK in template else HERMES


# Phi-4-mini's template renders the tools of the system message's own field (a JSON string), not a ``tools`` list.
_SYSTEM_MESSAGE_TOOLS = re.compile(r"message\[['\"]tools['\"]\]|message\.tools\b")
PHI4_DEFAULT_SYSTEM = "You are a helpful assistant with some tools."  # Microsoft's example, where none is given


def template_tools(chat_template: str | None) -> str | None:
    """How a chat template takes tools: "list" (the ``tools`` variable), "system message" (Phi-4-mini), or None."""
    template = chat_template or ""
    if _SYSTEM_MESSAGE_TOOLS.search(template):
        return "system message"
    return "list" if "tools" in template else None


def with_tools_in_system_message(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation with the functions, as a JSON list, in its system message's ``tools`` field."""
    listing = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "tools": listing}, *messages[1:]]
    return [{"role": "system", "content": PHI4_DEFAULT_SYSTEM, "tools": listing}, *messages]
