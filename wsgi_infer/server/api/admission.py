"""The door every generation and embedding request passes before it is submitted: the model's sequences in
flight (``max_num_seqs`` + ``max_waiting_requests``), then the API key's own limits (``tenants``)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

from flask import Response, after_this_request, current_app, g

from ...engine.sampling_params import SamplingParams
from ..engine_client.served_model import ServedModel
from ..errors import APIError
from ..tenants.registry import Tenants


@contextmanager
def through_the_door(model: ServedModel, choices: int) -> Iterator[None]:
    """Admit ``choices`` sequences (``_admit_choices``), and hold their places until the block's submit counts
    them: tokenizing yields to the hub, and a burst's requests each saw a count without the others (60 text
    prompts at once all came in through a door of 8, the load probe)."""
    _admit_choices(model, choices)
    key = g.get("key")
    model.num_open_choices += choices
    if key is not None:  # and the request among its key's (``Tenants.within_equal_share``)
        model.open_by_key[key.id] += 1
    try:
        yield
    finally:  # the submit counted them, or nothing was submitted
        model.num_open_choices -= choices
        if key is not None:
            model.open_by_key[key.id] -= 1


def _admit_choices(model: ServedModel, choices: int) -> None:
    """The door counts sequences, as the engine's limits do (a request of 500 prompts × n 16 is 8,000 of them, not
    one); one larger than the door (2,048 texts to embed) comes in where nothing else is open."""
    limit = model.settings.max_num_seqs + model.settings.max_waiting_requests
    fits = model.num_open_choices + choices <= limit or not model.num_open_choices
    if not fits and not tenants().within_equal_share(g.get("key"), model, limit):
        model.metrics.requests_refused.inc()
        message = f"too many choices in flight ({limit}); retry later"
        raise APIError(message, 429, code="too_many_requests", headers={"Retry-After": "1"})


def tenants() -> Tenants:
    return current_app.extensions["wsgi_infer.tenants"]


def admit_key(model: ServedModel, params: list[SamplingParams], prompt_tokens: int) -> str:
    """The request's key (if any) gets its share and priority cap on ``params``, and its limits a ticket for the
    request (or a 429, with Retry-After and OpenAI's x-ratelimit-* headers, which an admitted response gets too)."""
    policy = g.get("key")
    if policy is None:
        return ""
    tenants().share(policy, params)
    decision = tenants().admit(policy, prompt_tokens)
    if decision.ticket is None:
        model.metrics.key_rate_limited(policy.id, decision.limit).inc()
        retry = {} if decision.retry_after is None else {"Retry-After": str(max(1, math.ceil(decision.retry_after)))}
        raise APIError(decision.message, 429, code="rate_limit_exceeded", headers={**decision.headers, **retry})
    if decision.headers:
        after_this_request(lambda response: _with_headers(response, decision.headers))
    return decision.ticket


def _with_headers(response: Response, headers: dict[str, str]) -> Response:
    response.headers.update(headers)
    return response
