"""Weighted fair share between tenants (API keys): whose request is admitted next, whose sequence gives up its
seat or its blocks, and whose prefill a step may carry in full.

Each tenant has a virtual token counter: the tokens computed for it (prefill and decode), divided by its weight
(Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024). Of the tenants with work waiting, the one
with the smallest counter is admitted first. A tenant that gets work after being idle comes back level with the
least-served tenant that has work (as ``StepSharing`` does for models, and a task's virtual runtime in Linux's fair
scheduler): its idleness is no credit to spend in a burst, its past work no debt. One object serves every model of
an engine thread, so a key's share counts its tokens on all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from .sequence import Sequence

# A tenant whose last request ended this recently still counts as present: a chat's next request comes a moment
# after its last, and must not find the engine in the middle of another tenant's long unpaced chunk.
RECENT_SECONDS = 2.0


class FairShare:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._served: dict[str, float] = {}  # tokens computed over weight, relative to the others
        self._weights: dict[str, float] = {}
        self._open: dict[str, int] = {}  # sequences not finished, per tenant
        self._left: dict[str, float] = {}  # when each tenant's last sequence ended
        self._clock = clock

    def join(self, seq: Sequence) -> None:
        """A sequence arrived."""
        tenant = seq.tenant
        if not self._open.get(tenant):
            level = min((self._served[t] for t, n in self._open.items() if n), default=None)
            own = self._served.get(tenant, 0.0)
            self._served[tenant] = own if level is None else max(own, level)
        self._open[tenant] = self._open.get(tenant, 0) + 1
        self._weights[tenant] = seq.params.tenant_weight  # the latest request's: a reloaded keys file applies

    def leave(self, seq: Sequence) -> None:
        """A sequence finished or was aborted."""
        self._open[seq.tenant] -= 1
        if not self._open[seq.tenant]:
            self._left[seq.tenant] = self._clock()

    def recently_present(self) -> set[str]:
        """Tenants with nothing open whose last sequence ended within ``RECENT_SECONDS``."""
        since = self._clock() - RECENT_SECONDS
        return {t for t, at in self._left.items() if at >= since and not self._open.get(t)}

    def charge(self, tenant: str, num_tokens: int) -> None:
        self._served[tenant] += num_tokens / self._weights[tenant]

    def served(self, tenant: str) -> float:
        return self._served.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def least_served(self, tenants: Iterable[str], seats: Mapping[str, int]) -> str:
        """Of ``tenants``, the one with the smallest counter; of equals, the one holding the fewest seats (running
        sequences): a tenant just back from idle is level with the busy ones, and goes first."""
        return min(tenants, key=lambda t: (self.served(t), seats.get(t, 0)))

    def seat_victim(self, tenant: str, seats: Mapping[str, int]) -> str | None:
        """The tenant that gives ``tenant`` a seat (a running sequence): the one holding the most seats per weight,
        if it still holds at least ``tenant``'s share after giving one. The rule moves seats only towards equal
        shares, so two busy tenants never take seats back and forth."""
        others = [t for t, n in seats.items() if n and t != tenant]
        if not others:
            return None
        richest = max(others, key=lambda t: (seats[t] / self.weight(t), self.served(t)))
        if (seats[richest] - 1) / self.weight(richest) >= (seats.get(tenant, 0) + 1) / self.weight(tenant):
            return richest
        return None
