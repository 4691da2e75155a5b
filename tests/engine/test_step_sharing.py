"""The engine thread's choice of the model to step: fair by tokens computed, with no credit for idleness; and a
model's prefill paced while another model serves streams, since those wait for its whole step."""

from __future__ import annotations

from wsgi_infer import SamplingParams
from wsgi_infer.engine.scheduling.kv_cache_manager import KVCacheManager, KVGroup
from wsgi_infer.engine.scheduling.prefill_pacer import PrefillPacer
from wsgi_infer.engine.scheduling.scheduler import Scheduler
from wsgi_infer.engine.scheduling.sequence import Sequence
from wsgi_infer.engine.step_sharing import StepSharing

from ..support.scheduling import step_tokens


def run(sharing: StepSharing, busy: list[str], tokens: dict[str, int], steps: int) -> dict[str, int]:
    """Step ``steps`` times; each model's step computes ``tokens[name]``; the tokens each computed."""
    computed = dict.fromkeys(busy, 0)
    for _ in range(steps):
        name = sharing.next(busy)
        sharing.add(name, tokens[name])
        computed[name] += tokens[name]
    return computed


def test_models_share_steps_by_tokens_computed():
    # A prefill of 512-token chunks beside a decode of 4 rows: the decode gets 128 steps for each chunk.
    computed = run(StepSharing(), ["prefill", "decode"], {"prefill": 512, "decode": 4}, 1290)
    assert abs(computed["prefill"] - computed["decode"]) <= 512


def test_a_model_back_from_idleness_gets_no_burst():
    sharing = StepSharing()
    run(sharing, ["a", "b"], {"a": 10, "b": 10}, 100)
    run(sharing, ["a"], {"a": 10}, 1000)  # b idle: a computes 10,000 tokens more
    computed = run(sharing, ["a", "b"], {"a": 10, "b": 10}, 100)
    assert computed == {"a": 500, "b": 500}  # b is level with a, not 10,000 tokens behind


def test_nothing_busy_steps_nothing_and_an_unloaded_model_is_forgotten():
    """Unloaded while busy, a model leaves no count behind; loaded again, it comes back level with the busy one,
    as an idle model does, and the other keeps its share."""
    sharing = StepSharing()
    assert sharing.next([]) is None
    run(sharing, ["a", "b"], {"a": 1, "b": 1}, 10)
    sharing.forget("b")
    assert len(sharing) == 1 and sharing.next(["a"]) == "a"
    for name in (f"m{i}" for i in range(1000)):  # models come and go: nothing of them stays
        run(sharing, ["a", name], {"a": 1, name: 1}, 2)
        sharing.forget(name)
    assert len(sharing) == 1
    run(sharing, ["a"], {"a": 10}, 1000)
    assert run(sharing, ["a", "b"], {"a": 10, "b": 10}, 100) == {"a": 500, "b": 500}


def test_every_prefill_is_paced_while_another_model_serves_streams():
    """One tenant (no keys): beside another model's streams every prefill is paced, a first chunk too (one with
    nothing running beside it is read at once otherwise), and decodes are not; beside the model's own streams
    alone a prefill takes the pacer's tokens but at least its minimum chunk."""
    beside = [True]
    kv = KVCacheManager([KVGroup((0,), 0, 256)], 4)
    pacer = PrefillPacer(0.1, 8, 64, min_chunk=16)
    scheduler = Scheduler(kv, 4, max_num_batched_tokens=64, pacer=pacer, beside=lambda: beside[0])
    scheduler.add(Sequence("first", list(range(40)), SamplingParams(), max_tokens=4))
    assert scheduler.serving()  # a request waits
    assert step_tokens(scheduler) == {"first": 8}  # its first chunk, paced
    assert not scheduler.serving()  # a prompt being read keeps no stream waiting
    beside[0] = False
    assert step_tokens(scheduler) == {"first": 32}  # the rest at once: it samples its first token
    assert scheduler.serving()  # a stream decodes
    beside[0] = True
    scheduler.add(Sequence("second", list(range(60)), SamplingParams(), max_tokens=4))
    assert step_tokens(scheduler) == {"first": 1, "second": 8}  # the decode whole, the prefill paced
    beside[0] = False
    assert step_tokens(scheduler) == {"first": 1, "second": 16}  # beside its own stream: the minimum chunk
    assert step_tokens(scheduler) == {"first": 1, "second": 16}
    scheduler.finish(scheduler.running[0])
    assert step_tokens(scheduler) == {"second": 20}  # no stream beside it: the rest at once


class _Engine:
    def __init__(self) -> None:
        self.streams = False

    def serving(self) -> bool:
        return self.streams


def test_a_model_is_beside_others_while_they_serve_streams_and_for_a_moment_after(monkeypatch):
    """The engine loop's answer to each model's scheduler: another model has requests waiting or streams decoding,
    or had within RECENT_SECONDS (a chat's next turn comes a moment after its last); never its own."""
    from wsgi_infer.engine import loop as loop_module
    from wsgi_infer.engine.scheduling.fair_share import RECENT_SECONDS

    now = [100.0]
    monkeypatch.setattr(loop_module.time, "monotonic", lambda: now[0])
    loop = loop_module.EngineLoop(channel=None)
    chat, other = _Engine(), _Engine()
    loop._engines.update(chat=chat, other=other)
    chat.streams = True
    loop._note_serving()
    assert loop._beside_others("other") and not loop._beside_others("chat")  # its own streams do not count
    chat.streams = False
    now[0] += RECENT_SECONDS
    loop._note_serving()
    assert loop._beside_others("other")  # the chat's next turn may come any moment
    now[0] += 0.01
    loop._note_serving()
    assert not loop._beside_others("other")
