"""The user cache (converted checkpoints, measurements, compiled kernels), its small JSON files
(read back whole or not at all, written atomically), and the lock under which one process writes
what the others then read."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def cache_root() -> Path:
    explicit = os.environ.get("WSGI_INFER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "wsgi-infer"


def read_json(path: Path | None) -> Any:
    """The file's value, or None where it is absent or torn (the caller then computes it again)."""
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(staging, path)  # atomic: concurrent starts each write a whole file


@contextmanager
def file_lock(path: Path, waiting: str) -> Iterator[None]:
    """An exclusive lock on ``path`` for the block, logging ``waiting`` if another process holds it.
    Closing the file releases it, so a process that dies holding it holds it no more."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s", waiting)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def held_elsewhere(path: Path) -> bool:
    """Whether another holder has the lock ``file_lock`` takes on ``path`` now (this one takes it for no longer)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False
