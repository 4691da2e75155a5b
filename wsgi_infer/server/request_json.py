"""How the app reads a JSON body: as RFC 8259 defines JSON, and no deeper than a bound.

Python's json module takes ``NaN``, ``Infinity`` and ``-Infinity`` as numbers, which no JSON client sends and which
pass every range check (``NaN > 2`` is false); and a body of a few kilobytes of nested brackets raises a
RecursionError, which Flask does not take for a malformed body. Both are a 400 here, for every route.
"""

from __future__ import annotations

import json
from typing import Any

from flask.json.provider import DefaultJSONProvider

from .errors import APIError

# OpenAI bounds a structured output's schema at 10 levels of objects; a body nests a few more around it.
MAX_DEPTH = 64


def _refuse_constant(name: str) -> float:
    raise APIError(f"malformed request body: {name} is not a JSON number")


def depth(value: Any, bound: int = MAX_DEPTH) -> int:
    """How many arrays and objects deep ``value`` nests (counted to ``bound`` + 1 at most), a level at a time: on
    the hub, a 1 MiB body of small lists took 290 ms walked node by node."""
    level, frontier = 0, [value]
    while level <= bound:
        frontier = [node for node in frontier if isinstance(node, dict | list)]
        if not frontier:
            break
        level += 1
        frontier = [child for node in frontier for child in (node.values() if isinstance(node, dict) else node)]
    return level


class StrictJSONProvider(DefaultJSONProvider):
    """Flask's JSON, reading bodies strictly; answers keep their keys' order (Flask sorts them), which says
    something: a completion's top_logprobs are listed most likely first, as OpenAI's are."""

    sort_keys = False

    def loads(self, s: str | bytes, **kwargs: Any) -> Any:
        try:
            value = json.loads(s, parse_constant=_refuse_constant, **kwargs)
        except RecursionError:  # deeper than Python's stack: far past the bound
            raise _too_deep() from None
        opened = s.count(b"[") + s.count(b"{") if isinstance(s, bytes) else s.count("[") + s.count("{")
        if opened > MAX_DEPTH and depth(value) > MAX_DEPTH:  # fewer brackets in all: no need to walk
            raise _too_deep()
        return value


def _too_deep() -> APIError:
    return APIError(f"malformed request body: arrays and objects nest deeper than {MAX_DEPTH} levels")
