"""GET /: the chat page (plain HTML, CSS and JavaScript in wsgi_infer/server/static, served
by Flask's own /static route)."""

from __future__ import annotations

from flask import Blueprint, current_app

bp = Blueprint("ui", __name__)


@bp.get("/")
def index():
    return current_app.send_static_file("index.html")
