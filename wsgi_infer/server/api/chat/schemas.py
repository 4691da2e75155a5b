"""Request schemas of chat completions (pydantic): messages, tools and tool choice, and how a conversation reaches
the chat template (tool traffic as text where the template knows no tools)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, PrivateAttr, StrictBool, ValidationInfo, field_validator, model_validator

from ....engine.sampling_params import StructuredOutput
from ...errors import APIError
from ..bodies.parsing import Request
from ..bodies.refused import OPENAI_CHAT, SAMPLING, VLLM_CHAT
from ..bodies.schemas import SamplingRequest, engine_field
from .tool_formats import template_tools, tool_format_of, with_tools_in_system_message
from .tools import ToolPlan, broken_tool_turn, call_text

# OpenAI's efforts (its SDK's ReasoningEffort); "none" switches a thinking model's thought off (``enable_thinking``)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


def _object_schema(schema: dict | None) -> dict | None:
    """A function's parameters: an object's schema, as OpenAI's rule has it (a call's arguments are an object)."""
    if schema and schema.get("type", "object") != "object":
        raise ValueError(f'must be a JSON Schema of type "object", not {json.dumps(schema["type"])}')
    return schema


ObjectSchema = Annotated[dict, AfterValidator(_object_schema)]
ParametersSchema = ObjectSchema | None
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDefinition(Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: ParametersSchema = None
    strict: StrictBool | None = None


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(Request):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, value: str) -> str:
        json.loads(value)  # a ValueError is a 400 naming this field
        return value


class ToolCall(Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None  # the speaker's, which OpenAI shows the model: the templates that read it render it
    refusal: str | None = None  # an assistant's refusal, as OpenAI's replies carry it: its text where it has no content
    # An assistant's thought sent back, under either name: templates that think render it for the turns after the
    # last user message (Qwen3's interleaved thinking, between tool calls)
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _says_something(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise ValueError(f"{self.role} messages need content" + (" or tool_calls" * (self.role == "assistant")))
        return self

    @property
    def text(self) -> str:
        """Content parts flattened to text (text parts, and an assistant's refusal parts, as OpenAI's replies sent
        back carry them; other modalities are refused)."""
        if not isinstance(self.content, list):
            return self.content if self.content is not None else self.refusal or ""
        texts = []
        for part in self.content:
            kind = "refusal" if self.role == "assistant" and part.get("type") == "refusal" else "text"
            if part.get("type") != kind:
                raise APIError(f"content parts of type {part.get('type')!r} are not supported", param="messages")
            texts.append(part[kind])  # a string (``ChatCompletionRequest._text_parts``)
        return "\n".join(texts)  # as vLLM joins text parts


class ChatCompletionRequest(SamplingRequest):
    refused = {**SAMPLING, **OPENAI_CHAT, **VLLM_CHAT}
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = engine_field("max_tokens")  # None: up to the end of the context window
    max_completion_tokens: int | None = engine_field("max_tokens")
    logprobs: StrictBool = False
    top_logprobs: int | None = engine_field("logprobs")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None  # the template's variables, as vLLM takes them
    continue_final_message: StrictBool = False  # vLLM's: the reply continues the last message, an assistant's
    add_generation_prompt: StrictBool = True  # vLLM's: false, the template opens no reply (the model may)
    reasoning_effort: ReasoningEffort | None = None  # the template's variable, as vLLM passes it
    _chat_template: str | None = PrivateAttr(default=None)  # the model's (``render_with``)

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools must have distinct names")
        return tools

    @model_validator(mode="after")
    def _effort_as_the_templates_variable(self) -> ChatCompletionRequest:
        """reasoning_effort as the template's variable, as vLLM passes it (gpt-oss's reads it; a template that does
        not, ignores it), and "none" also as enable_thinking false (Qwen3's); the request's own kwargs win."""
        if self.reasoning_effort is not None:
            effort = {"reasoning_effort": self.reasoning_effort}
            off = {"enable_thinking": False} if self.reasoning_effort == "none" else {}
            self.chat_template_kwargs = {**effort, **off, **(self.chat_template_kwargs or {})}
        return self

    @model_validator(mode="after")
    def _text_parts(self) -> ChatCompletionRequest:
        """A 400 naming a text part whose text is no string (parts are untyped dicts: ``ChatMessage.text``)."""
        for i, message in enumerate(self.messages):
            if message.content == []:  # OpenAI's 400 too: no text, and no way to tell what was meant
                raise APIError(f"messages.{i}.content is an empty list of parts", param=f"messages.{i}.content")
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                kind = part.get("type")
                if kind in ("text", "refusal") and not isinstance(part.get(kind), str):
                    where = f"messages.{i}.content.{j}.{kind}"
                    raise APIError(f"{where} must be a string", param=where)
        return self

    @model_validator(mode="after")
    def _continues_an_assistant(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError("continue_final_message needs an assistant message last", param="continue_final_message")
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in self.model_fields_set
        ):
            message = "add_generation_prompt true opens a new reply, and continue_final_message continues the last one"
            raise APIError(f"{message}: set add_generation_prompt false, as vLLM asks", param="add_generation_prompt")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_plan(self) -> ToolPlan | None:
        """How the model may call the tools; None when it may not (no tools, or tool_choice none)."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if not self.tools:
            if choice != "none":
                raise APIError("tool_choice needs tools", param="tool_choice")
            return None
        if choice == "none":
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        mode = choice if isinstance(choice, str) else choice.function.name
        if mode not in ("auto", "required") and mode not in {f["name"] for f in functions}:
            raise APIError(f"tool_choice names {mode!r}, which is not among the tools", param="tool_choice")
        if self.logprobs:
            raise APIError("logprobs are not supported together with tool calls", param="logprobs")
        return ToolPlan(functions, mode, self.parallel_tool_calls, tool_format_of(self._chat_template))

    def render_with(self, chat_template: str | None) -> None:
        """The model's chat template, before the conversation or the plan is read: how it takes tools, and the
        format of the calls it asks for."""
        self._chat_template = chat_template

    def constraint(self) -> StructuredOutput | None:
        plan = self.tool_plan
        if plan is None:
            return super().constraint()
        if others := [name for name in self.constraints_given if name != "response_format"]:
            raise APIError(f"{others[0]} needs tool_choice none", param="tool_choice")
        answer = self.response_format.constraint() if self.response_format is not None else None
        return plan.constraint(answer)

    def conversation(self) -> tuple[list[dict], list[dict] | None]:
        """The messages for the chat template, and the tools to pass it (when it takes them as a list; Phi-4-mini's
        reads them from the system message)."""
        if broken := broken_tool_turn([m.model_dump() for m in self.messages]):
            i, why = broken
            field = "tool_call_id" if self.messages[i].role == "tool" else "tool_calls"
            raise APIError(f"messages.{i}: {why}", param=f"messages.{i}.{field}")
        plan, takes = self.tool_plan, template_tools(self._chat_template)
        # OpenAI's developer messages are its system messages: a template that knows no such role renders it as
        # its own (SmolLM2's put its default system prompt before it)
        template = self._chat_template or ""
        developer = "developer" if "'developer'" in template or '"developer"' in template else "system"
        messages = [_template_message(m, takes is not None, developer) for m in self.messages]
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []] or None
        if takes == "system message" and plan is not None:
            return with_tools_in_system_message(messages, tools), None
        if plan is None or takes is not None:
            return messages, tools
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{plan.system_prompt()}"}
        else:
            messages.insert(0, {"role": "system", "content": plan.system_prompt()})
        return messages, None


