"""The soak's verdicts: its drift (``scripts/soaking/report.py``) catches a leak under steady load, and does not take
a fresh worker's warm-up for one, whichever set of models it warmed up with; a stream the server ends as it shuts
down is a failure but while the reload may have ended it (``scripts/soaking/clients.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def soaking(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import soaking.clients
    import soaking.report

    yield soaking
    for name in [name for name in sys.modules if name == "soaking" or name.startswith("soaking.")]:
        del sys.modules[name]  # not monkeypatch's delitem: its undo would put them back


@pytest.fixture
def drift(soaking):
    return soaking.report.drift


def sample(worker: int, models: tuple[str, ...], rss_mib: float, loads: int = 1) -> dict:
    return {"phase": "load", "worker_pids": [worker], "models": [f"{m}:loaded" for m in models],
            "model_loads": loads, "rss_bytes": rss_mib * 2**20}  # fmt: skip


def test_a_steady_rise_under_one_set_of_models_is_a_drift(drift):
    samples = [sample(1, ("a", "b"), 500 * 1.01**i) for i in range(30)]
    assert drift(samples, "rss_bytes") > 0.1


def test_a_fresh_workers_warm_up_is_no_drift_whatever_set_it_warmed_up_with(drift):
    """As in a two-minute soak: a new worker's first sample with models a and c, taken while it warmed up (478 MiB),
    and that set's one later sample at its working size (619 MiB); the set a and b steady all along."""
    warm_up = [sample(2, ("a", "b"), 470), sample(2, ("a", "c"), 478), *(sample(2, ("a", "b"), 560) for _ in range(7))]
    steady = [sample(2, ("a", "c"), 619), *(sample(2, ("a", "b"), 600) for _ in range(12))]
    assert drift(warm_up + steady, "rss_bytes") == 0.0


def test_a_load_and_the_sample_after_it_are_left_out(drift):
    """Late in the worker's life, where a peak counts: two samples while b loads, then the one in the load's
    interval (its evicted model not yet freed), each at 900 MiB; left out, the set stays at 500."""
    before = [sample(1, ("a", "b"), 500) for _ in range(9)]
    loading = [{**sample(1, ("a", "b"), rss), "models": ["a:loaded", "b:loading"]} for rss in (500, 900)]
    after = [sample(1, ("a", "b"), 900, 2), *(sample(1, ("a", "b"), 500, 2) for _ in range(2))]
    assert drift(before + loading + after, "rss_bytes") == 0.0
    assert drift(before + after[1:] + [sample(1, ("a", "b"), 900, 2)], "rss_bytes") == 0.8  # what it would count


def test_a_stream_ended_by_a_shutdown_fails_but_while_the_reload_may_have_ended_it(soaking):
    ctx = soaking.clients.LoadContext("", [None], None, None, 60.0, 0, 1, 0.0)
    ctx.stats = soaking.streams.Stats()
    client = soaking.clients.ClientLoop(0, ctx)
    client.kind = "completion_stream"
    ended = soaking.streams.StreamRead("s1", 3, error_code="server_shutting_down")
    with pytest.raises(soaking.streams.Failed, match="shutting_down_outside_reload"):
        client._interrupted_by_reload(ended, started=10.0)  # no reload yet
    ctx.reload_sent_at = 20.0
    assert client._interrupted_by_reload(ended, started=10.0)  # begun before the SIGHUP, old workers not gone
    ctx.reload_done_at = 30.0
    assert client._interrupted_by_reload(ended, started=29.0)  # begun while both generations of workers answered
    with pytest.raises(soaking.streams.Failed, match="shutting_down_outside_reload"):
        client._interrupted_by_reload(ended, started=31.0)  # begun after the old workers left
    assert not client._interrupted_by_reload(soaking.streams.StreamRead("s2", 9, done=True), started=31.0)
    assert ctx.stats.outcomes["completion_stream"]["interrupted_by_reload"] == 2
