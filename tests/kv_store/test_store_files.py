"""The KV store's files: each block framed with its key and a checksum, written whole or not at all, bounded by
least recent use, and never trusted where the frame does not hold."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wsgi_infer.engine.kv_store.block_file import CorruptBlock, frame, unframe
from wsgi_infer.engine.kv_store.directory import DirectoryStore

from ..support.prerequisites import unavailable

NAMESPACE, OTHER = bytes(range(32)), bytes(range(1, 33))


def _payload(n: int, fill: int = 7) -> memoryview:
    return memoryview(bytearray([fill]) * n)


def _put(store: DirectoryStore, key: bytes, n: int = 1000, namespace: bytes = NAMESPACE) -> bool:
    return store.put(namespace, key, frame(namespace, key, _payload(n)))


def test_a_frame_gives_back_its_payload_and_refuses_anything_else():
    key = b"k" * 16
    data = b"".join(frame(NAMESPACE, key, _payload(100)))
    assert bytes(unframe(NAMESPACE, key, data)) == bytes(_payload(100))
    flipped = bytearray(data)
    flipped[-1] ^= 1
    cases = {
        "checksum mismatch": bytes(flipped),
        "payload bytes": data[:-10],  # truncated
        "shorter than its header": data[:20],
        "another model": None,
    }
    for reason, corrupt in cases.items():
        with pytest.raises(CorruptBlock, match=reason):
            if corrupt is None:
                unframe(OTHER, key, data)  # another namespace's block under this key
            else:
                unframe(NAMESPACE, key, corrupt)
    with pytest.raises(CorruptBlock, match="another model"):
        unframe(NAMESPACE, b"x" * 16, data)  # another prefix's block


def test_blocks_are_written_once_whole_and_found_by_namespace_and_key(tmp_path, monkeypatch):
    store = DirectoryStore(tmp_path / "kv", 1 << 20)
    key = b"a" * 16
    assert not store.contains(NAMESPACE, key) and store.get(NAMESPACE, key) is None
    renames, replace = [], os.replace

    def recorded(src, dst):  # what a reader could see at the block's name: nothing, then the whole file
        renames.append((Path(src), Path(dst), Path(src).read_bytes(), Path(dst).exists()))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", recorded)
    assert _put(store, key)
    [(src, dst, written, existed)] = renames
    assert src != dst and src.parent == dst.parent and not existed
    assert written == b"".join(frame(NAMESPACE, key, _payload(1000)))
    assert not _put(store, key)  # another worker's copy is there: not written twice
    assert store.contains(NAMESPACE, key) and not store.contains(OTHER, key)
    assert bytes(unframe(NAMESPACE, key, store.get(NAMESPACE, key))) == bytes(_payload(1000))
    assert not [p for p in (tmp_path / "kv").rglob("*") if p.name.endswith(".tmp")]  # renamed into place
    # the user's alone: a block's values give its prompt away (each was readable by every local user)
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "kv").rglob("*")} | {
        dst.parent.parent.stat().st_mode & 0o777
    } == {0o700, 0o600}
    assert dst.stat().st_mode & 0o777 == 0o600
    store.discard(NAMESPACE, key)
    assert store.get(NAMESPACE, key) is None


def test_the_size_limit_removes_the_least_recently_used_blocks_of_every_model(tmp_path):
    size = len(b"".join(frame(NAMESPACE, b"k" * 16, _payload(1000))))
    store = DirectoryStore(tmp_path, 10 * size)
    keys = [bytes([i]) * 16 for i in range(10)]
    for i, key in enumerate(keys):
        assert _put(store, key, namespace=NAMESPACE if i % 2 else OTHER)
    for i, path in enumerate(sorted(tmp_path.rglob("*.kv"), key=lambda p: keys.index(bytes.fromhex(p.stem)))):
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # written in key order, seconds apart
    assert store.get(OTHER, keys[0]) is not None  # read: now the most recently used
    assert _put(store, b"n" * 16)  # 11 blocks: over the limit, down to 7/8 of it (8 blocks)
    kept = {bytes.fromhex(p.stem) for p in tmp_path.rglob("*.kv")}
    assert kept == {keys[0], *keys[4:], b"n" * 16}
    assert store.counters.evicted_blocks == 3


def test_what_else_lies_in_the_directory_is_left_alone_and_the_limit_still_holds(tmp_path):
    """A directory named like a block, a link, and a folder that is no namespace (a mount's lost+found) made every
    write fail ("Is a directory") and the store stay degraded, never bounded."""
    size = len(b"".join(frame(NAMESPACE, b"k" * 16, _payload(1000))))
    store = DirectoryStore(tmp_path, 4 * size)
    assert _put(store, b"a" * 16)
    namespace = next(tmp_path.iterdir())
    (namespace / f"{'b' * 32}.kv").mkdir()
    (namespace / f"{'c' * 32}.kv").symlink_to(tmp_path / "nowhere")
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "lost+found" / f"{'d' * 32}.kv").write_bytes(b"x" * 10 * size)
    for i in range(8):
        assert _put(store, bytes([i]) * 16)
    assert len(list(namespace.glob("*.kv"))) == 3 + 2 and store.counters.evicted_blocks == 6
    # its own block's name: left alone, and no write error (one degraded the whole store for 30 s)
    assert not _put(store, b"\xbb" * 16) and not _put(store, b"\xcc" * 16)
    assert (tmp_path / "lost+found" / f"{'d' * 32}.kv").stat().st_size == 10 * size  # not ours: not counted


WRITER = """
import sys
from pathlib import Path
from wsgi_infer.engine.kv_store.block_file import frame
from wsgi_infer.engine.kv_store.directory import DirectoryStore
root, limit, first, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
namespace, payload, most = bytes(range(32)), memoryview(bytearray(1000)), 0
store = DirectoryStore(root, limit)
print("ready", flush=True)
sys.stdin.readline()  # both start together
for i in range(first, first + count):
    key = i.to_bytes(16, "little")
    assert store.put(namespace, key, frame(namespace, key, payload))
    most = max(most, sum(1 for _ in root.rglob("*.kv")))
print(store.counters.evicted_blocks, most)
"""


def test_two_processes_writing_one_directory_keep_it_within_a_sixteenth_each_of_the_limit(tmp_path):
    """Two writer processes (as two workers) at once, each scanning and evicting: the directory stays within the
    limit and each one's writes since its last scan (a sixteenth of the limit), and every file removed is counted
    once, by the process whose removal took it (the other finds it gone)."""
    size = len(b"".join(frame(NAMESPACE, b"k" * 16, _payload(1000))))
    limit, count = 64 * size, 400
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(limit), str(first), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for first in (0, count)
    ]
    for writer in writers:
        assert writer.stdout.readline() == "ready\n"
    for writer in writers:
        writer.stdin.write("go\n")
        writer.stdin.close()
    results = [writer.stdout.read().split() for writer in writers]
    assert [writer.wait(120) for writer in writers] == [0, 0]
    evicted, most = sum(int(r[0]) for r in results), max(int(r[1]) for r in results)
    left = len(list(tmp_path.rglob("*.kv")))
    assert 64 < most <= 64 + 2 * 4
    assert evicted == 2 * count - left and evicted > count  # each removal counted once, both evicting


UNSHARE = shutil.which("unshare")


def _in_own_mounts(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``script`` in a user and mount namespace of its own, where an unprivileged process may mount a small
    tmpfs or a read-only bind mount (as a full or read-only disk is, for real)."""
    return subprocess.run(
        [UNSHARE, "-rm", sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )


STORE_ON = """
import subprocess, sys
from pathlib import Path
from wsgi_infer.engine.kv_store.block_file import frame
from wsgi_infer.engine.kv_store.directory import DirectoryStore
ns = bytes(32)
root = Path("kv"); root.mkdir()
subprocess.run(MOUNT, check=True)
store = DirectoryStore(root, 1 << 30)
written, failure = 0, None
for i in range(400):
    try:
        store.put(ns, i.to_bytes(16, "little"), frame(ns, i.to_bytes(16, "little"), memoryview(bytes(8192))))
        written += 1
    except OSError as exc:
        failure = exc
        break
first = store.get(ns, (0).to_bytes(16, "little"))
last = (400).to_bytes(16, "little")
try:
    again = store.put(ns, last, frame(ns, last, memoryview(bytes(8192))))
except OSError:
    again = False
print(written, type(failure).__name__, getattr(failure, "errno", None), first is not None, again)
print(len([p for p in root.rglob("*") if p.name.endswith(".tmp")]))
"""


@pytest.mark.parametrize(
    "mount, expect",
    [
        (["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", "kv"], "ENOSPC"),  # a full disk
        (["sh", "-c", "mount --bind kv kv && mount -o remount,bind,ro kv"], "EROFS"),  # a read-only directory
    ],
    ids=["full", "read-only"],
)
def test_a_full_or_read_only_directory_refuses_a_write_whole(tmp_path, mount, expect):
    import errno

    if UNSHARE is None:
        unavailable("util-linux's unshare is not installed")
    done = _in_own_mounts(STORE_ON.replace("MOUNT", repr(mount)), tmp_path)
    # A kernel or container that forbids user namespaces, or mounts in them, refuses in unshare or in mount: then
    # there is no disk to fill here (the server's degradation is shown on a vanished directory, everywhere).
    refused = done.stderr.lstrip().startswith("unshare:") or "CalledProcessError" in done.stderr
    if done.returncode and refused:
        unavailable(f"no mounts of our own here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    counts, temporaries = done.stdout.split("\n")[:2]
    written, error, code, first_found, again = counts.split()
    assert (error, int(code)) == ("OSError", getattr(errno, expect))
    assert int(written) == 0 if expect == "EROFS" else 0 < int(written) < 400
    # a full disk: the least recently used blocks are removed (the first), and the next write finds room (the disk
    # stayed full, every write failing); a read-only one writes nothing
    assert (first_found, again) == (("False", "True") if expect == "ENOSPC" else ("False", "False"))
    assert temporaries == "0"  # a failed write leaves no half file
