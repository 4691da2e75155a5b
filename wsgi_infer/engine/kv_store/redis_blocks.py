"""A KV store in Redis, which every host that reaches it shares (``kv_store_url``).

Each block is one binary value, ``wsgi-infer:kv:<namespace>:<key>``, set only where absent, so two writers of one
block keep one whole copy. Redis bounds the store itself: its ``maxmemory`` with ``allkeys-lru`` removes the least
recently used blocks (a read counts as a use), which a Redis of its own for the blocks should be given. A lookup is
a read, never done on the engine thread: ``contains`` answers "perhaps" without asking Redis, and the reader thread
finds out. A Redis that cannot be reached is not asked again for a while, so that a prompt waits for no timeout
while it is down; a read or write that fails is an ``OSError`` to the store, which counts it (a degraded store).

The store's reader and writer are native threads, in a gevent worker too, where a patched socket waits on a hub
that its thread never runs (redis-py's client, shared by the two threads, left the writer waiting for ever). So
the reader (``get``, ``discard``) and the writer (``put``) each have a connection of their own, on the C
``_socket`` module, which gevent never patches, with commands packed and replies parsed by hiredis.
"""

from __future__ import annotations

import _socket
import time
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from .backend import StoreCounters

PREFIX = b"wsgi-infer:kv:"
RETRY_SECONDS = 30.0  # an unreachable Redis is asked again after this
TIMEOUT_SECONDS = 2.0  # a command's, and a connection's


@dataclass(frozen=True)
class RedisAddress:
    host: str
    port: int
    login: tuple[str, ...]  # AUTH's arguments: none, a password, or a user and a password
    db: str

    @classmethod
    def of(cls, url: str) -> RedisAddress:
        parts = urlsplit(url)
        if parts.scheme != "redis":
            raise ValueError(f"kv_store_url: redis://[user:password@]host[:port][/db] expected, got {url!r}")
        login = tuple(unquote(p) for p in (parts.username, parts.password) if p) if parts.password else ()
        return cls(parts.hostname or "localhost", parts.port or 6379, login, parts.path.strip("/"))


class RedisReplyError(OSError):
    """Redis answered with an error (out of memory, say): the connection is still in step."""


class RedisConnection:
    """One thread's connection: ``command`` sends one command and returns its reply, or raises ``OSError``."""

    def __init__(self, address: RedisAddress) -> None:
        import hiredis

        self._hiredis, self._reader = hiredis, hiredis.Reader()
        family, kind, proto, _, where = _socket.getaddrinfo(address.host, address.port, 0, _socket.SOCK_STREAM)[0]
        self._socket = _socket.socket(family, kind, proto)
        self._socket.settimeout(TIMEOUT_SECONDS)
        try:
            self._socket.connect(where)
            self._socket.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            if address.login:
                self.command(b"AUTH", *address.login)
            if address.db:
                self.command(b"SELECT", address.db)
        except BaseException:
            self.close()
            raise

    def command(self, *args):
        self._socket.sendall(self._hiredis.pack_command(args))
        while (reply := self._reader.gets()) is False:
            data = self._socket.recv(1 << 20)
            if not data:
                raise ConnectionError("Redis closed the connection")
            self._reader.feed(data)
        if isinstance(reply, self._hiredis.ReplyError):
            raise RedisReplyError(str(reply))
        return reply

    def close(self) -> None:
        self._socket.close()


class RedisStore:
    def __init__(self, url: str) -> None:
        import hiredis  # noqa: F401  (here, so that a missing one fails the load, not a thread)

        self._address = RedisAddress.of(url)
        self.location = f"redis://{self._address.host}:{self._address.port}/{self._address.db}"  # no password
        self.counters = StoreCounters()
        # "reads" (the reader thread's), "writes" (the writer's), each with the count of failures when it was made
        self._connections: dict[str, tuple[RedisConnection, int]] = {}
        self._failures = 0
        self._retry_at = 0.0

    def _name(self, namespace: bytes, key: bytes) -> bytes:
        return PREFIX + namespace.hex()[:32].encode() + b":" + key.hex().encode()

    def _command(self, role: str, *args):
        """The reply; an unreachable Redis is an ``OSError``, and not asked again for a while."""
        if time.monotonic() < self._retry_at:
            raise OSError(f"Redis at {self.location} was unreachable less than {RETRY_SECONDS:.0f} s ago")
        try:
            connection, made_after = self._connections.get(role, (None, -1))
            if made_after != self._failures:  # one failed since: Redis went away, and this one is stale too
                if connection is not None:  # (its role's thread alone closes it: it may be in use)
                    connection.close()
                connection = RedisConnection(self._address)
                self._connections[role] = connection, self._failures
            return connection.command(*args)
        except RedisReplyError as exc:
            raise OSError(f"Redis at {self.location}: {exc}") from exc
        except OSError as exc:  # refused, reset, timed out: its replies are out of step, if it has any
            if (broken := self._connections.pop(role, None)) is not None:
                broken[0].close()
            self._failures += 1
            self._retry_at = time.monotonic() + RETRY_SECONDS
            raise OSError(f"Redis at {self.location}: {exc}") from exc

    def contains(self, namespace: bytes, key: bytes) -> bool:
        return time.monotonic() >= self._retry_at  # the reader thread asks: never the engine's

    def get(self, namespace: bytes, key: bytes) -> bytes | None:
        data = self._command("reads", b"GET", self._name(namespace, key))
        if data is not None:
            self.counters.bytes_read += len(data)
        return data

    def put(self, namespace: bytes, key: bytes, framed: list[memoryview], used_ns: int = 0) -> bool:
        del used_ns  # Redis's maxmemory policy orders its keys itself
        value = b"".join(framed)
        if self._command("writes", b"SET", self._name(namespace, key), value, b"NX") is None:
            return False  # another writer's copy is there
        self.counters.bytes_written += len(value)
        return True

    def mark_used(self, namespace: bytes, keys: list[bytes]) -> None:
        self._command("writes", b"TOUCH", *[self._name(namespace, key) for key in keys])  # for an LRU maxmemory

    def discard(self, namespace: bytes, key: bytes) -> None:
        try:
            self._command("reads", b"DEL", self._name(namespace, key))
        except OSError:
            pass  # it stays a block that fails its checks, removed by the next reader
