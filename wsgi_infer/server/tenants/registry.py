"""The server's keys, their shares and their limits, as requests meet them: ``identify`` a presented key,
``admit`` a request against its key's limits, ``track`` its stream so the limits hear of its first token and its
end."""

from __future__ import annotations

import hashlib
import hmac
import logging

import gevent

from ...engine.sampling_params import SamplingParams
from ..engine_client.served_model import ServedModel
from ..engine_client.streams import RequestStream
from ..settings import ServerSettings
from .keys import KeyPolicy, load_keys
from .limits import Decision, Ledger, LimitStore
from .local_store import LocalLimitStore
from .redis_limits import RedisLimitStore, RedisUnavailable

log = logging.getLogger(__name__)


class Tenants:
    def __init__(self, settings: ServerSettings) -> None:
        self.policies = load_keys(settings.api_keys, settings.keys_file)
        self.ledger = None
        if any(policy.limited for policy in self.policies):
            store: LimitStore = RedisLimitStore(settings.redis_url) if settings.redis_url else LocalLimitStore()
            self.ledger = Ledger(store)
        self._store_down = False

    def identify(self, presented: list[str]) -> KeyPolicy | None:
        """The policy of the first presented key that is one of ours, compared with every key in constant time."""
        digests = [hashlib.sha256(p.encode()).digest() for p in presented]
        matches = [policy for d in digests for policy in self.policies if hmac.compare_digest(d, policy.digest)]
        return matches[0] if matches else None

    @staticmethod
    def share(policy: KeyPolicy, params: list[SamplingParams]) -> None:
        """The key's share of the engine, and its priority cap, on each choice's parameters."""
        for p in params:
            p.tenant, p.tenant_weight, p.priority = policy.id, policy.weight, policy.priority(p.priority)

    def admit(self, policy: KeyPolicy, prompt_tokens: int) -> Decision:
        """A ticket for the request, or the limit it is over. With the shared state unreachable (Redis down),
        requests are admitted uncounted, and one warning says so."""
        if self.ledger is None or not policy.limited:
            return Decision("")
        try:
            decision = self.ledger.admit(policy, prompt_tokens)
        except RedisUnavailable as exc:
            if not self._store_down:
                log.warning("limits not enforced until Redis answers again: %s", exc)
            self._store_down = True
            return Decision("")
        if self._store_down:
            log.info("Redis answers again: limits enforced")
        self._store_down = False
        return decision

    def track(self, policy: KeyPolicy, ticket: str, stream: RequestStream, model: ServedModel) -> None:
        """Count the request under its key (open on the model, its tokens), and tell the limits when its first
        token comes and when it ends."""
        metrics = model.metrics

        def close() -> None:
            model.open_by_key[policy.id] -= 1
            metrics.of_key("prompt_tokens", policy.id).inc(stream.prompt_tokens)
            metrics.of_key("generation_tokens", policy.id).inc(stream.completion_tokens)
            if ticket:
                self._quietly(self.ledger.finish, policy, ticket, stream.completion_tokens)

        model.open_by_key[policy.id] += 1
        metrics.of_key("requests", policy.id).inc()
        stream.on_close = close
        if ticket:  # the first token comes in the bridge's delivery, which must not wait for Redis
            stream.on_first_token = lambda: gevent.spawn(self._quietly, self.ledger.started, policy, ticket)

    @staticmethod
    def within_equal_share(policy: KeyPolicy | None, model: ServedModel, limit: int) -> bool:
        """Whether a key holds fewer of the model's open requests than an equal share of ``limit`` among the keys
        with any open (itself included): a full queue refuses the keys that filled it, not a newcomer."""
        if policy is None:
            return False
        keys = {key for key, n in model.open_by_key.items() if n} | {policy.id}
        return model.open_by_key[policy.id] < limit / len(keys)

    @staticmethod
    def _quietly(call, *args) -> None:
        try:
            call(*args)
        except RedisUnavailable as exc:
            log.warning("a request's first token or end was not counted in its key's limits: %s", exc)
