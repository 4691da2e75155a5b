"""The WSGI entry point gunicorn loads: ``wsgi_infer.server.wsgi:app``."""

from .app import create_app

app = create_app()
