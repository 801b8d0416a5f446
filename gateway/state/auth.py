"""Admission: API keys (stored as SHA-256 hashes, compared in constant time), per-key model lists
and token-bucket rate limits, request size and batch limits. Keys never reach the logs."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import ApiKeyConfig, AuthConfig
from gateway.errors import PermissionDenied, RateLimited, Unauthenticated


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate = rate_per_s
        self.capacity = max(burst, 1.0)
        self.tokens = self.capacity
        self.clock = clock
        self.last = clock()

    def take(self) -> float:
        """0.0 when a token was taken; otherwise seconds until one is available."""
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass
class Principal:
    name: str
    models: frozenset[str]
    bucket: TokenBucket | None
    # set by the gateway on every request of this key (auth.keys[].headers), lower-cased names
    headers: tuple[tuple[str, str], ...] = ()

    def allows(self, model: str) -> bool:
        return "*" in self.models or model in self.models


class Authenticator:
    def __init__(
        self,
        cfg: AuthConfig,
        clock: Callable[[], float] = time.monotonic,
        carried: dict[str, Principal] | None = None,
    ) -> None:
        self.enabled = bool(cfg.keys)
        self._clock = clock
        carried = carried or {}
        # keyed by the whole entry (name, hash, models, rate, burst, admin) as JSON
        self._by_entry: dict[str, Principal] = {}
        self._keys: list[tuple[bytes, Principal]] = []
        # names some key binds: a client's own header of such a name is never forwarded
        self.bound_names = frozenset(name for k in cfg.keys for name in k.headers)
        for k in cfg.keys:
            entry = k.model_dump_json()
            principal = carried.get(entry) or self._principal(k, clock)
            self._by_entry[entry] = principal
            self._keys.append((bytes.fromhex(k.sha256), principal))

    def is_current(self, principal: Principal | None) -> bool:
        """Whether a caller authenticated earlier (an open stream's) still holds a key of this
        list as it was: False once a reload removed or changed its key."""
        return principal is None or any(p is principal for p in self._by_entry.values())

    def with_keys(self, cfg: AuthConfig) -> Authenticator:
        """An authenticator for a reloaded key list. A key whose entry did not change keeps its
        principal, so its rate bucket is not refilled by a reload; a removed key is refused at once."""
        return Authenticator(cfg, self._clock, self._by_entry)

    @staticmethod
    def _principal(k: ApiKeyConfig, clock: Callable[[], float]) -> Principal:
        bucket = TokenBucket(k.rate_per_s, k.burst or k.rate_per_s, clock) if k.rate_per_s > 0 else None
        return Principal(k.name, frozenset(k.models), bucket, tuple(sorted(k.headers.items())))

    def authenticate(self, authorization: str | None, api_key: str | None) -> Principal | None:
        """The caller's principal (None when auth is off); raises 401 for a missing or unknown key."""
        if not self.enabled:
            return None
        key = api_key
        if key is None and authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and value:
                key = value.strip()
        if not key:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for stored, principal in self._keys:  # every stored hash compared, in constant time each
            if hmac.compare_digest(stored, digest):
                found = principal
        if found is None:
            raise Unauthenticated("invalid API key")
        return found

    @staticmethod
    def check_model(principal: Principal | None, model: str) -> None:
        """403 when an authenticated caller may not use `model` (rate limits are `limits.py`'s)."""
        if principal is not None and not principal.allows(model):
            raise PermissionDenied(f"API key {principal.name!r} may not use model {model!r}")

    @staticmethod
    def admit(principal: Principal | None, model: str) -> None:
        """Check the model list and this process's rate bucket of an authenticated caller."""
        if principal is None:
            return
        Authenticator.check_model(principal, model)
        if principal.bucket is not None:
            wait = principal.bucket.take()
            if wait > 0:
                retry_after = max(1, int(wait + 0.999))
                raise RateLimited(
                    f"rate limit for API key {principal.name!r} exceeded; retry in {wait:.2f}s",
                    headers={"retry-after": str(retry_after)},
                )
