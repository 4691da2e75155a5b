"""Text and token ids: conversations through a chat template (``chat_template``, ``builtin_chat_templates``)
and incremental detokenization with stop strings held back (``detokenizer``); llguidance's view of a vocabulary
and its grammars' matchers over token ids, through its C interface (``llguidance_c``).
"""
