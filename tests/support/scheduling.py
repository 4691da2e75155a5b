"""A scheduler driven as the engine drives it, without a model: for the plain-Python scheduling tests; and a clock
that stands still unless the test moves it (fair shares', a key's limits')."""

from __future__ import annotations

from wsgi_infer.engine.scheduling.scheduler import Scheduler


class Clock:
    """A time source (``time.monotonic``'s stand-in) at ``now``, which the test moves."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def step(scheduler: Scheduler) -> list[str]:
    """Schedule a step and compute it: each scheduled sequence computes its tokens, and samples one where the
    step reaches its last; the ids of those scheduled, in order."""
    return list(step_tokens(scheduler))


def step_tokens(scheduler: Scheduler) -> dict[str, int]:
    """``step``, with the tokens each scheduled sequence computed."""
    batch = scheduler.schedule()
    for item in batch:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        if samples:
            item.seq.token_ids.append(1)
    return {item.seq.request_id: item.num_new_tokens for item in batch}
