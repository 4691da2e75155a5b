"""Memory as on a machine whose memory is its own, before a timed load.

The virtual machines we measure on report free memory to their host (virtio-balloon's free page reporting; on the
Zen 4 of 2026-12-04 `/sys/module/page_reporting/parameters/min_free_ms` is 0), which takes it back: memory taken
after it was reported costs the host's page faults. Writing 1 GB of fresh memory (numpy.ones, AMD EPYC Zen 4,
2026-12-04) took 0.13-0.15 s up to half a second after another 1 GB was freed, 1.9-2.2 s after 1-3 s, 3.6-3.8 s
after 4 s, 5.0 s after 6 s and 7.1-8.7 s after 20-60 s. A 1B shape's cold load beside a stream took 5.1-6.4 s in
rounds that followed the router's and 1.9-2.0 s in rounds that followed our own; with its memory backed, 0.57-0.91 s.

So before a timed load, ours and the peers', a process takes as much memory as the load will and ends
(``back_memory``). A cold load in a running server takes its memory within a second of that: it finds memory its host
still backs. A whole start takes most of its memory after its imports, two seconds and more later (and
``bench_sizes`` waits ``SETTLE_SECONDS`` first), by which time the host has taken part of it back: a start's figures
still carry some of the host's cost, on every side, in proportion to the fresh memory each side takes. On a machine
whose memory is its own, none of this changes anything.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SETTLE_SECONDS = 4  # after backing, before a whole start: the backing's own work done


def back_memory(nbytes: int) -> None:
    """Have a process write ``nbytes`` of memory, and end."""
    subprocess.run([sys.executable, "-c", f"import numpy; numpy.ones({nbytes}, numpy.uint8)"], check=True)


def load_bytes(model: Path) -> int:
    """Over any side's memory for loading ``model`` (llama-server's 3B took 2.07 times its file)."""
    return 2 * model.stat().st_size + (2 << 30)
