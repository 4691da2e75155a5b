"""The HTTP API. What every route shares sits here (``serving``: admit, tokenize, submit, stream or collect;
``bodies``: how a body is read, the completion, tokenization and /generate schemas, the constraint fields and the
other APIs' fields refused; ``access``: keys and
CORS), beside the small routes (``native``: /generate, ``tokenization``, ``ops``: /health and /metrics, ``ui``:
the chat page). A conversation's path, shared by three APIs, is ``chat/``; each API family has a package of its
own: ``openai/``, ``responses/`` and ``messages/``. The families import from ``chat/`` and the shared modules,
which import none of them (tests/test_layout.py)."""
