"""vLLM's request priority: lower runs first, equals first come first served, and under KV pressure the lowest
priority, of those the latest admitted, is preempted first; the API takes the field and refuses what is no
integer."""

from __future__ import annotations

from wsgi_infer import SamplingParams
from wsgi_infer.engine.scheduling.kv_cache_manager import KVCacheManager, KVGroup
from wsgi_infer.engine.scheduling.scheduler import Scheduler
from wsgi_infer.engine.scheduling.sequence import Sequence

from ..support.scheduling import step


def _seq(name: str, priority: int, n: int = 8) -> Sequence:
    return Sequence(name, list(range(n)), SamplingParams(priority=priority), max_tokens=8)


def _scheduler(num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager([KVGroup((0,), 0, num_blocks)], 4), max_num_seqs, max_num_batched_tokens=64)


def test_lower_priority_numbers_are_admitted_first_and_equals_in_arrival_order():
    scheduler = _scheduler(max_num_seqs=1)
    for name, priority in [("a", 0), ("late", 5), ("urgent", -1), ("b", 0)]:
        scheduler.add(_seq(name, priority))
    assert [s.request_id for s in scheduler.waiting] == ["urgent", "a", "b", "late"]
    assert step(scheduler) == ["urgent"]


def test_kv_pressure_preempts_the_lowest_priority_not_the_latest_admitted():
    scheduler = _scheduler(num_blocks=4)  # blocks of 4 tokens
    scheduler.add(_seq("a", 0, n=3))
    scheduler.add(_seq("low", 5, n=3))
    assert step(scheduler) == ["a", "low"]
    scheduler.add(_seq("c", 0, n=3))
    assert step(scheduler) == ["a", "low", "c"]  # the latest admitted: "c"
    assert step(scheduler) == ["a", "c"]  # a fifth token each: "a" takes the last block, "low" gives its back
    assert [s.request_id for s in scheduler.waiting] == ["low"] and scheduler.num_preemptions == 1


def test_a_victim_scheduled_earlier_in_the_step_gives_its_tokens_back():
    scheduler = _scheduler(num_blocks=3)
    scheduler.add(_seq("low", 5, n=3))
    assert step(scheduler) == ["low"]  # admitted first, so scheduled first in each later step
    scheduler.add(_seq("high", 0, n=4))
    assert step(scheduler) == ["low", "high"]
    assert step(scheduler) == ["high"]  # "low" took the last block, then gave it back with its own to "high"
    assert [s.request_id for s in scheduler.waiting] == ["low"]
    assert [s.request_id for s in scheduler.running] == ["high"]


def test_the_api_takes_priority_and_refuses_what_is_no_integer(tiny_api):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    with tiny_api.client() as http:
        assert http.post("/v1/completions", json={**body, "priority": -3}).status_code == 200
        refused = http.post("/v1/completions", json={**body, "priority": "high"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
        beyond = http.post("/v1/completions", json={**body, "priority": 2**40}).json()["error"]
        assert beyond["param"] == "priority" and "in [-2147483648, 2147483647]" in beyond["message"]  # in full
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 2}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
