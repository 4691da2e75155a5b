"""Request schemas of OpenAI's Responses API (pydantic), and their translation into a chat completion request: one
path from any API's request to the engine's SamplingParams."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, ValidationError, model_validator

from ...errors import APIError
from ..bodies.parsing import Refused, Request, parse
from ..bodies.refused import RESPONSES, RESPONSES_NESTED
from ..bodies.schemas import engine_field
from ..chat.schemas import ChatCompletionRequest, ParametersSchema, ReasoningEffort
from ..chat.tools import broken_tool_turn

INCLUDABLE = ("reasoning.encrypted_content",)  # asked by stateless clients; our reasoning items need no encryption


class InputMessage(Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict]

    def text(self, where: str) -> str:  # an earlier reply's refusal is its text, as chat reads it
        return content_text(self.content, ("input_text", "output_text", "text", "refusal"), f"{where}.content")


class FunctionCallItem(Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: str | None = None  # "incomplete": cut by the length limit, its arguments unfinished

    @model_validator(mode="after")
    def _json_arguments(self) -> FunctionCallItem:
        """A complete call's arguments are JSON, as a template reads them (a ValueError is a 400 naming the item)."""
        if self.status != "incomplete":  # an incomplete call is dropped, its arguments cut anywhere
            try:
                json.loads(self.arguments)
            except ValueError as exc:
                raise ValueError(f"arguments must be JSON text ({exc})") from None
        return self


class FunctionCallOutputItem(Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict]


class ReasoningItem(Request):
    """An earlier turn's thought: the next assistant message's reasoning_content, which templates that render past
    thoughts show (Qwen3's, between tool calls) and others drop."""

    type: Literal["reasoning"]
    content: list[dict] | None = None
    summary: list[dict] | None = None

    def text(self, where: str) -> str:
        if self.content:
            return content_text(self.content, ("reasoning_text", "summary_text"), f"{where}.content")
        return content_text(self.summary or [], ("reasoning_text", "summary_text"), f"{where}.summary")


ITEMS: dict[str, type[Request]] = {
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def content_text(content: str | list[dict], kinds: tuple[str, ...], where: str) -> str:
    """Text parts joined; a 400 naming the part for any other kind (images, files, audio)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in kinds:
            raise APIError(f"content parts of type {part.get('type')!r} are not supported", param=f"{where}.{j}")
        key = "refusal" if part["type"] == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise APIError(f"{where}.{j}.{key} must be a string", param=f"{where}.{j}.{key}")
        texts.append(part[key])
    return "\n".join(texts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """Input items as chat completion messages: consecutive function calls become one assistant message's tool
    calls, their outputs tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    thought = None  # a reasoning item's, for the assistant message after it
    for i, raw in enumerate(items):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if not isinstance(kind, str) or kind not in ITEMS:  # a list or an object is no key
            raise APIError(f"input items of type {kind!r} are not supported", param=f"input.{i}")
        try:
            item = ITEMS[kind].model_validate(raw)
        except ValidationError as exc:
            raise APIError(f"input.{i}: {exc.errors()[0]['msg']}", param=f"input.{i}") from None
        if isinstance(item, ReasoningItem):
            thought = item.text(f"input.{i}")
            continue
        if isinstance(item, FunctionCallItem) and item.status == "incomplete":
            continue  # a call cut short (an earlier response's last item): nothing ran, nothing answers it
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text(f"input.{i}")})
        elif isinstance(item, FunctionCallOutputItem):
            output = content_text(item.output, ("input_text", "output_text"), f"input.{i}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                messages.append(last := {"role": "assistant", "content": None})
            last["tool_calls"] = [*last.get("tool_calls", []), call]
        if thought is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = thought
        thought = None
    return messages


def unmatched_call(conversation: list[dict]) -> str | None:
    """In OpenAI's words, a function call output that answers no call before it, or the first call that no output
    answers (a conversation that a template would render as if the model had asked, or had been answered)."""
    called: list[str] = []
    answered: set[str] = set()
    for message in conversation:
        called += [call["id"] for call in message.get("tool_calls") or []]
        if message["role"] == "tool":
            if message["tool_call_id"] not in called:
                return f"No tool call found for function call output with call_id {message['tool_call_id']}."
            if message["tool_call_id"] in answered:
                return f"Duplicate function call output for call_id {message['tool_call_id']}."
            answered.add(message["tool_call_id"])
    unanswered = [call_id for call_id in called if call_id not in answered]
    if unanswered:
        return f"No tool output found for function call {unanswered[0]}."
    if (broken := broken_tool_turn(conversation)) is not None:  # the calls' outputs with a message between
        at = conversation[broken[0]]
        ids = [at["tool_call_id"]] if at["role"] == "tool" else [call["id"] for call in at["tool_calls"]]
        return f"Function call outputs must follow their function calls, no message between: call_id {', '.join(ids)}."
    return None


class FunctionTool(Request):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: ParametersSchema = None
    strict: StrictBool | None = None


class TextFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _a_schema_has_its_name_and_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):  # both required by OpenAI
            raise ValueError("a json_schema format needs its name and its schema")
        return self


