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
    batches: list[str]  # JSON (``engine_client.delta_records``), the stream's own list: it grows as its route reads
