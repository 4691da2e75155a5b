"""Text and token ids: conversations through a chat template (``chat_template``, ``builtin_chat_templates``)
and incremental detokenization with stop strings held back (``detokenizer``).
"""
