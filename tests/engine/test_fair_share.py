"""Fair share between tenants (issue 55), in the scheduler alone: the virtual token counters, admission by the
least served, weights, seats taken from the tenant holding the most, no seat moving back and forth, prefills held
short while a less-served tenant has work, priority within a tenant, and the flood's bounds in steps and tokens."""

from __future__ import annotations

from wsgi_infer import SamplingParams
from wsgi_infer.engine.scheduling.fair_share import RECENT_SECONDS, FairShare
from wsgi_infer.engine.scheduling.kv_cache_manager import KVCacheManager, KVGroup
from wsgi_infer.engine.scheduling.prefill_pacer import PrefillPacer
from wsgi_infer.engine.scheduling.scheduler import Scheduler
from wsgi_infer.engine.scheduling.sequence import Sequence

from ..support.scheduling import Clock, step, step_tokens


def _seq(name: str, tenant: str, n: int = 8, weight: float = 1.0, priority: int = 0, max_tokens: int = 64) -> Sequence:
    params = SamplingParams(tenant=tenant, tenant_weight=weight, priority=priority)
    return Sequence(name, list(range(n)), params, max_tokens=max_tokens)


def _scheduler(
    num_blocks: int = 512, max_num_seqs: int = 8, budget: int = 64, paced: int = 8, clock: Clock | None = None
) -> Scheduler:
    """A scheduler whose paced prefills take ``paced`` tokens a step (no step time is reported to its pacer), on
    a clock that stands still unless the test moves it."""
    kv = KVCacheManager([KVGroup((0,), 0, num_blocks)], 4)
    pacer, share = PrefillPacer(0.1, paced, budget), FairShare(clock or Clock())
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens=budget, share=share, pacer=pacer)


def _finish_done(scheduler: Scheduler) -> None:
    """Sequences that generated their max_tokens leave, as the engine would finish them."""
    for seq in list(scheduler.running):
        if seq.num_output_tokens >= seq.max_tokens:
            scheduler.finish(seq)


def test_a_tenant_back_from_idle_is_level_with_the_least_served_busy_one():
    share = FairShare()
    a1, a2, b = _seq("a1", "A"), _seq("a2", "A"), _seq("b", "B", weight=2.0)
    share.join(a1)
    share.charge("A", 100)
    share.join(b)  # A is busy: B starts level with it, not 100 tokens behind
    assert share.served("B") == share.served("A") == 100
    share.charge("B", 100)  # weight 2: half the count
    assert share.served("B") == 150
    share.leave(a1)
    share.charge("B", 1000)
    share.join(a2)  # A was idle: it comes back level with B, its idleness no credit
    assert share.served("A") == share.served("B") == 650


def test_the_least_served_tenant_is_admitted_first_in_its_own_order():
    scheduler = _scheduler(max_num_seqs=1)
    for i in range(3):
        scheduler.add(_seq(f"a{i}", "A", max_tokens=2))
    assert step(scheduler) == ["a0"]
    scheduler.add(_seq("b-low", "B", priority=1, max_tokens=2))
    scheduler.add(_seq("b-urgent", "B", priority=-1, max_tokens=2))
    scheduler.add(_seq("a-urgent", "A", priority=-5, max_tokens=2))  # ahead of A's own, never of B's
    admitted = []
    while scheduler.has_unfinished():
        admitted += [name for name in step(scheduler) if name not in admitted]
        _finish_done(scheduler)
    assert admitted == ["a0", "b-urgent", "a-urgent", "b-low", "a1", "a2"]


def test_weights_divide_the_tokens_computed():
    scheduler = _scheduler(max_num_seqs=1, budget=8)
    for i in range(40):
        scheduler.add(_seq(f"a{i}", "A", n=8, max_tokens=1))
        scheduler.add(_seq(f"b{i}", "B", n=8, max_tokens=1, weight=3.0))
    computed = {"A": 0, "B": 0}
    for _ in range(40):
        for name, tokens in step_tokens(scheduler).items():
            computed[name[0].upper()] += tokens
        _finish_done(scheduler)
    assert computed["A"] + computed["B"] == 40 * 8
    assert computed["B"] == 3 * computed["A"]


