"""What the master reads of the settings' files (the keys file, the models config) at start and at each reload,
kept for the workers it forks. A worker used to read them itself as it booted: an edit that broke one, then a
SIGHUP, failed every new worker, and gunicorn stopped the server (the old workers had drained). Now the master
reads them first, and where an edit broke one, says why in one line while its new workers take what it read
before; a worker forked later (a crash's, ``max_requests``') takes the same, not the file as it stands."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

_read: dict[str, tuple[Hashable, Any]] = {}  # what -> (the inputs it was read from, what was read)


def read_for_workers(what: str, inputs: Hashable, read: Callable[[], T]) -> T:
    """In the master: ``read()``, kept as ``what`` read from ``inputs`` for the workers it forks; raises as
    ``read`` does, what was kept before staying."""
    value = read()
    _read[what] = (inputs, value)
    return value


def as_the_master_read(what: str, inputs: Hashable, read: Callable[[], T]) -> T:
    """What the master read as ``what`` from these ``inputs``, where it did; else ``read()`` (a process of its
    own: ``LLM``, the tests' in-process app)."""
    kept = _read.get(what)
    return kept[1] if kept is not None and kept[0] == inputs else read()
