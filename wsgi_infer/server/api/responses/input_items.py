"""A stored response's input items, as ``GET /v1/responses/<id>/input_items`` lists them (the openai SDK's
``responses.input_items.list``): every item of its conversation before its output, earlier turns' inputs and
outputs included, each with an id, newest first unless ``order`` is ``asc``, a page of ``limit`` after the item
``after``."""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from ...errors import APIError
from ...query_numbers import whole_number

MAX_LIMIT = 100  # OpenAI's bound on a page
DEFAULT_LIMIT = 20
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def as_items(given: str | list[dict]) -> list[dict]:
    """A request's ``input`` as the items OpenAI lists: a string as a user message, a message's text as its
    content part, and an id for each item that came without one."""
    items = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given
    return [_listed(item) for item in items]


def _listed(item: dict) -> dict:
    kind = item.get("type", "message")
    listed = {"id": f"{_ID_PREFIXES[kind]}_{uuid.uuid4().hex}", **item, "type": kind}
    if kind == "message":
        if isinstance(listed["content"], str):
            part = "output_text" if listed["role"] == "assistant" else "input_text"
            listed["content"] = [{"type": part, "text": listed["content"]}]
        listed.setdefault("status", "completed")
    return listed


def page(items: list[dict], args: Mapping[str, str]) -> dict:
    """One page of ``items`` (oldest first) as OpenAI's list object, by the query's ``order``, ``after``, ``limit``."""
    if args.get("include"):
        raise APIError("include is not supported on input items: they hold every field they have", param="include")
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError("order must be asc or desc", param="order")
    limit = whole_number(args.get("limit", str(DEFAULT_LIMIT)))
    if limit is None or not 1 <= limit <= MAX_LIMIT:
        raise APIError(f"limit must be an integer from 1 to {MAX_LIMIT}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if "after" in args:
        ids = [item["id"] for item in ordered]
        if args["after"] not in ids:
            raise APIError(f"no input item {args['after']!r} in this response", 404, param="after")
        start = ids.index(args["after"]) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + len(data) < len(ordered),
    }
