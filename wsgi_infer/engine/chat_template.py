"""A conversation as token ids, through the tokenizer's own chat template (no torch: the server's front end uses
it too)."""

from __future__ import annotations

from .sampling_params import InvalidParameter


def chat_prompt_ids(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template; InvalidParameter naming ``messages``."""
    if not tokenizer.chat_template:
        raise InvalidParameter("messages", "messages: this model has no chat template")
    try:
        encoded = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
        )
    except Exception as exc:  # jinja errors for malformed conversations
        raise InvalidParameter("messages", f"messages: the chat template failed: {exc}") from exc
    return list(encoded["input_ids"])
