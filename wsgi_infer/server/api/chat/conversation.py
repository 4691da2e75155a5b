"""A conversation started on the engine: what /v1/chat/completions and Anthropic's /v1/messages share."""

from __future__ import annotations

import json
from dataclasses import replace

from ....engine.text.chat_template import THINK_CLOSE, THINK_OPEN, chat_prompt_ids
from ...engine_client.prompts import Chat
from ...engine_client.served_model import ServedModel
from ...engine_client.streams import RequestStream
from ..serving import require_task, served, start
from .formatters import ChatFormatter, VllmFields
from .schemas import ChatCompletionRequest


def _rendered(req: ChatCompletionRequest) -> tuple[ServedModel, list[dict], list[dict] | None]:
    """The model, and the conversation and tools as its chat template takes them."""
    model = served(req.model, req.keep_alive)
    require_task(model, "generate")  # the template is known once the front end's tokenizer is
    req.render_with(model.tokenizer.chat_template)
    return model, *req.conversation()


def chat_token_ids(req: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids, as a chat completion would submit them (on the front-end thread)."""
    model, messages, tools = _rendered(req)
    args = (messages, tools, req.add_generation_prompt, req.chat_template_kwargs, req.continue_final_message)
    return model.with_tokenizer(chat_prompt_ids, *args)


def start_chat(req: ChatCompletionRequest, obj: str) -> tuple[RequestStream, ChatFormatter]:
    """Render the conversation with the model's template, submit it, and the formatter of its output (``obj``:
    the object name of what it formats)."""
    mgr, messages, tools = _rendered(req)
    params = req.sampling_params(req.max_new_tokens, req.num_logprobs)
    thinks = mgr.template_thinks
    opened = thinks and req.add_generation_prompt and mgr.opens_thought(req.chat_template_kwargs)  # it may raise
    for p in params:  # a thinking model's thought is free, its answer constrained (unless the constraint spells it)
        spec = p.structured_output
        if thinks and spec is not None and not any(tag in json.dumps(spec.value) for tag in (THINK_OPEN, THINK_CLOSE)):
            p.structured_output = replace(spec, after_thought=True)
    plan = req.tool_plan
    for p in params if plan is not None and plan.format.special else ():
        p.skip_special_tokens = False  # the format's own tokens tell its calls from text: the parser reads them
    chat = Chat(messages, tools, req.chat_template_kwargs, req.continue_final_message, req.add_generation_prompt)
    stream = start(mgr, [chat], params)
    return stream, ChatFormatter(stream, obj, plan, thinks=thinks, opened=opened, vllm=VllmFields.of(req))
