"""The content blocks of Anthropic's Messages API (pydantic), each role's, and Anthropic's rules for the tool uses
and results in a conversation's turns, in its words."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, ValidationError

from ...errors import APIError
from ..bodies.parsing import Request


class TextBlock(Request):
    type: Literal["text"]
    text: str


class ToolUseBlock(Request):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict


class ToolResultBlock(Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict] = ""
    is_error: StrictBool = False

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b["text"] for b in self.content)
        return f"Error: {text}" if self.is_error else text

    def checked(self, where: str) -> ToolResultBlock:
        """Itself, its content's blocks each text (a 400 naming the block for another type)."""
        for k, block in enumerate([] if isinstance(self.content, str) else self.content):
            _typed_block(block, {"text": TextBlock}, "tool_result", f"{where}.content.{k}")
        return self


class ThinkingBlock(Request):
    """An earlier turn's thought: its message's reasoning_content, which templates that render past thoughts show
    (Qwen3's, between tool calls) and others drop."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


# Which blocks each role may send. A redacted thought holds no text: dropped.
BLOCKS: dict[str, dict[str, type[Request] | None]] = {
    "user": {"text": TextBlock, "tool_result": ToolResultBlock},
    "assistant": {"text": TextBlock, "tool_use": ToolUseBlock, "thinking": ThinkingBlock, "redacted_thinking": None},
}


class MessageParam(Request):
    role: Literal["user", "assistant"]
    content: str | list[dict]

    def blocks(self, where: str) -> list[Request]:
        """The content as typed blocks; a 400 naming the block for a type we do not take."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        kinds = BLOCKS[self.role]
        blocks = [_typed_block(block, kinds, self.role, f"{where}.{i}") for i, block in enumerate(self.content)]
        return [block for block in blocks if block is not None]


def _typed_block(block: object, kinds: dict[str, type[Request] | None], whose: str, where: str) -> Request | None:
    """``block`` as the schema its type names in ``kinds`` (None: a block dropped); a 400 naming it for another type."""
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str) or kind not in kinds:  # a list or an object is no key
        raise APIError(f"{whose} content blocks of type {kind!r} are not supported", param=where)
    if (schema := kinds[kind]) is None:
        return None
    try:
        typed = schema.model_validate(block)
    except ValidationError as exc:
        raise APIError(f"{where}: {exc.errors()[0]['msg']}", param=where) from None
    return typed.checked(where) if isinstance(typed, ToolResultBlock) else typed


def check_tool_results(i: int, blocks: list, asked: set[str]) -> set[str]:
    """Anthropic's rules for message ``i`` of a conversation, ``asked`` the tool uses of the turn before that its turn
    has not answered yet (in its words): its tool_result blocks come first, each answers one of them. The ids it
    answers."""
    results = [j for j, block in enumerate(blocks) if isinstance(block, ToolResultBlock)]
    for key, kind in (("tool_use_id", ToolResultBlock), ("id", ToolUseBlock)):
        ids = [getattr(block, key) for block in blocks if isinstance(block, kind)]
        if len(set(ids)) < len(ids):  # one answer per use, one use per id: a template would show two as one
            twice = next(name for name in ids if ids.count(name) > 1)
            unique = "tool_use ids must be unique"
            what = "each tool_use must have a single result" if kind is ToolResultBlock else unique
            raise APIError(f"messages.{i}.content: {what}; found {twice!r} twice", param=f"messages.{i}.content")
    for j in results:
        if blocks[j].tool_use_id not in asked:
            raise APIError(
                f"messages.{i}.content.{j}: unexpected tool_use_id found in tool_result blocks: "
                f"{blocks[j].tool_use_id}. Each tool_result block must have a corresponding tool_use block in the "
                "previous message.",
                param=f"messages.{i}.content.{j}.tool_use_id",
            )
    if results != list(range(len(results))):
        raise APIError(
            f"messages.{i}.content: tool_result blocks must come first in the content, before any other block",
            param=f"messages.{i}.content",
        )
    return {blocks[j].tool_use_id for j in results}


def check_all_answered(first: int, last: int, unanswered: set[str]) -> None:
    """The turn of messages ``first`` to ``last`` (consecutive messages of one role are one turn, as Anthropic's API
    joins them) answered every tool use of the turn before it."""
    if unanswered:
        raise APIError(
            f"messages.{first - 1}: `tool_use` ids were found without `tool_result` blocks immediately after: "
            f"{', '.join(sorted(unanswered))}. Each `tool_use` block must have a corresponding `tool_result` block "
            "in the next message.",
            param=f"messages.{last}.content",
        )
