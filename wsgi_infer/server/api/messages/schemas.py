"""Request schemas of Anthropic's Messages API (pydantic), and their translation into a chat completion request:
one path from any API's request to the engine's SamplingParams."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, StrictBool, ValidationError

from ...errors import APIError
from ..bodies.parsing import Request, parse
from ..bodies.refused import MESSAGES
from ..bodies.schemas import MAX_STOP_SEQUENCES, engine_field
from ..chat.schemas import FUNCTION_NAME, ChatCompletionRequest, ObjectSchema
from .blocks import (
    MessageParam,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    check_all_answered,
    check_tool_results,
)

# The chat completion's fields beyond Anthropic's that this route takes too, under the same names.
EXTENSIONS = (
    "seed",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "logit_bias",
    "structured_outputs",
)


class ToolParam(Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: ObjectSchema
    type: Literal["custom"] | None = None


class ToolChoiceParam(Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class ThinkingParam(Request):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks without their text


class JsonOutputFormat(Request):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Request):
    """Structured output; ``effort`` is a hint to Claude's thinking budget, which no model here has (one of
    Anthropic's values all the same: a client that sends another has a bug to hear of)."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(Request):
    refused = MESSAGES
    model: str
    max_tokens: int = Field(ge=1)  # Anthropic's bound (a chat completion's 0 only reads the prompt)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = engine_field("top_p")
    top_k: int | None = engine_field("top_k")
    stream: StrictBool = False
    tools: list[dict] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-outputs beta's name for output_config.format

    @property
    def thinking_omitted(self) -> bool:
        """``thinking.display: "omitted"``: thinking blocks come without their text."""
        return self.thinking is not None and self.thinking.display == "omitted"

    def as_chat(self, extensions: dict | None = None) -> ChatCompletionRequest:
        """The same request as a chat completion, which the engine's path takes from here; ``extensions``: the
        body's ``EXTENSIONS``."""
        messages = self._messages()
        # an assistant's text last is a prefill, which the reply continues (Anthropic's rule)
        prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
        if prefill and (messages[-1]["content"] or "").rstrip() != (messages[-1]["content"] or ""):
            last = f"messages.{len(self.messages) - 1}"  # Anthropic's rule: its tokens would end in a lone space
            why = "final assistant content cannot end with trailing whitespace"
            raise APIError(f"{last}: {why}", param=f"{last}.content")
        body: dict[str, Any] = {
            **(extensions or {}),
            **self.given(("model", "max_tokens", "temperature", "top_p", "top_k", "stream")),
            "messages": messages,
            "stop": self.stop_sequences,
            "tools": self._tools(),
            "stream_options": {"include_usage": True} if self.stream else None,
            "chat_template_kwargs": self._template_kwargs(),
            "continue_final_message": prefill or None,
        }
        if (output := self._output_format()) is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": output}}
        if self.tool_choice is not None:
            choice = self.tool_choice
            if choice.type == "tool" and not choice.name:
                raise APIError("tool_choice of type tool needs a name", param="tool_choice.name")
            named = {"type": "function", "function": {"name": choice.name}}
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none", "tool": named}[choice.type]
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})

    def _messages(self) -> list[dict]:
        """Chat completion messages: a user's tool results become tool messages, an assistant's tool uses its
        tool calls (their input as JSON text)."""
        system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system or [])
        messages = [{"role": "system", "content": system}] if system else []
        # The tool uses of the turn before this one that this turn has not answered (the only ones a result may
        # answer), this turn's own, and its first message: consecutive messages of one role are one turn
        unanswered: set[str] = set()
        uses: set[str] = set()
        first = 0
        for i, message in enumerate(self.messages):
            if not message.content and not (message.role == "assistant" and i == len(self.messages) - 1):
                raise APIError(  # Anthropic's rule: an empty user message is no turn to skip silently
                    f"messages.{i}: all messages must have non-empty content except for the optional final "
                    "assistant message",
                    param=f"messages.{i}.content",
                )
            texts, calls, thoughts = [], [], []
            blocks = message.blocks(f"messages.{i}.content")
            if i > 0 and self.messages[i - 1].role != message.role:  # a turn of its own
                check_all_answered(first, i - 1, unanswered)
                unanswered, uses, first = uses, set(), i
            unanswered -= check_tool_results(i, blocks, unanswered)
            for block in blocks:
                if isinstance(block, ThinkingBlock):
                    thoughts.append(block.thinking)
                elif isinstance(block, ToolResultBlock):
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
                elif isinstance(block, ToolUseBlock):
                    arguments = json.dumps(block.input, ensure_ascii=False)
                    calls.append(
                        {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
                    )
                else:
                    texts.append(block.text)
            uses |= {call["id"] for call in calls}
            if texts or calls or not isinstance(message.content, list):
                entry: dict = {"role": message.role, "content": "\n".join(texts) if texts or not calls else None}
                if calls:
                    entry["tool_calls"] = calls
                if thoughts:
                    entry["reasoning_content"] = "".join(thoughts)
                _add_turn(messages, entry)
        check_all_answered(first, len(self.messages) - 1, unanswered)
        if all(m["role"] == "system" for m in messages):  # thoughts alone, or an empty prefill: nothing to answer
            raise APIError(
                "messages: at least one message with text, a tool use or a tool result is required", param="messages"
            )
        return messages

    def _output_format(self) -> dict | None:
        """The JSON schema of output_config.format, or of the beta's output_format: one of them."""
        formats = [f for f in (self.output_config and self.output_config.format, self.output_format) if f is not None]
        if len(formats) > 1:
            raise APIError("output_format is output_config.format's beta name: send one of them", param="output_format")
        return formats[0].schema_ if formats else None

    def _tools(self) -> list[dict] | None:
        if self.tools is None:
            return None
        functions = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") not in (None, "custom"):
                raise APIError(f"built-in tools ({tool['type']!r}) are not supported", param=f"tools.{i}.type")
            try:
                spec = ToolParam.model_validate(tool)
            except ValidationError as exc:
                raise APIError(f"tools.{i}: {exc.errors()[0]['msg']}", param=f"tools.{i}") from None
            function = {"name": spec.name, "description": spec.description, "parameters": spec.input_schema}
            functions.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
        return functions

    def _template_kwargs(self) -> dict | None:
        """Thinking switched off where asked; a budget cannot be kept, so asking for one is a 400."""
        if self.thinking is None or self.thinking.type in ("adaptive", "between_tools"):
            return None
        if self.thinking.type == "disabled":
            return {"enable_thinking": False}
        raise APIError(
            'thinking budgets are not supported; a thinking model thinks unless thinking is {"type": "disabled"}',
            param="thinking",
        )


def _add_turn(messages: list[dict], entry: dict) -> None:
    """Append ``entry``, or join it to the turn before when that is the same role's: Anthropic combines consecutive
    user or assistant turns into one, as their blocks in one message (a template that needs roles to alternate,
    Gemma's, refused them)."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != entry["role"] or entry["role"] not in ("user", "assistant"):
        messages.append(entry)
        return
    texts = [text for text in (last["content"], entry["content"]) if text]
    last["content"] = "\n".join(texts) if texts or not (last.get("tool_calls") or entry.get("tool_calls")) else None
    for field in ("tool_calls", "reasoning_content"):
        if field in entry:
            last[field] = last.get(field, type(entry[field])()) + entry[field]


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # not part of this request: a conversation's tokens do not depend on it


def extensions_of(body: object) -> dict:
    """The body's ``EXTENSIONS``."""
    return {name: body[name] for name in EXTENSIONS if name in body} if isinstance(body, dict) else {}
