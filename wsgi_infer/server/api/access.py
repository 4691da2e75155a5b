"""Who may call the API: API keys (``Authorization: Bearer``, or Anthropic's ``x-api-key``; ``tenants``) and CORS
for browsers."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

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


def require_admin(what: str, param: str | None = None) -> None:
    """Where keys are set, a key changes which models every key finds loaded only if it is an admin's: a tenant's
    unload (or ``keep_alive: 0``) made the others wait for a reload, a pin squeezed their models out."""
    key = g.get("key")
    if key is not None and not key.admin:
        raise APIError(
            f"this key may not {what} (a key of WSGI_INFER_API_KEY may, or a keys-file table with admin = true)",
            403,
            param=param,
            code="permission_denied",
        )


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
    _refuse_other_sites_writes(app, origins, names_trusted=bool(tenants.policies))
    if origins:
        CORS(
            app,
            origins=origins,
            # any header a page sends (the SDKs' own: openai's X-Stainless-*, anthropic's direct-browser-access)
            allow_headers="*",
            # what a page reads: the stream id it resumes by, and a limited key's budget
            expose_headers=["X-Request-Id", "Retry-After", "X-Stream-Id", *RATE_LIMIT_HEADERS],
            max_age=600,
        )
        app.after_request(_vary_by_origin)


def _vary_by_origin(response):
    """An answer depends on the page's origin (flask-cors says so only for several): a cache keeps each apart."""
    response.vary.add("Origin")
    return response


def _refuse_other_sites_writes(app: Flask, origins: list[str], names_trusted: bool) -> None:
    """A browser sends a page's form, or a text/plain body, to any site without asking it first (no CORS
    preflight): on a server without keys any page a user opened could generate, or unload a model. Such a request
    names its page's origin, which must be the server's own or one of ``origins``; a client that is no browser sends
    none. Both the origin and the Host header come from the browser: a page of a name its attacker points at this
    server (DNS rebinding) is the server's own by them, so a server without keys (not ``names_trusted``) takes a
    page as its own only where it is reached by an address or ``localhost``; another name must be listed."""

    @app.before_request
    def _same_site_or_allowed() -> None:
        origin = request.headers.get("Origin")
        if origin is None or request.method in ("GET", "HEAD", "OPTIONS") or "*" in origins or origin in origins:
            return
        if _same_host(origin, request.host) and (names_trusted or _reached_by_address(request.host)):
            return
        raise APIError(
            f"a page of {origin} may not call this server (WSGI_INFER_CORS_ORIGINS names the origins that may; "
            "without API keys, a page of this server's own is one reached by its address or localhost)",
            403,
            code="origin_not_allowed",
        )


def _reached_by_address(host: str) -> bool:
    name = urlsplit(f"//{host}").hostname or ""
    if name == "localhost" or name.endswith(".localhost"):  # browsers resolve these to the loopback themselves
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _same_host(origin: str, host: str) -> bool:
    """Whether the page's ``origin`` is this server, which clients reach as ``host`` (the Host header): behind nginx
    it may lack the port its clients used, and then the host alone is compared."""
    page, server = urlsplit(origin), urlsplit(f"//{host}")
    try:
        return page.hostname == server.hostname and (server.port is None or page.port == server.port)
    except ValueError:  # a port that is no number
        return False
