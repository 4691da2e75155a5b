"""OpenAI-shaped errors: routes raise, one set of handlers renders.

Body: ``{"error": {"message", "type", "param", "code"}}``, or Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on its Messages routes; a
traceback never reaches a client. The engine's ``InvalidParameter`` (a bad sampling value, a
constraint that does not compile, a conversation the template refuses, a prompt
too long for the window) is a 400 naming its field: translated here, and
nowhere else.
"""

from __future__ import annotations

import logging

from flask import Flask, g, jsonify, request
from werkzeug.exceptions import HTTPException
from werkzeug.routing import WebsocketMismatch

from ..engine.sampling_params import InvalidParameter
from .client_connection import ClientGone

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


def anthropic_error_body(message: str, status: int) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _render(error: APIError):
    if request.path.startswith(ANTHROPIC_PATHS):
        response = jsonify(anthropic_error_body(error.message, error.status))
    else:
        response = jsonify(error_body(error.message, error.status, error.param, error.code))
    response.status_code = error.status
    response.headers.update(error.headers)
    return response


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(APIError, _render)
    app.register_error_handler(
        InvalidParameter, lambda exc: _render(APIError(str(exc), 400, param=exc.param, code=exc.code))
    )
    # nginx's status for a request its client closed: no one reads it, but the access log tells
    app.register_error_handler(ClientGone, lambda _exc: ("", 499))

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        messages = {
            400: "malformed request body: expected valid JSON",
            404: "no such route",
            413: f"request body is larger than the limit of {app.config.get('MAX_CONTENT_LENGTH')} bytes",
        }
        if isinstance(exc, WebsocketMismatch):  # werkzeug's 400 for an Upgrade to a WebSocket, which no route takes
            return _render(APIError("WebSocket is not served here: send the request without Upgrade: websocket"))
        code = exc.code or 500
        headers = {k: v for k, v in exc.get_headers() if k.lower() != "content-type"}  # a 405's Allow (RFC 9110)
        return _render(APIError(messages.get(code, exc.description or exc.name), code, headers=headers))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error: %s %s (request %s)", request.method, request.path, g.get("request_id", "-"))
        return _render(APIError("internal server error", 500))