def _template_message(message: ChatMessage, template_takes_tools: bool, developer: str) -> dict:
    """One message as chat templates take it (a developer's under the role ``developer``); its name, and an
    assistant's thought under both names, as vLLM passes them."""
    entry = _entry(message, template_takes_tools)
    if entry["role"] == "developer":
        entry["role"] = developer
    if message.name is not None and (message.role != "tool" or template_takes_tools):  # a tool result as text: none
        entry["name"] = message.name
    thought = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if message.role == "assistant" and thought is not None:
        entry["reasoning_content"] = entry["reasoning"] = thought
    return entry


def _entry(message: ChatMessage, template_takes_tools: bool) -> dict:
    """Role and content; tool traffic as text when the template knows none."""
    if template_takes_tools:
        entry: dict = {"role": message.role, "content": message.text}
        if message.tool_calls:
            # Templates take arguments as an object, as transformers documents; Mistral's also reads the id.
            entry["tool_calls"] = [
                {
                    "type": "function",
                    **({"id": call.id} if call.id else {}),
                    "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        return entry
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.text}\n</tool_response>"}
    calls = "\n".join(call_text(c.function.name, c.function.arguments) for c in message.tool_calls or [])
    return {"role": message.role, "content": "\n".join(t for t in (message.text, calls) if t)}


class TokenizeChatRequest(ChatCompletionRequest):
    """/tokenize with ``messages``: the chat template applied, as a chat completion would."""

    return_token_strs: StrictBool = False
