"""How many threads a CPU step uses, following what else the machine runs. Imports no torch.

A step crosses a parallel region per op (about 150 for the default model), and each region ends at a barrier
that waits for every thread of the team. With a busy process beside the server on this 2-core machine, the OS
runs three threads on two cores: each barrier then waits until the scheduler runs the descheduled thread again,
up to a time slice, and single steps took up to a second (one stream: 32 tok/s, against 129 alone). One thread
has no barrier to wait at, and gets a core of its own beside the neighbour.

So every ``PERIOD`` of stepping, the share reads how long this process's threads waited for a CPU
(``/proc/self/task/*/schedstat``), and how busy and idle the CPUs it may use were (``/proc/stat``) beside its own
use (``/proc/self/stat``): it drops a thread while other processes use the cores and the team keeps waiting for
them, and takes one back while a core is left idle (the other work has gone). The budget (``cpu_budget``:
affinity mask, cgroup quota) is the most it takes. This process's own native work beside the steps (a grammar
vocabulary's build: ``beside_the_steps``) is left a core while it runs, which comes back as any thread does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .native_threads import Empty, SimpleQueue

log = logging.getLogger(__name__)

PERIOD = 0.25  # seconds of stepping between decisions
# Give a thread back where other processes used this many CPU-seconds per second and this process's threads waited
# for a CPU this many: one busy neighbour used about 0.7 and made them wait 0.8; a load generator on the same
# cores uses 0.05-0.1, while the server's hub and it make the team wait 0.32-0.56.
OTHERS, CROWDED = 0.5, 0.3
IDLE = 0.6  # take a thread back where the usable CPUs were this many seconds idle per second
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's unit of CPU time
_BESIDE: set[int] = set()  # the calls in beside_the_steps now (a set: adding is atomic under the GIL)
_ACKS: dict[int, SimpleQueue] = {}  # theirs that wait for a step to leave them a core (C queues: never patched)
_LAST_STEP = [0.0]  # when the last step began (monotonic)
STEP_WAIT = 0.25  # seconds: at most a step's time that beside_the_steps waits for the next step to begin


@contextmanager
def beside_the_steps() -> Iterator[None]:
    """Native work of this thread that holds a core while the GIL is free (Gemma 3's grammar vocabulary: 1 s): the
    steps leave it a core meanwhile. With a team on every core, a third thread made each barrier wait for the
    scheduler: a stream's gaps reached 183-236 ms and the work took three times as long (Xeon, 2026-12-01). Where
    steps run, it begins once the next one has (the one running may still hold every core)."""
    ack: SimpleQueue = SimpleQueue()
    _BESIDE.add(id(ack))  # counted before it can be acknowledged
    _ACKS[id(ack)] = ack
    try:
        if time.monotonic() - _LAST_STEP[0] < STEP_WAIT:
            try:
                ack.get(timeout=STEP_WAIT)
            except Empty:
                pass  # a step longer than that: begin beside it
        yield
    finally:
        _ACKS.pop(id(ack), None)
        _BESIDE.discard(id(ack))


@dataclass
class Sample:
    at: float  # monotonic seconds
    waited: float  # seconds this process's threads were runnable but not running, in total
    idle: float  # seconds the usable CPUs were idle, in total
    busy: float  # seconds the usable CPUs were busy, in total
    ours: float  # seconds of CPU this process used, in total


def sample(cpus: set[int] | None = None, proc: Path = Path("/proc")) -> Sample | None:
    """Where the counters stand now; None where /proc does not tell (not Linux)."""
    try:
        waited = sum(_run_delay(task) for task in (proc / "self" / "task").iterdir())
        idle, busy = _cpu_ticks((proc / "stat").read_text(), cpus)
        ours = sum(map(int, (proc / "self" / "stat").read_text().rpartition(")")[2].split()[11:13]))
    except OSError:
        return None
    return Sample(time.monotonic(), waited, idle / _TICK, busy / _TICK, ours / _TICK)


def _run_delay(task: Path) -> float:
    try:  # "time on CPU, time waiting on a run queue, timeslices", in nanoseconds
        return int((task / "schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0  # a thread that just ended


def _cpu_ticks(stat: str, cpus: set[int] | None) -> tuple[int, int]:
    """(idle and iowait, busy) ticks of the CPUs in ``cpus`` (every CPU: None)."""
    idle = busy = 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle += ticks[3] + ticks[4]
        busy += sum(ticks) - ticks[3] - ticks[4]
    return idle, busy


class CpuShare:
    """The threads for the next step: at most ``most``, fewer while other work crowds the CPUs."""

    def __init__(self, most: int, period: float = PERIOD) -> None:
        self.most = self.threads = self.stepping = most
        self._period = period
        self._cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self._last: Sample | None = None

    def threads_for_step(self) -> int:
        if self.most == 1:
            return 1
        now = time.monotonic()
        if self._last is None or now - self._last.at >= self._period:
            self._decide(sample(self._cpus))
        acknowledged = list(_ACKS)  # taken before the count: each of these is in it
        # a core lent to native work comes back as any thread does, once a CPU is seen idle: taken back at once, on
        # a crowded machine the next steps' barriers waited on the scheduler (a stream's gap of 1.6 s in CI, Xeon)
        self.threads = min(self.threads, max(1, self.most - len(_BESIDE)))
        self.stepping = self.threads
        _LAST_STEP[0] = now
        for key in acknowledged:  # this step leaves them their cores
            waiting = _ACKS.pop(key, None)
            if waiting is not None:
                waiting.put(None)
        return self.stepping

    def _decide(self, current: Sample | None) -> None:
        last, self._last = self._last, current
        if last is None or current is None or current.at <= last.at:
            return
        seconds = current.at - last.at
        waiting, idle = (current.waited - last.waited) / seconds, (current.idle - last.idle) / seconds
        others = ((current.busy - last.busy) - (current.ours - last.ours)) / seconds
        log.debug("%d threads: waited %.2f s/s, others %.2f s/s, idle %.2f s/s", self.threads, waiting, others, idle)
        if self.threads > 1 and others > OTHERS and waiting > CROWDED:
            self.threads -= 1
            log.info("other processes want these CPUs (%.2f s/s): %d threads a step", others, self.threads)
        elif self.threads < self.most and idle > IDLE:
            self.threads += 1
            log.info("a CPU is free again (%.2f s/s idle): %d threads a step", idle, self.threads)
