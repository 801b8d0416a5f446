"""Response cache: cryptographic keys, an in-process LRU and a shared Redis backend.

Key: SHA-256 over the front protocol, model, resolved version, and the request's inputs (name,
datatype, shape, bytes), requested outputs and parameters, with the per-request `id` left out.
Only successful responses are stored, and only when Triton says it answered with the version the
key was resolved to, so a new version is never served a stale entry. Redis entries are namespaced
and carry an HMAC-SHA256 tag over namespace, key and payload; a tampered or moved entry is dropped,
counted, and treated as a miss. Coalescing of identical in-flight requests is in `coalesce.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol, TypeVar

from gateway.state.coalesce import Coalescer
from gateway.state.redis_link import RedisLink, RedisUnavailable, ThrottledLog
from gateway.task_stop import cancel_and_wait

__all__ = ["Coalescer", "MemoryCache", "RedisCache", "ResponseCache", "cache_key", "cache_key_async"]

logger: Final = logging.getLogger(__name__)
T = TypeVar("T")
# v2: entries' HMAC covers namespace and key. Bumped so replicas of both formats, side by side
# during a rolling upgrade, never read each other's entries (which would count as tampering).
KEY_VERSION: Final = b"v2"
TAG_DOMAIN: Final = b"skewserve-cache-entry-v2\0"


def cache_key(
    protocol: str,
    model: str,
    version: str,
    canonical_request: bytes,
    tensor_bytes: bytes = b"",
    tenant: str = "",
) -> str:
    """The entry's name. `tenant` (cache.tenancy per_key: the API key's name) keeps each key's
    entries apart; empty, the key is the shared one every caller can hit."""
    h = hashlib.sha256()
    parts: tuple[bytes, ...] = (KEY_VERSION, protocol.encode(), model.encode(), version.encode())
    if tenant:
        parts += (b"tenant", tenant.encode())
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    h.update(len(canonical_request).to_bytes(8, "big"))
    h.update(canonical_request)
    h.update(tensor_bytes)
    return h.hexdigest()


# Above this many bytes the key is hashed in a worker thread (hashlib releases the GIL), so one
# large request cannot stall the event loop for every other request (~1 ms per 2 MB here).
OFF_LOOP_BYTES: Final = 256 * 1024


async def cache_key_async(
    protocol: str,
    model: str,
    version: str,
    canonical_request: bytes,
    tensor_bytes: bytes = b"",
    tenant: str = "",
) -> str:
    args = (protocol, model, version, canonical_request, tensor_bytes, tenant)
    if len(canonical_request) + len(tensor_bytes) < OFF_LOOP_BYTES:
        return cache_key(*args)
    return await asyncio.to_thread(cache_key, *args)


class CacheStats:
    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.tampered = 0
        self.errors = 0

    def as_dict(self) -> dict[str, int]:
        # Not `vars(stats)`: compiled (mypyc) instances have no __dict__.
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "tampered": self.tampered,
            "errors": self.errors,
        }


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
    """Shared across gateway replicas; `<namespace>:<key>` -> 32-byte HMAC tag + payload, with a TTL.

    Reads fail open (a miss) when Redis fails or its breaker is open. Writes never hold a request:
    they go to a bounded queue drained by one owned background task, and are dropped (counted)
    when the queue is full or Redis is unavailable.
    """

    def __init__(
        self,
        link: RedisLink,
        namespace: str,
        secret: str,
        ttl_s: float,
        queue_size: int = 1024,
        on_tamper: Callable[[], None] | None = None,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.link = link
        self.on_tamper = on_tamper
        self.on_drop = on_drop
        self.namespace = namespace
        self.secret = secret.encode()
        self.ttl_ms = int(ttl_s * 1000)
        self.stats = CacheStats()
        # Every tampered entry is counted (on_tamper); logged at most once per interval, so a
        # flood of bad entries is no log storm.
        self.log = ThrottledLog(logger)
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(queue_size)
        self._writer: asyncio.Task[None] | None = None

    def _key(self, key: str) -> str:
        return f"{self.namespace}:{key}"

    def _tag(self, key: str, value: bytes) -> bytes:
        """HMAC over the namespace and key as well as the payload: an entry copied to another key or
        namespace fails the check. Each part is length-prefixed so parts cannot run into each other."""
        mac = hmac.new(self.secret, TAG_DOMAIN, hashlib.sha256)
        for part in (self.namespace.encode(), key.encode()):
            mac.update(len(part).to_bytes(4, "big"))
            mac.update(part)
        mac.update(value)
        return mac.digest()

    async def get(self, key: str) -> bytes | None:
        try:
            raw = await self.link.call("get", lambda c: c.get(self._key(key)))
        except RedisUnavailable:
            self.stats.errors += 1
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
            self.log.error(
                "tamper", "redis cache entry %s failed its integrity check; dropped", self._key(key)
            )
            try:
                await self.link.call("delete", lambda c: c.delete(self._key(key)))
            except RedisUnavailable:
                pass
            return None
        return value

    async def set(self, key: str, value: bytes) -> None:
        """Queue the write for the background writer; never waits for Redis."""
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        try:
            self._queue.put_nowait((key, value))
        except asyncio.QueueFull:
            self._dropped()

    def _dropped(self) -> None:
        self.stats.errors += 1
        if self.on_drop:
            self.on_drop()

    async def _write_loop(self) -> None:
        while True:
            key, value = await self._queue.get()
            entry = self._tag(key, value) + value
            try:
                await self.link.call("set", self._setter(self._key(key), entry))
            except RedisUnavailable:
                self._dropped()

    def _setter(self, key: str, entry: bytes) -> Callable[[Any], Awaitable[Any]]:
        async def write(client: Any) -> Any:
            return await client.set(key, entry, px=self.ttl_ms)

        return write

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until queued writes are written or dropped; for tests and shutdown."""
        deadline = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def queued(self) -> int:
        return self._queue.qsize()

    def size_bytes(self) -> int:
        return 0  # Redis reports its own memory; not tracked per gateway

    async def close(self) -> None:
        if self._writer is not None:
            await cancel_and_wait(self._writer)
        await self.link.close()
