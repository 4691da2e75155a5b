"""What a stream's copy in Redis keeps beside its events, so that another host can continue it after the one
generating it died (``api.continuation``): the request as it came, and the engine's output as the stream's route
took it, batch by batch.

Given the same request, the same ids (``ResponseIdentity``) and the same batches, a route writes the same events;
so a host continuing the stream runs the route again over these batches, checks that it writes the events the
client already has, and goes on with the engine's output for the tokens after them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from ...engine.outputs import RequestDelta, TokenLogprob
from ..engine_client.streams import ChoiceDelta


@dataclass
class RequestRecord:
    path: str
    body: str  # the JSON body, as sent
    request_id: str
    seed: int  # its ``ResponseIdentity``
    created: int

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, text: bytes | str) -> RequestRecord:
        return cls(**json.loads(text))


@dataclass
class StreamRecord:
    request: RequestRecord
    batches: list[list[ChoiceDelta]]  # the stream's own list: it grows as the route takes the engine's output


def encode_batch(batch: list[ChoiceDelta]) -> str:
    return json.dumps([[choice.index, _fields(choice.delta), choice.token_texts] for choice in batch])


def decode_batch(text: bytes | str) -> list[ChoiceDelta]:
    return [
        ChoiceDelta(index, _delta(fields), {int(token): piece for token, piece in texts.items()})
        for index, fields, texts in json.loads(text)
    ]


def _fields(delta: RequestDelta) -> dict:
    """The delta's fields that differ from their defaults (most are None on most deltas)."""
    defaults = RequestDelta("", "", [])
    return {name: value for name, value in dataclasses.asdict(delta).items() if value != getattr(defaults, name)}


def _delta(fields: dict) -> RequestDelta:
    for name in ("logprobs", "prompt_logprobs"):
        if fields.get(name) is not None:
            fields[name] = [TokenLogprob(p["token_id"], p["logprob"], list(map(tuple, p["top"]))) for p in fields[name]]
    return RequestDelta(**{"request_id": "", "text": "", "token_ids": [], **fields})