class TextConfig(Request):
    format: TextFormat | None = None


class ReasoningConfig(Request):
    effort: ReasoningEffort | None = None  # as chat's reasoning_effort: the template's variable
    summary: str | None = None  # the thought comes whole, as reasoning_text, not summarized


# OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512 (a response's every event repeats them)
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
]


class ResponsesRequest(Request):
    refused = RESPONSES
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: StrictBool = True
    stream: StrictBool = False
    max_output_tokens: int | None = engine_field("max_tokens")
    temperature: float | None = engine_field("temperature")
    top_p: float | None = engine_field("top_p")
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    metadata: Metadata | None = None

    def as_chat(self, conversation: list[dict]) -> ChatCompletionRequest:
        """The same request as a chat completion of ``conversation`` (the previous response's, then this input)."""
        if bad := [x for x in self.include or [] if x not in INCLUDABLE]:
            raise APIError(f"include {bad[0]!r} is not supported", param="include")
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            **self.given(("model", "temperature", "top_p", "stream")),
            "messages": system + conversation,
            "max_tokens": self.max_output_tokens,
            "tools": self._tools(),
            "tool_choice": self._tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self._response_format(),
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
        }
        return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})

    def _tools(self) -> list[dict] | None:
        if self.tools is None:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise APIError(f"tools of type {tool.get('type')!r} are not supported", param=f"tools.{i}.type")
            try:
                function = FunctionTool.model_validate(tool).model_dump(exclude={"type"}, exclude_none=True)
            except ValidationError as exc:
                raise APIError(f"tools.{i}: {exc.errors()[0]['msg']}", param=f"tools.{i}") from None
            tools.append({"type": "function", "function": function})
        return tools

    def _tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError("tool_choice must be none, auto, required or a function by name", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}

    def _response_format(self) -> dict | None:
        spec = self.text.format if self.text is not None else None
        if spec is None or spec.type != "json_schema":
            return None if spec is None else {"type": spec.type}
        schema = {"name": spec.name or "output", "schema": spec.schema_, "strict": spec.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


# Chat completions' fields that a client may send here too (a set of parameters shared by both, extra_body): each
# changes the output and the Responses API has none of them (OpenAI's answer to each is a 400 too).
RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input"}
RENAMED |= {"response_format": "text.format", "reasoning_effort": "reasoning.effort"}
NO_OUTPUT = {"cache_salt", "keep_alive", "priority", "stream_options", "user"}  # chat's that change no output


def _chat_only(name: str) -> Refused:
    where = f"/v1/responses takes {RENAMED[name]}" if name in RENAMED else "/v1/chat/completions takes it"
    return Refused(f"{name} is a chat completion's field, not the Responses API's: {where}")


_CHAT_ONLY = set(ChatCompletionRequest.model_fields) - set(ResponsesRequest.model_fields) - NO_OUTPUT
ResponsesRequest.refused = {**{name: _chat_only(name) for name in sorted(_CHAT_ONLY)}, **RESPONSES}


def refuse_unsupported(body: object) -> None:
    """A 400 for a refused field of the body's objects (``RESPONSES_NESTED``); ``parse`` reads its own fields."""
    if not isinstance(body, dict):
        return
    for outer, fields in RESPONSES_NESTED.items():
        given = body.get(outer)
        for name, refusal in fields.items() if isinstance(given, dict) else ():
            if refusal.refuses(given.get(name)):
                raise APIError(refusal.reason, param=f"{outer}.{name}")
