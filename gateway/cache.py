"""Response cache: cryptographic keys, an in-process LRU, a shared Redis backend, and coalescing.

Key: SHA-256 over the front protocol, model, resolved version, and the request's inputs (name,
datatype, shape, bytes), requested outputs and parameters, with the per-request `id` left out.
Only successful responses are stored, and only when Triton says it answered with the version the
key was resolved to, so a new version is never served a stale entry. Redis entries are namespaced
and carry an HMAC-SHA256 tag; a tampered entry is dropped, counted, and treated as a miss.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
KEY_VERSION = b"v1"


def cache_key(
    protocol: str, model: str, version: str, canonical_request: bytes, tensor_bytes: bytes = b""
) -> str:
    h = hashlib.sha256()
    for part in (KEY_VERSION, protocol.encode(), model.encode(), version.encode()):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    h.update(len(canonical_request).to_bytes(8, "big"))
    h.update(canonical_request)
    h.update(tensor_bytes)
    return h.hexdigest()


# Above this many bytes the key is hashed in a worker thread (hashlib releases the GIL), so one
# large request cannot stall the event loop for every other request (~1 ms per 2 MB here).
OFF_LOOP_BYTES = 256 * 1024


async def cache_key_async(
    protocol: str, model: str, version: str, canonical_request: bytes, tensor_bytes: bytes = b""
) -> str:
    if len(canonical_request) + len(tensor_bytes) < OFF_LOOP_BYTES:
        return cache_key(protocol, model, version, canonical_request, tensor_bytes)
    return await asyncio.to_thread(cache_key, protocol, model, version, canonical_request, tensor_bytes)


class CacheStats:
    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.tampered = 0
        self.errors = 0


class ResponseCache(Protocol):
    stats: CacheStats

    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes) -> None: ...

    def size_bytes(self) -> int: ...

    async def close(self) -> None: ...


class MemoryCache:
    """LRU bounded in bytes, entries expiring after a TTL."""

    def __init__(
        self,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[], None] | None = None,
    ) -> None:
        self.on_evict = on_evict
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self.stats = CacheStats()

    def _get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, value = entry
        if self.clock() >= expires:
            del self._entries[key]
            self._bytes -= len(value)
            return None
        self._entries.move_to_end(key)
        return value

    async def get(self, key: str) -> bytes | None:
        return self._get(key)

    def get_now(self, key: str) -> bytes | None:
        """Synchronous lookup for the hot path (the in-process cache never waits)."""
        return self._get(key)

    async def set(self, key: str, value: bytes) -> None:
        if len(value) > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= len(old[1])
        self._entries[key] = (self.clock() + self.ttl_s, value)
        self._bytes += len(value)
        while self._bytes > self.max_bytes and self._entries:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= len(evicted)
            self.stats.evictions += 1
            if self.on_evict:
                self.on_evict()

    def size_bytes(self) -> int:
        return self._bytes

    async def close(self) -> None:
        self._entries.clear()
        self._bytes = 0


class RedisCache:
    """Shared across gateway replicas; `<namespace>:<key>` -> 32-byte HMAC tag + payload, with a TTL."""

    def __init__(
        self,
        url: str,
        namespace: str,
        secret: str,
        ttl_s: float,
        timeout_s: float = 0.25,
        on_tamper: Callable[[], None] | None = None,
    ) -> None:
        import redis.asyncio as redis

        self.on_tamper = on_tamper
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.namespace = namespace
        self.secret = secret.encode()
        self.ttl_ms = int(ttl_s * 1000)
        self.stats = CacheStats()

    def _key(self, key: str) -> str:
        return f"{self.namespace}:{key}"

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self.secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    async def get(self, key: str) -> bytes | None:
        import redis

        try:
            raw = await self.client.get(self._key(key))
        except (redis.RedisError, OSError) as exc:
            self.stats.errors += 1
            logger.warning("redis cache get failed (%s); serving from Triton", exc)
            return None
        if raw is None:
            return None
        if isinstance(raw, str):  # only with decode_responses=True, which this client never sets
            raw = raw.encode()
        tag, value = raw[:32], raw[32:]
        if len(raw) < 32 or not hmac.compare_digest(tag, self._tag(key, value)):
            self.stats.tampered += 1
            if self.on_tamper:
                self.on_tamper()
            logger.error("redis cache entry %s failed its integrity check; dropped", self._key(key))
            try:
                await self.client.delete(self._key(key))
            except (redis.RedisError, OSError):
                pass
            return None
        return value

    async def set(self, key: str, value: bytes) -> None:
        import redis

        try:
            await self.client.set(self._key(key), self._tag(key, value) + value, px=self.ttl_ms)
        except (redis.RedisError, OSError) as exc:
            self.stats.errors += 1
            logger.warning("redis cache set failed: %s", exc)

    def size_bytes(self) -> int:
        return 0  # Redis reports its own memory; not tracked per gateway

    async def close(self) -> None:
        await self.client.aclose()


class Coalescer:
    """Identical concurrent requests share one upstream call (single-flight)."""

    def __init__(self) -> None:
        self._inflight: dict[str, asyncio.Future[Any]] = {}
        self.coalesced = 0

    async def run(self, key: str, fn: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """Return (result, shared): shared is True when another caller's call produced it."""
        fut = self._inflight.get(key)
        if fut is not None:
            self.coalesced += 1
            return await asyncio.shield(fut), True
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            result = await fn()
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: waiters re-raise it, nobody may be waiting
            raise
        else:
            fut.set_result(result)
            return result, False
        finally:
            del self._inflight[key]
