"""Who may call the API: API keys (``Authorization: Bearer``, or Anthropic's ``x-api-key``; ``tenants``) and CORS
for browsers."""

from __future__ import annotations

from flask import Flask, g, request
from flask_cors import CORS

from ..errors import APIError
from ..settings import ServerSettings
from ..tenants.registry import Tenants

API_PATHS = ("/v1/", "/v2/", "/generate", "/models/")  # /v2/rerank: Cohere's clients
OPS_PATHS = ("/health", "/metrics")


def install_access_control(app: Flask, settings: ServerSettings) -> None:
    tenants = app.extensions["wsgi_infer.tenants"] = Tenants(settings)
    if tenants.policies:

        @app.before_request
        def _require_api_key() -> None:
            if request.method == "OPTIONS":  # CORS preflights carry no credentials
                return
            protected = API_PATHS + OPS_PATHS if settings.protect_ops else API_PATHS
            if not request.path.startswith(protected):  # the chat page and its files stay public
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
            expose_headers=["X-Request-Id", "Retry-After"],
            max_age=600,
        )
