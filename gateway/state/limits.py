"""Rate limits: per API key, or per client address when auth is off; shared by replicas via Redis.

Deployments run several gateway replicas, so a per-process bucket multiplies a key's quota by the
replica count. When Redis is configured (cache.backend redis, limits.shared auto) each bucket lives
in Redis and is taken by one atomic Lua script, so all replicas draw from one quota. When Redis
fails or its breaker is open, admission fails open to the per-process bucket (the quota is then per
replica until Redis is back), never to "no limit" and never to an error.
Per-client buckets are bounded in number (least recently used dropped) whatever addresses connect,
and an IPv6 client is keyed on its /64 (one host usually holds all of it).
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

from gateway.config import GatewayConfig
from gateway.errors import RateLimited
from gateway.operations.metrics import GatewayMetrics
from gateway.state.auth import Principal, TokenBucket
from gateway.state.redis_link import RedisLink, RedisUnavailable

# Token bucket (the same arithmetic as TokenBucket) on Redis's clock, so replicas' clocks never
# matter. Returns the wait in seconds as a string (Lua numbers become integers in replies).
TOKEN_BUCKET_LUA: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(v[1])
local ts = tonumber(v[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""


@functools.lru_cache(maxsize=4096)  # per request otherwise: parsing an address costs a few µs
def client_key(address: str) -> str:
    """The rate-limit key of a client address: an IPv4 address itself, an IPv6 address its /64.

    One IPv6 host usually holds a whole /64 (SLAAC, privacy addresses), so keying on the full
    address would give a client 2^64 buckets; anything else (a unix socket path) is used as is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped
        if mapped is not None:
            return str(mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def client_address(peer: str | None) -> str:
    """The host of an HTTP client tuple's host or a gRPC peer string ('ipv4:127.0.0.1:5000')."""
    if not peer:
        return ""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6", "unix") and rest:
        host = rest.rsplit(":", 1)[0] if kind != "unix" else rest
        return host.strip("[]")
    return peer


class RateLimiter:
    def __init__(
        self,
        cfg: GatewayConfig,
        link: RedisLink | None,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        limits = cfg.limits
        self.link = link if limits.shared == "auto" else None
        self.prefix = f"{cfg.cache.namespace}:rl:"
        self.metrics = metrics
        self.clock = clock
        self.client_rate = limits.per_client_rate_per_s if not cfg.auth.keys else 0.0
        self.client_burst = max(limits.per_client_burst or limits.per_client_rate_per_s, 1.0)
        self.max_clients = limits.max_tracked_clients
        self._clients: OrderedDict[str, TokenBucket] = OrderedDict()
        self._script_sha: str | None = None

    @property
    def active(self) -> bool:
        return self.client_rate > 0 or self.link is not None

    async def check(self, principal: Principal | None, client: str) -> None:
        """Take one token from the caller's bucket, or raise RateLimited (429 with Retry-After)."""
        if principal is not None:
            if principal.bucket is None:
                return
            b = principal.bucket
            wait = await self._take(f"key:{principal.name}", b.rate, b.capacity, lambda: b, "key")
            if wait > 0:
                raise RateLimited(
                    f"rate limit for API key {principal.name!r} exceeded; retry in {wait:.2f}s",
                    headers={"retry-after": str(max(1, int(wait + 0.999)))},
                )
        elif self.client_rate > 0:
            key = client_key(client)
            wait = await self._take(
                f"client:{key}",
                self.client_rate,
                self.client_burst,
                lambda: self._client(key),
                "client",
            )
            if wait > 0:
                shown = client if key == client else f"{client} (in {key})"
                raise RateLimited(
                    f"rate limit for client address {shown!r} exceeded "
                    f"({self.client_rate:g}/s); retry in {wait:.2f}s",
                    headers={"retry-after": str(max(1, int(wait + 0.999)))},
                )

    async def _take(
        self, name: str, rate: float, burst: float, local: Callable[[], TokenBucket], scope: str
    ) -> float:
        if self.link is not None:
            try:
                wait = float(await self.link.call("ratelimit", lambda c: self._eval(c, name, rate, burst)))
            except RedisUnavailable:
                pass  # fail open to this process's bucket
            else:
                if wait > 0:
                    self.metrics.limited(scope, "redis")
                return wait
        wait = local().take()
        if wait > 0:
            self.metrics.limited(scope, "local")
        return wait

    async def _eval(self, client: Any, name: str, rate: float, burst: float) -> bytes:
        import redis

        c = client  # redis.asyncio.Redis
        if self._script_sha is None:
            self._script_sha = await c.script_load(TOKEN_BUCKET_LUA)
        try:
            return await c.evalsha(self._script_sha, 1, self.prefix + name, rate, burst)
        except redis.exceptions.NoScriptError:  # Redis restarted and lost its script cache
            self._script_sha = await c.script_load(TOKEN_BUCKET_LUA)
            return await c.evalsha(self._script_sha, 1, self.prefix + name, rate, burst)

    def _client(self, client: str) -> TokenBucket:
        bucket = self._clients.get(client)
        if bucket is None:
            bucket = self._clients[client] = TokenBucket(self.client_rate, self.client_burst, self.clock)
            if len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        return bucket

    def tracked_clients(self) -> int:
        return len(self._clients)
