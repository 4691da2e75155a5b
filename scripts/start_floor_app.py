"""The floor of a start (``bench_start.py --floor``): a WSGI app that only imports the modules named in
``IMPORTS`` (say torch and transformers), with garbage collection paused as our workers pause it, then answers
200 to everything."""

import gc
import os
from importlib import import_module

gc.disable()
for name in os.environ.get("IMPORTS", "torch").split():
    import_module(name)
gc.freeze()
gc.enable()


def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]
