"""The Flask application factory."""

from __future__ import annotations

import re
import uuid
import weakref

import gevent
from flask import Flask, current_app, g, request
from gunicorn.http.errors import ParseException
from werkzeug.exceptions import RequestEntityTooLarge

from .api import model_admin, native, ops, tokenization, ui
from .api.access import install_access_control
from .api.messages import routes as messages
from .api.openai import embeddings, scores
from .api.openai import routes as openai
from .api.responses import routes as responses
from .api.serving import let_go_of_models
from .engine_client.extension import init_app, manager_of
from .engine_client.manager import EngineManager
from .errors import APIError, register_error_handlers
from .request_json import StrictJSONProvider
from .settings import ServerSettings

_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def create_app(settings: ServerSettings | None = None) -> Flask:
    """Build the app. Its EngineManager (``extension.manager_of(app)``) is started
    separately, by gunicorn's ``post_worker_init`` hook, once per worker."""
    settings = settings or ServerSettings()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json = StrictJSONProvider(app)
    app.json.ensure_ascii = False
    app.url_map.merge_slashes = False  # "//" in a path is a 404 as any unknown path, not werkzeug's HTML redirect
    init_app(app, EngineManager(settings))
    _install_request_hooks(app)  # first: they run before any other hook
    register_error_handlers(app)
    install_access_control(app, settings)
    api = (openai.bp, responses.bp, messages.bp, embeddings.bp, scores.bp, native.bp, tokenization.bp, model_admin.bp)
    for blueprint in (*api, ops.bp, ui.bp):
        app.register_blueprint(blueprint)
    return app


def _install_request_hooks(app: Flask) -> None:
    kept_alive: weakref.WeakSet = weakref.WeakSet()  # client sockets that have carried a request

    @app.before_request
    def _note_arrival() -> None:
        # While draining, a request on a kept-alive connection is turned away (503), so that its
        # client reconnects to a worker that stays. Every other request is one gunicorn has
        # accepted and promises to serve: the first one on a connection the worker accepted
        # just before its drain began (a SIGHUP reload), and the one that reaches max_requests,
        # which gunicorn runs only after flipping `alive` (our drain) and which may still be
        # reading its body when the drain greenlet runs. So this is decided on arrival, before
        # anything can yield.
        connection = request.environ.get("gunicorn.socket")
        g.turned_away = manager_of(current_app).draining and connection in kept_alive
        if connection is not None:
            kept_alive.add(connection)
        if not g.turned_away:  # a drain waits for it (``open_work``)
            manager_of(current_app).open_work.arrived()
            g.arrived = True

    @app.before_request
    def _request_id() -> None:
        # The client's id when it is a sane token (it reaches logs and headers), else ours.
        client_id = request.headers.get("X-Request-Id", "")
        g.request_id = client_id if _CLIENT_REQUEST_ID.match(client_id) else uuid.uuid4().hex

    @app.before_request
    def _read_body_in_time() -> None:
        # A client that sends its headers, then trickles or stalls its body, must not hold a
        # greenlet for ever: the whole body arrives within body_timeout_seconds, or a 408.
        # (gunicorn bounds the headers themselves by its keep-alive timeout.)
        if request.content_encoding not in (None, "", "identity"):  # a compressed body was read as text
            raise APIError(f"Content-Encoding {request.content_encoding!r} is not supported: send the body as is", 415)
        limit = manager_of(current_app).settings.body_timeout_seconds
        try:
            with gevent.Timeout(limit, _BodyLate):
                body = request.get_data(cache=True)
                # A chunked body (no length) stops at the size limit without an error, and its cut JSON read as
                # malformed: a byte more past the limit is a 413, as a body whose length says so is.
                if len(body) >= app.config["MAX_CONTENT_LENGTH"] and request.environ["wsgi.input"].read(1):
                    raise RequestEntityTooLarge()
        except _BodyLate:  # closed, as nginx does: its rest, if it comes, is not read through for a next request
            _close_after(request.environ)
            raise APIError(f"the request body did not arrive within {limit:g} s", 408) from None
        except ParseException as exc:  # a malformed chunk: nothing after it on the connection can be read
            _close_after(request.environ)
            raise APIError(f"the request body is malformed: {exc}", 400) from None

    @app.before_request
    def _turn_away_new_work() -> None:
        # A POST starts work (a generation, a model's load, a tokenizer's call): its client retries it on a worker
        # that stays. Reads (models, stored responses, a stream's resumption) are still served.
        if g.turned_away and request.method == "POST":
            raise APIError(
                "the server is shutting down; retry the request",
                503,
                code="server_shutting_down",
                headers={"Retry-After": "1"},
            )

    # A request that named a model and ends before submitting to it (an error, /tokenize) lets go of it here.
    app.teardown_request(lambda _exc: let_go_of_models())

    @app.teardown_request
    def _leave(_exc) -> None:
        if g.pop("arrived", False):
            manager_of(current_app).open_work.left()

    @app.after_request
    def _tag_response(response):
        request_id = g.get("request_id") or uuid.uuid4().hex
        response.headers["X-Request-Id"] = request_id
        if request.blueprint == "messages":  # where the anthropic SDK reads it (a message's _request_id, an error's)
            response.headers["request-id"] = request_id
        return response


class _BodyLate(Exception):
    """A request body that did not arrive whole within ``body_timeout_seconds``."""


def _close_after(environ: dict) -> None:
    """gunicorn closes the connection after this response: it would read the rest of a malformed or late body as
    the next request's and answer that a second time, on a connection the client may send its next request on.
    (Our worker links the body to its request: ``InferenceWorker.handle_request``.)"""
    parsed = getattr(environ.get("wsgi.input"), "request", None)
    if parsed is not None:
        parsed.must_close = True
