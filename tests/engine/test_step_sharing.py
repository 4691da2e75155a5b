"""The engine thread's choice of the model to step: fair by tokens computed, with no credit for idleness."""

from __future__ import annotations

from wsgi_infer.engine.step_sharing import StepSharing


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
