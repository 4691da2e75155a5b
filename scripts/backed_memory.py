"""Memory as on a machine whose memory is its own, before a timed load.

The virtual machines we measure on report free memory to their host (virtio-balloon's free page reporting), which
takes it back: memory taken after a while at rest costs the host's page faults. Writing 1 GB of fresh memory took
0.13-0.19 s right after another 1 GB was freed, 1.7 s five seconds later, 7.1-8.7 s after 20-60 s (numpy.ones, AMD
EPYC Zen 4, 2026-12-04); a 3B load's weights laid out in 1.9-2.1 s four seconds after another load and in 4.1-4.4 s
after a minute. Whichever side of a comparison came after a pause paid it, the other not: the 1B shape's cold load
beside a stream took 5.1-6.4 s in rounds that followed the router's, 1.9-2.0 s in rounds that followed our own.

So before a timed load, ours and the peers', a process takes as much memory as the load will and ends
(``back_memory``): the load then finds memory its host still backs. On a machine whose memory is its own, nothing
changes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SETTLE_SECONDS = 4  # after backing, before a whole start: the backing's own work done, its memory still backed


def back_memory(nbytes: int) -> None:
    """Have a process write ``nbytes`` of memory, and end."""
    subprocess.run([sys.executable, "-c", f"import numpy; numpy.ones({nbytes}, numpy.uint8)"], check=True)


def load_bytes(model: Path) -> int:
    """Over any side's memory for loading ``model`` (llama-server's 3B took 2.07 times its file)."""
    return 2 * model.stat().st_size + (2 << 30)
