"""Crossing points: the batch size below which a packed layer beats its full weights, timed on a few layers once
per machine, kept for later starts, and shared by processes starting together."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
from torch import nn

from wsgi_infer import LLM
from wsgi_infer.engine.layers import crossing_points
from wsgi_infer.engine.layers.crossing_points import choose_max_rows
from wsgi_infer.engine.layers.quantization import SmallBatchLinear, TorchInt8Linear
from wsgi_infer.engine.loading.model_builder import PACKED_ROWS_FILE
from wsgi_infer.engine.runtime.cache_files import file_lock

from ..conftest import pin_packed_rows


def test_processes_starting_together_take_the_first_ones_crossing_points(monkeypatch, tmp_path, caplog):
    """Two workers of a fresh cache measure one at a time: the second waits on the lock, then reads the first's
    figure rather than timing its own (which could differ, and with it a greedy output)."""
    layer = TorchInt8Linear(nn.Linear(64, 32))
    saved = tmp_path / "rows.json"
    key = crossing_points._machine_key(layer)
    with caplog.at_level(logging.INFO):  # the lock's waiting line is cache_files', the figures' crossing_points'
        with file_lock(saved.with_name(saved.name + ".lock"), "the first process measures"):
            second = threading.Thread(target=choose_max_rows, args=([layer], saved))
            second.start()
            while "waiting for another process to measure crossing points" not in caplog.text:
                assert second.is_alive(), "it chose without waiting for the lock"
                second.join(0.01)  # the log line is what the test waits on
            saved.write_text(json.dumps({key: 5}))  # the first one's figure
        second.join()
    assert layer.max_rows == 5 and "(measured)" not in caplog.text
    lock, written = saved.with_name(saved.name + ".lock"), saved.stat().st_mtime_ns
    lock.unlink()
    choose_max_rows([layer], saved)  # all known: no lock and no write, as a read-only prepared cache needs
    assert layer.max_rows == 5 and not lock.exists() and saved.stat().st_mtime_ns == written


class _TimedLayer:
    """A layer of the crossing point's protocol that counts its calls."""

    kind, out_features, in_features, dtype, max_rows = "timed", 8, 32, torch.float32, 0

    def __init__(self) -> None:
        self.calls = 0

    def packed_mm(self, rows: torch.Tensor) -> None:
        self.calls += 1

    def full_mm(self, x: torch.Tensor) -> None:
        self.calls += 1


def _packed_wins_at_16_rows_or_fewer(calls, losing_to: float = 0.0) -> float:
    """``crossing_points._seconds`` without a clock: each call made once, the packed copy faster up to 16 rows."""
    for call in calls:
        call()
    rows, packed = len(calls[0].args[0]), calls[0].func.__name__ == "packed_mm"
    return len(calls) * (1.0 if packed == (rows <= 16) else 2.0)


def test_a_crossing_point_is_timed_on_a_few_layers_spread_over_the_model(monkeypatch, tmp_path):
    """LAYERS_TIMED of a shape's 30 layers, every fourth, are timed (all 30 took 0.6 s of a first start), two of them
    where the rows make the multiply compute-bound; every layer of the shape takes the figure."""
    monkeypatch.setattr(crossing_points, "_seconds", _packed_wins_at_16_rows_or_fewer)
    layers = [_TimedLayer() for _ in range(30)]
    choose_max_rows(layers, tmp_path / "rows.json")
    assert [i for i, layer in enumerate(layers) if layer.calls] == sorted([*range(0, 30, 4), 15])
    assert len(range(0, 30, 4)) == crossing_points.LAYERS_TIMED and {layer.max_rows for layer in layers} == {16}
    # 64 rows (compute-bound) on two of them: layers 0 and 15; then 32 and 16 on the eight
    assert [layer.calls for layer in layers[:16:4]] == [6, 4, 4, 4] and layers[15].calls == 2


class _Clock:
    """``crossing_points.perf_counter``: each call of ``step`` takes ``seconds``."""

    def __init__(self) -> None:
        self.now, self.calls = 0.0, 0

    def __call__(self) -> float:
        return self.now

    def step(self, seconds: float) -> None:
        self.now, self.calls = self.now + seconds, self.calls + 1


@pytest.mark.parametrize(
    ("seconds", "losing_to", "calls"),
    [(0.05, 0.01, 1), (0.03, 0.01, 4), (0.05, float("inf"), 4), (0.06, float("inf"), 2), (0.06, 0.02, 2)],
)
def test_a_way_clearly_slower_or_long_at_its_warm_up_is_timed_less(monkeypatch, seconds, losing_to, calls):
    """A warm-up over CLEARLY_SLOWER times the other way's fastest run already loses: its runs are not timed. One over
    LONG_RUN_SECONDS is timed once more, not three times (a large LM head took 1.4 s of a first start so). Else
    the warm-up and three runs are, and the fastest run counts."""
    clock = _Clock()
    monkeypatch.setattr(crossing_points, "perf_counter", clock)
    assert (crossing_points.CLEARLY_SLOWER, crossing_points.LONG_RUN_SECONDS) == (4, 0.05)
    assert crossing_points._seconds([lambda: clock.step(seconds)], losing_to=losing_to) == pytest.approx(seconds)
    assert clock.calls == calls


def test_crossing_points_are_measured_once_per_machine_then_kept(tiny_model_dirs, tmp_path, monkeypatch, caplog):
    """A greedy output must not depend on how one start's timings fell: later starts reuse the first's. (GPT-2:
    torch's packed layers, which are measured on every CPU.)"""
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path))
    model = str(tiny_model_dirs["gpt2"])
    with caplog.at_level(logging.INFO, logger=crossing_points.__name__):
        pin_packed_rows(model, 3)
    assert "(measured)" in caplog.text and json.loads((tmp_path / PACKED_ROWS_FILE).read_text())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=crossing_points.__name__):
        llm = LLM(model=model, device="cpu", dtype="float32", quantization="int8")
    packed = [m for m in llm.engine.runner.model.modules() if isinstance(m, SmallBatchLinear)]
    assert packed and all(m.max_rows == 3 for m in packed) and "(measured)" not in caplog.text
