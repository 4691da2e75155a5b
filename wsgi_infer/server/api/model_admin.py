"""Loading and unloading models by hand: ``POST /v1/models/{id}/load`` and ``/unload``, and llama-server's router
routes ``POST /models/load`` and ``/models/unload`` with ``{"model": ...}``. Where keys are set, an admin key's
only (``access.require_admin``)."""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from ..errors import APIError
from .access import require_admin
from .serving import manager, served, wait_ready

bp = Blueprint("model_admin", __name__)


@bp.post("/v1/models/<path:model_id>/load")
def load(model_id: str):
    """Load the model (unloading idle ones to make room, as a request would; one whose load failed, again); its
    entry once it serves."""
    require_admin("load models")
    model = served(model_id)
    wait_ready(model, retry_failed=True)
    return jsonify(model.describe())


@bp.post("/v1/models/<path:model_id>/unload")
def unload(model_id: str):
    """Unload the model, unless requests are open on it (a 409: it never goes from under its streams)."""
    require_admin("unload models")
    model = manager().model(model_id)  # not ``served``: naming the model here does not make it busy
    if model.busy:  # a request that named it and waits (for its load, its turn) counts apart
        waiting = f" and {model.holds} waiting to start on it (a load asked for by hand is one)" if model.holds else ""
        message = f"model {model.name!r} has {model.num_open_requests} open requests{waiting}; unload it once they end"
        raise APIError(message, 409, code="model_busy", headers={"Retry-After": "1"})
    manager().loads.unload(model, "admin")
    return jsonify(model.describe())


@bp.post("/models/load")
def router_load():
    load(_named_model())
    return jsonify({"success": True})


@bp.post("/models/unload")
def router_unload():
    unload(_named_model())
    return jsonify({"success": True})


def _named_model() -> str:
    body = request.get_json(force=True, silent=True)
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise APIError('the body must be {"model": NAME}', param="model")
    return name
