"""API keys and what each one may use.

Keys come from ``api_key`` (each its own tenant: weight 1, no limits) and from ``keys_file``, a TOML file of
``[keys.NAME]`` tables (README, "Keys, shares and limits"). A key's id (its table name, or for a key from
``api_key`` the first 12 hex digits of its SHA-256) names it in metrics and logs; the key itself never appears.
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..master_reads import as_the_master_read
from ..settings import table_problems, toml_tables


class KeysConfigError(ValueError):
    pass


class KeyLimits(BaseModel):
    """A key's limits; absent: none. Concurrent and queued requests count across the server's workers (and with
    ``redis_url`` across servers); the per-minute ones are buckets that refill evenly over a minute."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_requests: int | None = Field(None, ge=1, description="requests open at once")
    max_queued_requests: int | None = Field(None, ge=0, description="requests open with no token yet")
    requests_per_minute: int | None = Field(None, ge=1)
    prompt_tokens_per_minute: int | None = Field(None, ge=1)
    generated_tokens_per_minute: int | None = Field(None, ge=1)


class KeyPolicy(KeyLimits):
    id: str
    key: str | None = Field(None, min_length=1, description="the key itself")
    key_sha256: str | None = Field(None, pattern="^[0-9a-fA-F]{64}$", description="or its SHA-256, in hex")
    weight: float = Field(1.0, gt=0, le=1e6, description="its share of the engine when keys contend")
    admin: bool = Field(False, description="may load and unload models, and set a request's keep_alive")
    min_priority: int | None = Field(
        None, description="the most urgent priority its requests run at (lower is more urgent): a lower one is raised"
    )

    @model_validator(mode="after")
    def _one_key(self) -> KeyPolicy:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give key or key_sha256, one of them")
        return self

    @property
    def digest(self) -> bytes:
        """The key's SHA-256: what a presented key is compared with."""
        return bytes.fromhex(self.key_sha256) if self.key_sha256 else hashlib.sha256(self.key.encode()).digest()

    @property
    def tenant(self) -> str:
        """Where what the key creates (stored responses, resumable streams) is kept apart from other keys'."""
        return self.digest.hex()[:32]

    @property
    def limited(self) -> bool:
        return any(getattr(self, name) is not None for name in KeyLimits.model_fields)

    def priority(self, asked: int) -> int:
        return asked if self.min_priority is None else max(asked, self.min_priority)


def load_keys(api_keys: list[str], keys_file: str | None) -> list[KeyPolicy]:
    """Every key the settings give, as the master read them (``master_reads``); raises KeysConfigError naming the
    file and the table."""
    return as_the_master_read("keys", (tuple(api_keys), keys_file), lambda: read_keys(api_keys, keys_file))


def read_keys(api_keys: list[str], keys_file: str | None) -> list[KeyPolicy]:
    """Every key the settings give, the keys file read now; raises KeysConfigError naming the file and the table."""
    # Named by their place: a public /metrics labels series by id, and a hash of a weak key is undone offline
    # The operator's own keys: each may load and unload models (a keys-file table's, where it says admin = true)
    policies = [KeyPolicy(id=f"api-key-{i}", key=key, admin=True) for i, key in enumerate(api_keys, 1)]
    tables = toml_tables(keys_file, "keys", KeysConfigError, "keys file")
    if keys_file and not tables:
        raise KeysConfigError(f"keys file {keys_file!r} holds no [keys.NAME] table")
    for name, table in tables.items():
        try:
            policies.append(KeyPolicy(id=name, **table))
        except ValidationError as exc:
            raise KeysConfigError(f"keys file {keys_file!r}: [keys.{name}]: {table_problems(exc)}") from None
        except TypeError:
            raise KeysConfigError(f"keys file {keys_file!r}: [keys.{name}] is not a table") from None
    seen: dict[bytes, str] = {}
    for policy in policies:
        if policy.digest in seen:
            raise KeysConfigError(f"one key is given twice ({seen[policy.digest]} and {policy.id})")
        seen[policy.digest] = policy.id
    return policies
