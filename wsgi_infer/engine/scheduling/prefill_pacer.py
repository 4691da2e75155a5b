"""How many prefill tokens a step carries for each tenant while another tenant has streams decoding or requests
waiting: sized from the durations of the last such steps, so that one takes about ``target`` seconds.

A prefill token costs more the deeper in its prompt it is (attention reads every token before it: a 64-token
chunk of the default model takes 120 ms at the start of a prompt and 300 ms at 3,500 tokens in, on two cores), and
more on a larger model or a slower CPU; so the size follows the measured step time rather than a token count.
"""

from __future__ import annotations

FLOOR = 8  # tokens: every prompt moves on, however crowded the step


class PrefillPacer:
    def __init__(self, target_seconds: float, start: int, ceiling: int) -> None:
        self.target = target_seconds
        self.ceiling = ceiling
        self.tokens = max(FLOOR, min(start, ceiling))

    def observe(self, seconds: float) -> None:
        """A step that carried paced prefill took ``seconds``: scale the size towards the target, by at most half
        or a quarter more a step (so one slow step, a neighbour taking the CPU, does not halve it twice)."""
        factor = min(1.25, max(0.5, self.target / max(seconds, 1e-6)))
        self.tokens = round(min(self.ceiling, max(FLOOR, self.tokens * factor)))
