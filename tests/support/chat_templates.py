"""Chat templates of model families whose tokenizers the tests do not have: the parts that concern tools, and a
thinking model's (with the replies the tiny random model is made to write under them)."""

# Phi-4-mini's chat template (as Microsoft publishes it): the tools come from the system message's own field.
PHI4_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is "
    "not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + "
    "'<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

# Mistral 7B Instruct v0.3's, in the form its tokenizer_config.json gives it (the tools before the last user
# message, calls after [TOOL_CALLS] with ids of 9 letters or digits, results in [TOOL_RESULTS]).
MISTRAL_TEMPLATE = (
    "{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools and message == user_messages[-1] %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- endif %}[INST] {{ message['content'] }}[/INST]"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{%- for call in message.tool_calls %}"
    "{%- if call.id is not defined or call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    '{%- set out = call.function | tojson %}{{- out[:-1] }}, "id": "{{ call.id }}"}'
    "{%- if not loop.last %}, {% endif %}{%- endfor %}]{{- eos_token }}"
    "{%- elif message['role'] == 'assistant' %} {{ message['content'] }}{{- eos_token }}"
    "{%- elif message['role'] == 'tool' %}[TOOL_RESULTS] {\"content\": {{ message['content'] | tojson }}, "
    '"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]'
    "{%- endif %}{%- endfor %}"
)

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# What the tiny random model must write (the grammar makes it): a thought, then an answer.
REPLY = {"regex": "<think>\n[a-z]{2,12}\n</think>\n\n[A-Z][a-z]{2,12}"}
# A template whose prompt opens the thought (DeepSeek-R1's): the reply starts inside it.
OPENED_TEMPLATE = THINKING_TEMPLATE.replace("{% if enable_thinking", "<think>\n{% if enable_thinking")
OPENED_REPLY = {"regex": "[a-z]{2,12}\n</think>\n\n[A-Z][a-z]{2,12}"}
