"""A KV store in a local directory, which every worker of a server (and the next server) shares.

Each block is a file, ``<root>/<namespace>/<key>.kv``, written under a temporary name and renamed, so a reader
sees a whole file or none and two workers writing one block each rename a whole copy. The directory is bounded
over every model in it: a read, and ``mark_used`` (a prompt's blocks, its last first), mark a file recently used
(its modification time), and a writer whose count says
the directory may be over the limit scans it and removes the least recently used files until it holds 7/8 of the
limit. Each process counts its own writes since its last scan, and scans again after 1/16 of the limit, so the
workers together overshoot by a sixteenth each at most. The root is never created again once gone: a vanished
mount must not fill the disk beneath it.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from stat import S_ISREG

from .backend import StoreCounters

log = logging.getLogger(__name__)

SUFFIX = ".kv"
_STALE_TEMPORARY_SECONDS = 3600  # a writer that died mid-write left it


def _owner_only(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


class DirectoryStore:
    def __init__(self, root: Path, limit_bytes: int) -> None:
        self.root = root
        self.location = str(root)
        self.limit_bytes = limit_bytes
        self.counters = StoreCounters()
        self._total: int | None = None  # the directory's bytes at the last scan, plus this process's writes since
        self._written_since_scan = 0
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)  # only here: see the module's docstring
        except OSError:
            pass  # the first write says why, and the store is degraded

    def _path(self, namespace: bytes, key: bytes) -> Path:
        return self.root / namespace.hex()[:32] / f"{key.hex()}{SUFFIX}"

    def contains(self, namespace: bytes, key: bytes) -> bool:
        return self._path(namespace, key).is_file()

    def get(self, namespace: bytes, key: bytes) -> bytearray | None:
        path = self._path(namespace, key)
        try:
            with open(path, "rb", buffering=0) as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                data = data[: f.readinto(data)]
        except FileNotFoundError:
            return None
        try:
            os.utime(path)  # recently used; a read-only store is still read
        except OSError:
            pass
        self.counters.bytes_read += len(data)
        return data

    def put(self, namespace: bytes, key: bytes, framed: list[memoryview], used_ns: int = 0) -> bool:
        path = self._path(namespace, key)
        if os.path.lexists(path):  # another worker wrote it (or something not the store's lies there: left alone)
            return False
        path.parent.mkdir(mode=0o700, exist_ok=True)  # the user's own: a block's values give its prompt away
        staging = path.with_name(f".{path.stem}.{os.getpid()}.{os.urandom(4).hex()}.tmp")  # this writer's own
        try:
            with open(staging, "wb", opener=_owner_only) as f:
                for part in framed:
                    f.write(part)
            if used_ns:
                os.utime(staging, ns=(used_ns, used_ns))
            os.replace(staging, path)
        except BaseException as exc:
            staging.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                self._give_way()
            raise
        size = sum(part.nbytes for part in framed)
        self.counters.bytes_written += size
        self._count_write(size)
        return True

    def mark_used(self, namespace: bytes, keys: list[bytes]) -> None:
        now = time.time_ns()  # a nanosecond apart: a file system's clock may tick only every few milliseconds
        for i, key in enumerate(keys):
            try:
                os.utime(self._path(namespace, key), ns=(now + i, now + i))
            except OSError:
                pass  # removed meanwhile, or read-only

    def discard(self, namespace: bytes, key: bytes) -> None:
        try:
            self._path(namespace, key).unlink(missing_ok=True)
        except OSError:
            pass  # read-only: it stays a miss

    # --- the bound -------------------------------------------------------------------------
    def _count_write(self, size: int) -> None:
        self._written_since_scan += size
        if self._total is None or self._written_since_scan > self.limit_bytes // 16:
            self._total = None  # scan: the other workers have written too
        else:
            self._total += size
        if self._total is None or self._total > self.limit_bytes:
            self._evict()

    def _give_way(self) -> None:
        """The disk is full before the store's limit: the limit becomes what the store holds now, and it removes
        blocks down to 7/8 of that, so that the disk does not stay full (it did: the writes only failed)."""
        held = sum(size for _, size, _ in self._scan())
        if held < self.limit_bytes:
            self.limit_bytes = held
            log.warning("KV store %s: the disk is full; the store keeps to %d MiB", self.root, held >> 20)
            self._evict(full=True)

    def _evict(self, full: bool = False) -> None:
        """Scan the directory; remove the least recently used blocks while it holds more than the limit (``full``:
        as much as it)."""
        files = sorted(self._scan())
        total = sum(size for _, size, _ in files)
        if total > self.limit_bytes or full:
            target = self.limit_bytes * 7 // 8
            for _, size, path in files:
                if total <= target:
                    break
                try:
                    path.unlink()
                    self.counters.evicted_blocks += 1
                except FileNotFoundError:
                    pass  # another worker evicted it
                except OSError:
                    continue  # it stays, and counts
                total -= size
            log.info("KV store %s: least recently used blocks removed, %d MiB kept", self.root, total >> 20)
        self._total, self._written_since_scan = total, 0

    def _scan(self) -> list[tuple[int, int, Path]]:
        """(modification time in ns, size, path) of every block; removes temporary files that writers left behind. Only
        the store's own entries: a namespace's folder (32 hex digits) and regular files in it (a mount's lost+found,
        a link, a folder named like a block are not the store's to count or remove)."""
        found, now = [], time.time()
        for namespace in _entries(self.root):
            if not (_is_namespace(namespace.name) and namespace.is_dir(follow_symlinks=False)):
                continue
            for entry in _entries(namespace.path):
                try:
                    stat = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not S_ISREG(stat.st_mode):
                    continue
                if entry.name.endswith(SUFFIX):
                    found.append((stat.st_mtime_ns, stat.st_size, Path(entry.path)))  # float seconds tie marks
                elif entry.name.endswith(".tmp") and now - stat.st_mtime > _STALE_TEMPORARY_SECONDS:
                    Path(entry.path).unlink(missing_ok=True)
        return found


def _entries(path: str | Path) -> list[os.DirEntry]:
    """A folder's entries; none where it cannot be read (gone, or another user's)."""
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError:
        return []


def _is_namespace(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)
