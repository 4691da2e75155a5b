"""Chat templates for GGUF files that carry none, by architecture, as llama.cpp keeps its own: a conversation
must not fall back to a format the model never saw (the Gemma 3 270M GGUF on PyPI has no template).

Each comes with the token that ends the model's turn, which also ends generation (llama.cpp treats it so).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinTemplate:
    template: str
    end_of_turn: str


# Gemma's turns, as its own template renders text: a system message opens the first user turn.
GEMMA = BuiltinTemplate(
    template=(
        "{{ bos_token }}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
        "{%- set loop_messages = messages[1:] -%}"
        "{%- else -%}"
        "{%- set first_user_prefix = '' -%}"
        "{%- set loop_messages = messages -%}"
        "{%- endif -%}"
        "{%- for message in loop_messages -%}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif -%}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
        "{{ message['content'] | trim }}"
        "{{ '<end_of_turn>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
    ),
    end_of_turn="<end_of_turn>",
)

BUILTIN_TEMPLATES = {"gemma3_text": GEMMA}  # by the converted config's model_type
