"""A scheduler driven as the engine drives it, without a model: for the plain-Python scheduling tests."""

from __future__ import annotations

from wsgi_infer.engine.scheduling.scheduler import Scheduler


def step(scheduler: Scheduler) -> list[str]:
    """Schedule a step and compute it: each scheduled sequence computes its tokens and samples one; the ids of
    those scheduled, in order."""
    batch = scheduler.schedule()
    for item in batch:
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.token_ids.append(1)
    return [item.seq.request_id for item in batch]
