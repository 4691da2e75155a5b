"""How many rows torch's packed copy of a weight serves (without the CPU kernels): the crossing point where the
full-precision multiply wins.

Decoding a few sequences is bound by reading weights, so a smaller copy of each weight pays there; large
batches are compute-bound, where oneDNN's GEMM wins. The crossing point is measured once per weight shape on a
machine, and kept. (The CPU kernels' packed weights serve every step: one arithmetic for any number of rows.)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from time import perf_counter
from typing import Protocol

import torch

from ..runtime.cache_files import file_lock, read_json, write_json
from ..runtime.cpu_info import cpu_model_name

log = logging.getLogger(__name__)

ROWS_MEASURED = (1, 2, 4, 8, 16, 32, 64)
LAYERS_TIMED = 8  # of a shape's layers, spread over the model: every one of the default model's 30 took 0.6 s more
# at as many rows as this or more, a multiply is bound by its arithmetic, not by reading its weight: two layers
# time it as well as eight (a 1B model's first start spent 2-2.8 s on its crossing points)
COMPUTE_BOUND_ROWS, LAYERS_TIMED_COMPUTE_BOUND = 64, 2
CLEARLY_SLOWER = 4  # a warm-up this many times slower than the other way's fastest run: no need to time its runs
LONG_RUN_SECONDS = 0.05  # a warm-up this long: a disturbance barely moves one run, so one is timed, not three


class SmallBatchLinear(Protocol):
    """What is measured: a layer with a packed copy (``quantization.SmallBatchLinear``)."""

    kind: str
    out_features: int
    in_features: int
    dtype: torch.dtype
    max_rows: int

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor: ...

    def full_mm(self, x: torch.Tensor) -> torch.Tensor: ...


def choose_max_rows(layers: list[SmallBatchLinear], saved: Path | None = None) -> None:
    """The packed copy serves up to the largest row count where it beat the full-precision multiply.

    Measured once per weight shape on this machine, then kept in ``saved`` (JSON): a greedy output must
    not depend on how a later start's timing happened to fall, and later starts skip the measuring. Processes
    starting together measure one at a time, under a lock, so that they all take the first one's figures.
    """
    known = read_json(saved) or {}
    if saved is None or all(_machine_key(layer) in known for layer in layers):
        _choose(layers, known, None)  # nothing to measure, or to keep: a read-only cache stays untouched
        return
    with file_lock(saved.with_name(saved.name + ".lock"), "waiting for another process to measure crossing points"):
        _choose(layers, read_json(saved) or {}, saved)


def _choose(layers: list[SmallBatchLinear], known: dict[str, int], saved: Path | None) -> None:
    by_key: dict[str, list[SmallBatchLinear]] = {}
    for layer in layers:
        by_key.setdefault(_machine_key(layer), []).append(layer)
    unknown = [key for key in by_key if key not in known]
    for key in unknown:
        known[key] = _measured_max_rows(by_key[key])
        log.info("%s: packed weights for steps of at most %d rows (measured)", key, known[key])
    for key, same_shape in by_key.items():
        for layer in same_shape:
            layer.max_rows = known[key]
    if unknown and saved is not None:
        write_json(saved, known)


def _machine_key(layer: SmallBatchLinear) -> str:
    kind = f"{layer.kind} {layer.out_features}x{layer.in_features} {str(layer.dtype).removeprefix('torch.')}"
    return f"{cpu_model_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {kind}"


@torch.inference_mode()
def _measured_max_rows(same_shape: list[SmallBatchLinear]) -> int:
    """The most rows where the packed copy wins, timed as a step uses them: the layers of the shape in turn
    (``LAYERS_TIMED`` of them, two where the rows make it compute-bound), each weight read from memory rather than
    from the cache a single layer's repeated calls would leave it in. Counted down: the packed copy's lead only
    grows as rows fall (it reads fewer bytes for the same products), so where it wins at 64 rows, one count is
    timed, not seven."""
    for rows in sorted(ROWS_MEASURED, reverse=True):
        timed = LAYERS_TIMED_COMPUTE_BOUND if rows >= COMPUTE_BOUND_ROWS else LAYERS_TIMED
        layers = same_shape[:: math.ceil(len(same_shape) / timed)]  # every layer of a shape of that many or fewer
        x = torch.randn(rows, layers[0].in_features, dtype=layers[0].dtype)
        packed = _seconds([partial(layer.packed_mm, x) for layer in layers])
        full = _seconds([partial(layer.full_mm, x) for layer in layers], losing_to=packed)
        if packed < full:
            return rows
    return 0


def _seconds(calls: list[Callable[[], object]], repeats: int = 3, losing_to: float = math.inf) -> float:
    """The fastest of a few runs through ``calls``: the one least disturbed by whatever else the
    machine was doing (a mean let one slow call move a crossing point from 16 rows to 2). A warm-up over
    ``CLEARLY_SLOWER`` times ``losing_to`` ends it: the runs would lose to that anyway. A warm-up over
    ``LONG_RUN_SECONDS`` is followed by one run: timing long runs is what took longest (a large LM head's), and a
    few milliseconds of disturbance barely move them."""
    started = perf_counter()
    for call in calls:
        call()  # warm-up: first calls allocate, so only ever slower than a run
    warm_up = perf_counter() - started
    if warm_up > CLEARLY_SLOWER * losing_to:
        return warm_up
    fastest = math.inf
    for _ in range(1 if warm_up > LONG_RUN_SECONDS else repeats):
        start = perf_counter()
        for call in calls:
            call()
        fastest = min(fastest, perf_counter() - start)
    return fastest
