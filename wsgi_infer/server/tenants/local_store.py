"""The limits' state shared by the workers of one server: a SQLite database in a directory the gunicorn master
makes (``WSGI_INFER_LIMITS_DIR``; without one, as under a test's app, this process's memory). A write locks the
database for the few microseconds of one key's update, so workers never count the same slot twice."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
DIRECTORY_VARIABLE = "WSGI_INFER_LIMITS_DIR"


class LocalLimitStore:
    def __init__(self, directory: str | None = None) -> None:
        directory = directory or os.environ.get(DIRECTORY_VARIABLE)
        path = str(Path(directory) / "limits.sqlite3") if directory else ":memory:"
        # isolation_level None: transactions are ours (BEGIN IMMEDIATE takes the write lock before reading).
        self._db = sqlite3.connect(path, timeout=10, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # The state lives as long as the server: no fsync at each commit (310 us of the hub's time each, on disk).
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("CREATE TABLE IF NOT EXISTS keys (id TEXT PRIMARY KEY, state TEXT NOT NULL)")
        self.owner = str(os.getpid())

    @classmethod
    def prepare(cls, directory: str) -> None:
        """Make the database before any worker opens it (the gunicorn master, before it forks them): two workers
        that switched a new one to WAL at once had one of them fail to boot ("database is locked": SQLite does not
        wait for that lock, and once the file is in WAL mode nobody needs it)."""
        cls(directory)._db.close()

    def update(self, key_id: str, change: Callable[[dict], T]) -> T:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            row = self._db.execute("SELECT state FROM keys WHERE id = ?", (key_id,)).fetchone()
            state = json.loads(row[0]) if row else {}
            result = change(state)
            self._db.execute("REPLACE INTO keys (id, state) VALUES (?, ?)", (key_id, json.dumps(state)))
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return result

    def alive(self, owners: set[str]) -> set[str]:
        return {owner for owner in owners if _running(int(owner))}


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now holds the number: not our worker
        return False
    return True
