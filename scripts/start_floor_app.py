"""The floor of a start (``bench_start.py --floor``): a WSGI app that only imports the modules named in
``IMPORTS`` (say torch and transformers), then answers 200 to everything."""

import os
from importlib import import_module

for name in os.environ.get("IMPORTS", "torch").split():
    import_module(name)


def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]
