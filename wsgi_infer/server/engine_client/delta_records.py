"""A stream's batches of engine output as JSON, as its copy in Redis keeps them (``streaming.stream_record``) and a
host continuing the stream reads them back (``api.continuation``)."""

from __future__ import annotations

import dataclasses
import json

from ...engine.outputs import RequestDelta, TokenLogprob
from .streams import ChoiceDelta

_DEFAULTS = RequestDelta("", "", [])


def encode_batch(batch: list[ChoiceDelta]) -> str:
    return json.dumps([[choice.index, _fields(choice.delta), choice.token_texts] for choice in batch])


def decode_batch(text: bytes | str) -> list[ChoiceDelta]:
    return [
        ChoiceDelta(index, _delta(fields), {int(token): piece for token, piece in texts.items()})
        for index, fields, texts in json.loads(text)
    ]


def _fields(delta: RequestDelta) -> dict:
    """The delta's fields that differ from their defaults (most are None on most deltas)."""
    return {name: value for name, value in dataclasses.asdict(delta).items() if value != getattr(_DEFAULTS, name)}


def _delta(fields: dict) -> RequestDelta:
    for name in ("logprobs", "prompt_logprobs"):
        if fields.get(name) is not None:
            fields[name] = [TokenLogprob(**{**p, "top": list(map(tuple, p["top"]))}) for p in fields[name]]
    return RequestDelta(**{"request_id": "", "text": "", "token_ids": [], **fields})
