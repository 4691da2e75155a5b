"""What a route asks the engine to continue, and how it becomes token ids: on the front-end thread, with the
engine's tokenizer (shared read-only), so that neither the hub nor the engine thread waits for a long prompt
(68,000 tokens take 0.12 s)."""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.text.chat_template import chat_prompt_ids
from ...engine.text.truncation import keep_last, prompt_tokens


@dataclass
class Chat:
    """A conversation before the chat template; ``tools`` go to templates that take them."""

    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: dict | None = None  # the template's own variables (``enable_thinking``...)
    continue_final: bool = False  # the reply continues the last (assistant) message: a prefill
    opens_reply: bool = True  # the template's add_generation_prompt


Prompt = str | list[int] | Chat  # a text, token ids, or a conversation


def prompt_ids(tokenizer, prompts: list[Prompt], keep: int | None = None) -> list[list[int]]:
    """Each prompt's token ids, its last ``keep`` at most (``text.truncation``); InvalidParameter naming
    ``messages`` for a conversation the template refuses."""
    return [
        keep_last(
            chat_prompt_ids(tokenizer, p.messages, p.tools, p.opens_reply, p.template_kwargs, p.continue_final), keep
        )
        if isinstance(p, Chat)
        else prompt_tokens(tokenizer, p, keep)
        for p in prompts
    ]
