"""How the Flask app carries its worker's EngineManager: ``app.extensions``, under one key.

Light on purpose: the worker class and the gunicorn hooks, imported by the
master, reach the manager through here without importing the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flask import Flask

    from .manager import EngineManager

_KEY = "wsgi_infer"


def init_app(app: Flask, manager: EngineManager) -> None:
    app.extensions[_KEY] = manager


def manager_of(app: object) -> EngineManager | None:
    """The app's manager; None for anything else (gunicorn runs some hooks in the master too)."""
    extensions = getattr(app, "extensions", None)
    return extensions.get(_KEY) if isinstance(extensions, dict) else None
