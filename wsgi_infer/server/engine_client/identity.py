"""What names a response: the ids and the creation time its events carry.

Drawn once per request. A stream's record keeps the seed and the time (``streaming.stream_record``), so that a host
continuing the stream after its own died draws the same ids, in the same order, as the events a client already has.
"""

from __future__ import annotations

import random
import secrets
import time
from dataclasses import dataclass, field


@dataclass
class ResponseIdentity:
    seed: int
    created: int  # Unix seconds
    _draws: random.Random = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._draws = random.Random(self.seed)

    @classmethod
    def new(cls) -> ResponseIdentity:
        return cls(secrets.randbits(63), int(time.time()))

    def hex(self, digits: int = 32) -> str:
        """The next id's ``digits`` hex digits."""
        return f"{self._draws.getrandbits(4 * digits):0{digits}x}"
