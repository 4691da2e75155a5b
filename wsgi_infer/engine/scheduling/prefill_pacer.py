"""How many prefill tokens a step carries for each tenant while another tenant has streams decoding or requests
waiting: sized from the durations of the last such steps, so that one takes about ``target`` seconds; and beside a
tenant's own streams, as many but at least ``min_chunk`` (``own_tokens``).

A prefill token costs more the deeper in its prompt it is (attention reads every token before it: a 64-token
chunk of the default model takes 120 ms at the start of a prompt and 300 ms at 3,500 tokens in, on two cores), and
more on a larger model or a slower CPU; so the size follows the measured step time rather than a token count.
"""

from __future__ import annotations

FLOOR = 8  # tokens: every prompt moves on, however crowded the step


class PrefillPacer:
    def __init__(self, target_seconds: float, start: int, ceiling: int, min_chunk: int = FLOOR) -> None:
        self.target = target_seconds
        self.ceiling = ceiling
        self.tokens = max(FLOOR, min(start, ceiling))
        self.min_chunk = min_chunk

    @property
    def own_tokens(self) -> int:
        """Prefill tokens a step carries beside the tenant's own streams: no fairness is owed there, so never fewer
        than ``min_chunk``, a chunk that keeps the multiplies efficient (below 48 rows AMX's tiles go unused)."""
        return max(self.tokens, self.min_chunk)

    def observe(self, seconds: float, taken: int) -> None:
        """A step that carried paced prefill took ``seconds``, ``taken`` the allowance a tenant used up in it (0:
        none was): scale the size towards the target, by at most half or a quarter more a step (so one slow step, a
        neighbour taking the CPU, does not halve it twice). It grows only from an allowance used up: a fast step of
        a few short prompts says nothing of a full one (it grew on 16 of them beside 4 streams of a 1B model to the
        whole 512 tokens, and a long prompt's first chunk then held the streams 0.8 s, Xeon)."""
        factor = min(1.25, max(0.5, self.target / max(seconds, 1e-6)))
        if factor > 1 and not taken:
            return
        base = max(self.tokens, taken) if factor > 1 else self.tokens
        self.tokens = round(min(self.ceiling, max(FLOOR, base * factor)))
