"""Who may call the API: API keys (``Authorization: Bearer``, or Anthropic's ``x-api-key``; ``tenants``) and CORS
for browsers."""

from __future__ import annotations

from flask import Flask, g, request
from flask_cors import CORS

from ..errors import APIError
from ..settings import ServerSettings
from ..tenants.limits import BUCKETS
from ..tenants.registry import Tenants

OPS_PATHS = ("/health", "/metrics")
RATE_LIMIT_HEADERS = [
    f"x-ratelimit-{part}-{word}" for word in BUCKETS.values() for part in ("limit", "remaining", "reset")
]


def is_public(path: str, protect_ops: bool) -> bool:
    """Paths served without a key: the chat page and its files, and the ops paths unless they are protected. Every
    other path needs one, so that a route added later (as /tokenize was: it loads a model) is guarded too."""
    return path == "/" or path.startswith("/static/") or (not protect_ops and path.startswith(OPS_PATHS))


def install_access_control(app: Flask, settings: ServerSettings) -> None:
    tenants = app.extensions["wsgi_infer.tenants"] = Tenants(settings)
    if tenants.policies:

        @app.before_request
        def _require_api_key() -> None:
            if request.method == "OPTIONS":  # CORS preflights carry no credentials
                return
            if is_public(request.path, settings.protect_ops):
                return
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            presented = [token.strip()] if scheme.lower() == "bearer" else []
            presented += [request.headers["x-api-key"].strip()] if "x-api-key" in request.headers else []
            policy = tenants.identify(presented)
            if policy is None:
                raise APIError(
                    "missing or invalid API key (send `Authorization: Bearer <key>` or `x-api-key: <key>`)",
                    401,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            g.key = policy
            g.tenant = policy.tenant  # what a key creates is its own

    origins = [origin.strip() for origin in settings.cors_origins.split(",") if origin.strip()]
    if origins:
        CORS(
            app,
            origins=origins,
            allow_headers=[
                *("Authorization", "x-api-key", "anthropic-version"),
                *("Content-Type", "X-Request-Id", "Last-Event-ID"),
            ],
            # what a page reads: the stream id it resumes by, and a limited key's budget
            expose_headers=["X-Request-Id", "Retry-After", "X-Stream-Id", *RATE_LIMIT_HEADERS],
            max_age=600,
        )
