"""The Flask application factory."""

from __future__ import annotations

import re
import uuid

from flask import Flask, current_app, g, request

from .access import install_access_control
from .api import native, openai, ops, ui
from .errors import register_error_handlers
from .extension import init_app, manager_of
from .manager import EngineManager
from .settings import ServerSettings

_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def create_app(settings: ServerSettings | None = None) -> Flask:
    """Build the app. Its EngineManager (``extension.manager_of(app)``) is started
    separately, by gunicorn's ``post_worker_init`` hook, once per worker."""
    settings = settings or ServerSettings()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.ensure_ascii = False
    init_app(app, EngineManager(settings))
    _install_request_hooks(app)  # first: they run before any other hook
    register_error_handlers(app)
    install_access_control(app, settings)
    for blueprint in (openai.bp, native.bp, ops.bp, ui.bp):
        app.register_blueprint(blueprint)
    return app


def _install_request_hooks(app: Flask) -> None:
    @app.before_request
    def _note_arrival() -> None:
        # Admission is decided when a request arrives, before anything can yield: gunicorn
        # flips `alive` (starting our drain) before it runs the request that reaches
        # max_requests, which it promises to serve, and that request may still be reading
        # its body when the drain greenlet runs.
        g.arrived_draining = manager_of(current_app).draining

    @app.before_request
    def _request_id() -> None:
        # The client's id when it is a sane token (it reaches logs and headers), else ours.
        client_id = request.headers.get("X-Request-Id", "")
        g.request_id = client_id if _CLIENT_REQUEST_ID.match(client_id) else uuid.uuid4().hex

    @app.after_request
    def _tag_response(response):
        response.headers["X-Request-Id"] = g.get("request_id") or uuid.uuid4().hex
        return response
