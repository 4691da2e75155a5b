"""The folders a server's master makes for its workers (metrics, limits), removed when it exits: by gunicorn's exit
hook, or by ``wsgi-infer serve`` where gunicorn's halt ended before the hook ran.

A master killed outright (SIGKILL, the OOM killer) runs neither, so each folder holds a lock file that its master
holds locked (``flock``) while it lives; its workers inherit the open file, so the lock outlives the master for as
long as they still write there. A starting master removes every folder of ours whose lock it can take: its server
is gone. A lock, not a pid: pids are reused, and hosts' containers that share /tmp do not share pid namespaces.
Nothing else imported here: the command line reaches it without gevent."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

PREFIXES = ("wsgi-infer-metrics-", "wsgi-infer-limits-")
LOCK_NAME = "master.lock"
_held_locks: list[int] = []  # open for the life of this master (and its workers, who inherit them)


def make_owned_dir(prefix: str) -> str:
    """A fresh folder under the temporary directory, locked as this process's. The lock file takes its name only
    once locked (a rename keeps the lock), so another master never finds it unlocked while this one starts."""
    path = tempfile.mkdtemp(prefix=prefix)
    making = os.path.join(path, LOCK_NAME + ".new")
    fd = os.open(making, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(making, os.path.join(path, LOCK_NAME))
    _held_locks.append(fd)
    return path


def remove_abandoned_dirs(parent: str | None = None) -> list[str]:
    """The folders of ours whose master and workers are all gone, removed; returns their paths. A folder with no
    lock file (being made, or made by a version without one) or another user's is not ours to judge."""
    removed = []
    for prefix in PREFIXES:
        for path in sorted(Path(parent or tempfile.gettempdir()).glob(prefix + "*")):
            try:
                fd = os.open(path / LOCK_NAME, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
            except BlockingIOError:
                pass  # its server lives
            finally:
                os.close(fd)
    return removed


def remove_owned_dirs() -> None:
    if os.environ.get("WSGI_INFER_OWNS_METRICS_DIR"):
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
    if os.environ.get("WSGI_INFER_OWNS_LIMITS_DIR"):
        shutil.rmtree(os.environ["WSGI_INFER_LIMITS_DIR"], ignore_errors=True)