def test_a_new_tenant_takes_a_seat_from_the_one_holding_them_all():
    scheduler = _scheduler(max_num_seqs=4)
    for i in range(4):
        scheduler.add(_seq(f"a{i}", "A", priority=1 if i == 1 else 0))
    assert step(scheduler) == ["a0", "a2", "a3", "a1"]
    scheduler.add(_seq("b", "B", n=1))  # served as little as A's decodes: B stays owed its share
    assert step(scheduler) == ["a0", "a2", "a3", "b"]  # a1, A's lowest priority, gave B its seat
    assert [s.request_id for s in scheduler.waiting] == ["a1"] and scheduler.num_preemptions == 1
    scheduler.add(_seq("b2", "B", n=1))  # A holds 3 seats, B 1: one more moves
    assert step(scheduler) == ["a0", "a2", "b", "b2"]
    scheduler.add(_seq("b3", "B", n=1))  # 2 and 2: no seat moves, B waits its turn
    assert step(scheduler) == ["a0", "a2", "b", "b2"]
    assert scheduler.num_preemptions == 2


def test_a_new_tenant_takes_blocks_from_the_one_holding_them():
    scheduler = _scheduler(num_blocks=8)  # blocks of 4 tokens
    for i in range(4):
        scheduler.add(_seq(f"a{i}", "A", n=8))
    assert step(scheduler) == ["a0", "a1", "a2", "a3"]  # every block taken
    scheduler.add(_seq("b", "B", n=4))
    assert step(scheduler) == ["a0", "a1", "b"]  # a3 (latest admitted), then a2, gave their blocks
    assert [s.request_id for s in scheduler.waiting] == ["a2", "a3"]


def test_prefills_are_paced_while_another_tenant_decodes_or_waits_or_did_a_moment_ago():
    clock = Clock()
    scheduler = _scheduler(budget=64, paced=8, clock=clock)
    scheduler.add(_seq("long", "A", n=200))
    assert step_tokens(scheduler) == {"long": 64}  # alone: the whole budget
    scheduler.add(_seq("b", "B", n=12, max_tokens=3))
    assert step_tokens(scheduler) == {"long": 8, "b": 12}  # B waits: A is paced; B's first turn is read at once
    assert step_tokens(scheduler) == {"long": 8, "b": 1}  # B decodes: A stays paced
    assert step_tokens(scheduler) == {"long": 8, "b": 1}
    _finish_done(scheduler)
    assert step_tokens(scheduler) == {"long": 8}  # B's next request may come any moment
    clock.now += RECENT_SECONDS
    assert step_tokens(scheduler) == {"long": 8}
    clock.now += 0.01
    assert step_tokens(scheduler) == {"long": 64}  # B has gone: the whole budget again
    scheduler.add(_seq("b2", "B", n=100))
    scheduler.add(_seq("b3", "B", n=100))
    assert step_tokens(scheduler) == {"long": 8, "b2": 56}  # B's first turn: what A's pacing leaves
    # B is paced only while A has streams decoding or requests waiting: A only reads its prompt
    assert step_tokens(scheduler) == {"long": 8, "b2": 44, "b3": 12}


def test_the_pacer_sizes_paced_prefill_to_the_step_time():
    pacer = PrefillPacer(0.1, 64, 512)
    pacer.observe(0.2, 64)  # too slow: halved
    assert pacer.tokens == 32
    pacer.observe(10.0, 0)  # never below half a step, nor below the floor; slow whatever was taken
    assert pacer.tokens == 16
    for _ in range(3):
        pacer.observe(0.1, 16)
    assert pacer.tokens == 16  # on target: kept
    pacer.observe(0.05, 0)  # fast, but no tenant took its whole allowance: nothing learnt of a fuller step
    assert pacer.tokens == 16
    pacer.observe(0.05, 16)  # fast with the allowance used up: a quarter more at most
    assert pacer.tokens == 20
    pacer.observe(0.05, 64)  # fast with a larger allowance used up (a tenant's minimum chunk): from that one
    assert pacer.tokens == 80
    for _ in range(20):
        pacer.observe(0.01, pacer.tokens)
    assert pacer.tokens == 512  # never above the step's budget
    for _ in range(20):
        pacer.observe(1.0, 0)
    assert pacer.tokens == 8  # the floor: every prompt moves on


