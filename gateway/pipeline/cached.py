"""Cache and coalescing: a stored answer, or one fetch shared by identical in-flight requests.

The exact-bytes alias (gateway/pipeline/cache_alias.py) is looked up before the request is parsed;
a miss parses, keys, then asks the cache and the coalescer (gateway/core.py `Gateway.cached`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from gateway.pipeline import cascade, forward
from gateway.pipeline.cache_alias import ExactAliases
from gateway.pipeline.call import Call, Request

if TYPE_CHECKING:
    from gateway.core import Gateway

A = TypeVar("A")


def resolve(gw: Gateway, call: Call) -> str:
    """The version an answer is filed under (once per request: alias and key must agree); a bad
    region pin is a 400 whether or not the answer is cached."""
    if call.pinned is not None:
        gw.router.check_pin(call.pinned)
    if call.cascade is not None:  # its rules and its stages' versions
        return cascade.resolved(gw, call.cascade)
    return call.version or gw.router.latest_version(call.model)


async def alias_hit(
    gw: Gateway, call: Call, aliases: ExactAliases[A], alias: bytes, shared: Callable[[bytes], A]
) -> A | None:
    key = aliases.key(alias)
    if key is None:
        return None
    stored = await gw.cache_lookup(key, call.model)
    if stored is None:
        return None  # expired or evicted: the keyed path counts the miss and fetches
    call.cache_state = "hit"
    return aliases.answer(alias, stored, shared)


async def answer(
    gw: Gateway,
    call: Call,
    request: Request[A],
    resolved: str,
    aliases: ExactAliases[A],
    alias: bytes | None,
) -> A:
    key = await request.cache_key(resolved, gw.cache_tenant(call.principal))
    if alias is not None and not request.request_id:
        aliases.remember(alias, key)

    async def fetch() -> tuple[A, bytes | None]:
        if call.cascade is not None:
            return await cascade.fetch(gw, call, request)
        value: Any = await forward.send(gw, call, request, shared=True)
        return value, request.storable(value, resolved) if resolved else None

    try:
        value, state = await gw.cached(key, call.model, fetch, request.decode, call.deadline, call.pinned)
    except cascade.OfflineAnswer as offline:  # this request's own answer, shared with nobody
        value, state = cast(A, offline.answer), "miss"
    call.cache_state = state
    return request.restamp(value) if state != "miss" else value
