"""Operational routes: /health and /metrics."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from .. import metrics
from .serving import manager

bp = Blueprint("ops", __name__)


@bp.get("/health")
def health():
    """200 only once the models loaded at start are loaded (one at least), while the engine thread is alive and
    making progress, and the worker is not draining (a load balancer's probe on a kept-alive connection must hear
    that this one stops); ``models`` says each model's state."""
    mgr = manager()
    if mgr.ready and mgr.alive and not mgr.stalled and not mgr.draining:
        states = {name: model.state for name, model in mgr.models.items()}
        return jsonify({"status": "ok", "model": mgr.model_name, "models": states})
    if mgr.failure:  # a worker whose engine failed drains too: the failure says more
        body = {"status": "failed", "error": mgr.failure}
    elif mgr.draining:
        body = {"status": "draining"}
    elif mgr.stalled:
        body = {"status": "stalled"}
    else:
        body = {"status": "loading" if mgr.alive else "stopped"}
    return jsonify(body), 503, {"Retry-After": "5"}


@bp.get("/metrics")
def prometheus_metrics():
    body, content_type = metrics.render()
    return Response(body, content_type=content_type)
