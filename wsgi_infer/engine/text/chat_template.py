"""A conversation as token ids, through the tokenizer's own chat template (no torch: the server's front end uses
it too)."""

from __future__ import annotations

import inspect

from ..sampling_params import InvalidParameter

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # a thinking model's thought (Qwen3, SmolLM3, R1 distills)


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template's replies may open with a thought in ``<think>…</think>``."""
    return bool(chat_template) and THINK_OPEN in chat_template and THINK_CLOSE in chat_template


def opens_thought(tokenizer, template_kwargs: dict | None = None) -> bool:
    """Whether the template's generation prompt itself opens the thought (DeepSeek-R1's, Qwen3's thinking-only
    templates end it with ``<think>``): the reply then starts inside it, with ``</think>`` alone."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "?"}], add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
    except Exception:  # a template that refuses this conversation renders the request's own, or fails there
        return False
    return text.rstrip().endswith(THINK_OPEN)


def chat_prompt_ids(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, with ``template_kwargs`` as its
    variables (``enable_thinking``...); with ``continue_final_message``, ending inside its last (assistant) message,
    which the reply continues, instead of opening a new one. InvalidParameter naming ``messages`` or
    ``chat_template_kwargs``."""
    if not tokenizer.chat_template:
        raise InvalidParameter("messages", "messages: this model has no chat template")
    taken = set(inspect.signature(tokenizer.apply_chat_template).parameters) & set(template_kwargs or {})
    if taken:
        raise InvalidParameter("chat_template_kwargs", f"chat_template_kwargs: {sorted(taken)} are set by the server")
    try:
        encoded = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=True,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # jinja errors for malformed conversations
        raise InvalidParameter("messages", f"messages: the chat template failed: {exc}") from exc
    return list(encoded["input_ids"])