def test_the_pacer_grows_only_from_allowances_used_up():
    """Short prompts admitted beside streams never fill the allowance: however fast their steps, it stays, so that
    a long prompt after them is not read in a chunk the steps never showed they could take."""
    kv = KVCacheManager([KVGroup((0,), 0, 1024)], 4)
    scheduler = Scheduler(kv, 16, max_num_batched_tokens=512, pacer=PrefillPacer(0.1, 8, 512, min_chunk=16))
    scheduler.add(_seq("stream", "A", n=4, max_tokens=10_000))
    step(scheduler)
    for i in range(10):
        scheduler.add(_seq(f"short{i}", "A", n=4))
        assert step_tokens(scheduler)[f"short{i}"] == 4  # beside A's stream, paced: 16 allowed
        scheduler.step_took(0.001)
    assert scheduler.pacer.tokens == 8
    scheduler.add(_seq("long", "A", n=400))
    assert step_tokens(scheduler)["long"] == 16  # the minimum chunk, not a grown allowance
    scheduler.step_took(0.05)
    assert step_tokens(scheduler)["long"] == 20  # used up and fast: grown from it


def test_one_share_counts_a_tenants_tokens_on_every_model():
    share = FairShare(Clock())
    kv = [KVCacheManager([KVGroup((0,), 0, 64)], 4) for _ in range(2)]
    first, second = (Scheduler(k, 1, max_num_batched_tokens=16, share=share) for k in kv)
    first.add(_seq("a-busy", "A", n=8))
    second.add(_seq("a-other", "A", n=8))
    second.add(_seq("b", "B", n=8))  # level with A on arrival
    step(first)  # A's tokens on the first model
    assert step(second) == ["b"]  # so B goes first on the second


def test_one_tenant_is_scheduled_as_without_fair_share():
    keyed, plain = _scheduler(budget=16, paced=8), _scheduler(budget=16, paced=8)
    for scheduler, tenant in ((keyed, "A"), (plain, "")):
        scheduler.add(_seq("long", tenant, n=40))
        scheduler.add(_seq("short", tenant, n=4))
    assert [step_tokens(keyed) for _ in range(4)] == [step_tokens(plain) for _ in range(4)]


def test_a_chat_beside_a_flood_is_bounded_in_steps_and_tokens():
    """Key A: 32 decoding streams and a 4,096-token prompt arriving every few steps; key B: one chat at a time.
    B is admitted in the step it arrives with its whole prompt, and every step it decodes in carries at most A's
    streams, B's token and A's paced prefill; A keeps every stream and its prefills move on."""
    paced, budget = 64, 512
    scheduler = _scheduler(num_blocks=4096, max_num_seqs=64, budget=budget, paced=paced)
    for i in range(32):
        scheduler.add(_seq(f"a{i}", "A", n=40, max_tokens=10_000))
    for _ in range(40):  # beside A's first streams, its other prompts are read in paced chunks of their own
        step(scheduler)
    assert all(not seq.prefills for seq in scheduler.running) and len(scheduler.running) == 32
    a_prefill = 0
    for chat in range(5):
        for n in range(2):
            scheduler.add(_seq(f"long{chat}.{n}", "A", n=4096, max_tokens=16))
        step(scheduler)
        scheduler.add(_seq(f"b{chat}", "B", n=120, max_tokens=20))
        assert step_tokens(scheduler)[f"b{chat}"] == 120  # admitted, its prompt read at once: its first token
        for _ in range(19):
            tokens = step_tokens(scheduler)
            a_prefill += sum(t for name, t in tokens.items() if name.startswith("long") and t > 1)
            assert tokens[f"b{chat}"] == 1
            assert sum(t for t in tokens.values() if t > 1) <= paced  # the step's prefill: A's paced share
            assert sum(1 for name in tokens if name.startswith("a")) == 32  # A's streams keep decoding
        _finish_done(scheduler)
    assert a_prefill == 5 * 19 * paced  # A's prefill took every step's paced share
