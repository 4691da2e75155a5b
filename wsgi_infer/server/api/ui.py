"""GET /: the chat page (plain HTML, CSS and JavaScript in wsgi_infer/server/static, served
by Flask's own /static route)."""

from __future__ import annotations

from flask import Blueprint, current_app

bp = Blueprint("ui", __name__)

# The page and what it may do: its own files and API only, never inside another site's frame (which would click its
# Send for a user: the origin check lets the page's own requests through), nothing sniffed, no address sent on.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@bp.get("/")
def index():
    page = current_app.send_static_file("index.html")
    page.headers.update(PAGE_HEADERS)
    return page
