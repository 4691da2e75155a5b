"""Which worker generates a stream, among the hosts sharing Redis: the holder of its producer lease,
``<key>:producer``, whose value is a token of the worker's own.

A worker renews a lease only where it is its own, or has lapsed. A worker frozen past its lease (a paused VM, a
SIGSTOP) whose stream another host took over for a reader finds the lease another's when it wakes, and stops its
own copy; it renewed the lease as its own before, and served its readers other events under the ids the other
host had written.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import gevent

# KEYS: the lease, the stream; ARGV: the holder's token, the lease's length (ms), the events the holder has. 1
# where the holder holds the lease now. A lapsed lease is taken again but where another worker continued the stream
# meanwhile, and gave its lease up at its end: Redis holds more events than the holder has, or the end (without
# ARGV[3], taken again all the same).
RENEW_IF_HELD_OR_LAPSED = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
if not holder and ARGV[3] then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
  if last and (last[2][1] == 'end' or tonumber(string.match(last[1], '^%d+')) > tonumber(ARGV[3])) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


class LeaseLost(Exception):
    """Another worker holds the stream's producer lease: it continues the stream, and this one's copy stops."""


class Leases:
    """This worker's producer leases, each ``lease_ms`` long unless renewed."""

    def __init__(self, client, lease_ms: int) -> None:
        self._client = client
        self._lease_ms = lease_ms
        self.holder = uuid.uuid4().hex
        self._renew = client.register_script(RENEW_IF_HELD_OR_LAPSED)

    @staticmethod
    def lease(key: str) -> str:
        return f"{key}:producer"

    def renew(self, key: str, events: int | None = None) -> None:
        """Renew the stream's lease, or take it where it lapsed (its holder has ``events``); LeaseLost where another
        worker holds it, or held it."""
        known = [] if events is None else [events]
        if not self._renew(keys=[self.lease(key), key], args=[self.holder, self._lease_ms, *known]):
            raise LeaseLost(key)

    def take(self, key: str) -> bool:
        """Take a lapsed lease (a stream whose host died, continued here); whether no other worker had it first."""
        return bool(self._client.set(self.lease(key), self.holder, nx=True, px=self._lease_ms))

    def check(self, key: str) -> None:
        """LeaseLost where another worker holds the stream's lease (one of this worker's writes was refused)."""
        holder = self._client.get(self.lease(key))
        if holder is not None and holder.decode() != self.holder:
            raise LeaseLost(key)

    def hold(self, key: str, period: float, errors: tuple, on_error: Callable[[Exception], None]) -> gevent.Greenlet:
        """Renew a taken lease every ``period`` s until the greenlet is killed (or the lease is another's, or Redis
        fails: ``on_error``)."""

        def renew() -> None:
            while True:
                gevent.sleep(period)  # a renewal period, not a wait for an event
                try:
                    self.renew(key)
                except LeaseLost:
                    return
                except errors as exc:
                    return on_error(exc)

        return gevent.spawn(renew)
