"""What the tests share, none of it a test: real processes to start (``server``, ``nginx_proxy``; gunicorn forked
from a helper with torch imported where it may be, ``warm_starts``), the app in the test's own process
(``in_process``), an SSE reader, tiny GGUF files, the transformers reference, batch runs and what a load imports in
a fresh interpreter (``fresh_imports``)."""
