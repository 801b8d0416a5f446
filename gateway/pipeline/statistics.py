"""Triton's statistics extension through the gateway: one answer aggregated across servers, for
both fronts (`answer`: each front brings only how it asks one server and how it writes the result).

`GET /v2/models[/{m}[/versions/{v}]]/stats` and gRPC `ModelStatistics` ask every server the gateway
would route the model to (the pinned region's servers when the client pins one) and answer in
Triton's own format with the per-model/version sums: counts and durations add up, `last_inference`
is the latest, batch statistics add up per batch size. Benchmarking tools (perf_analyzer, Model
Analyzer) read these deltas to split latency into queue and compute time; summed over the servers
that shared the load, they describe the fleet as one server. Format: Triton's statistics extension
(docs/protocol/extension_statistics.md), in JSON over HTTP and `ModelStatisticsResponse` over gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.errors import BadRequest, NoReadyServer, RetryableUpstream, UpstreamRejected
from gateway.pipeline import admission, forward
from gateway.pipeline.call import Call
from gateway.state.auth import Principal
from gateway.upstream.server import UpstreamServer

if TYPE_CHECKING:
    from gateway.core import Gateway

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Pins statistics to one server by name (the name the gateway returns in this same header).
SERVER_HEADER = "x-skewserve-server"

# Fields that name a thing rather than count it: kept, never added up.
_TEXT = frozenset({"name", "version", "type"})
_IDENTITY = frozenset({"name", "version", "type", "batch_size", "id"})
_LATEST = frozenset({"last_inference"})  # a timestamp: the fleet's latest, not a sum
# List fields and the fields that identify one item in them (items with equal identity merge).
_LIST_KEYS = {
    "model_stats": ("name", "version"),
    "batch_stats": ("batch_size",),
    "memory_usage": ("type", "id"),
}


def _normalise(value: Any, key: str = "") -> Any:
    """Protobuf's JSON mapping writes 64-bit integers as strings; Triton's HTTP JSON as numbers."""
    if isinstance(value, dict):
        return {k: _normalise(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalise(v, key) for v in value]
    if isinstance(value, str) and key not in _TEXT and value.lstrip("-").isdigit():
        return int(value)
    return value


def _merge(a: Any, b: Any, key: str) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge(a[k], v, k) if k in a else v
        return out
    if isinstance(a, list) and isinstance(b, list):
        ident = _LIST_KEYS.get(key)
        if ident is None:
            return a + b
        merged: dict[tuple[Any, ...], Any] = {}
        for item in (*a, *b):
            k = tuple(item.get(f) for f in ident) if isinstance(item, dict) else (id(item),)
            merged[k] = _merge(merged[k], item, key) if k in merged else item
        return list(merged.values())
    if key in _IDENTITY:
        return a
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool):
        return max(a, b) if key in _LATEST else a + b
    return a


def merge_statistics(responses: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Sum statistics responses (Triton's JSON, or protobuf's JSON mapping) per model and version."""
    out: dict[str, Any] = {"model_stats": []}
    for resp in responses:
        out = _merge(out, _normalise(resp), "")
    return out


def only_allowed(stats: dict[str, Any], principal: Principal | None) -> dict[str, Any]:
    """Drop models the caller's key may not use (all-model statistics with a restricted key)."""
    if principal is None or "*" in principal.models:
        return stats
    return {**stats, "model_stats": [m for m in stats["model_stats"] if principal.allows(str(m.get("name")))]}


def statistics_servers(
    servers: list[UpstreamServer],
    regions: dict[str, list[UpstreamServer]],
    model: str,
    version: str,
    pinned: str | None,
    region_header: str,
    now: float,
    server: str | None = None,
) -> list[UpstreamServer]:
    """The servers a request for `model` could be routed to now (all available ones for all models).

    When none holds the model, one available server, so Triton answers "unknown model" itself.
    A pinned server (`x-skewserve-server`) is asked alone, whatever its health: its own figures.
    """
    if server is not None:
        named = [s for s in servers if s.name == server]
        if not named:
            raise BadRequest(
                f"{SERVER_HEADER} names unknown server {server!r}; servers are {sorted(s.name for s in servers)}"
            )
        return named
    if pinned is not None:
        if pinned not in regions:
            raise BadRequest(
                f"{region_header} names unknown region {pinned!r}; regions are {sorted(regions)}"
            )
        servers = regions[pinned]
    available = [s for s in servers if s.available(now)]
    if not available:
        where = f"region {pinned!r}" if pinned is not None else "any region"
        raise NoReadyServer(f"no Triton server is ready in {where}")
    if not model:
        return available
    holding = [s for s in available if s.has_model(model, version)]
    return holding or available[:1]


async def gather_statistics(
    servers: list[UpstreamServer], fetch: Callable[[UpstreamServer], Awaitable[T]]
) -> tuple[list[T], list[UpstreamServer]]:
    """Ask every server at once; return the answers and the servers that gave them.

    A server that fails before answering (down, timed out) is left out, so the fleet's figures stay
    readable while one server is lost; Triton's own rejection is passed on when no server answered.
    """
    results = await asyncio.gather(*(fetch(s) for s in servers), return_exceptions=True)
    answers: list[T] = []
    answered: list[UpstreamServer] = []
    rejected: UpstreamRejected | None = None
    failed: BaseException | None = None
    for server, result in zip(servers, results, strict=True):
        if isinstance(result, UpstreamRejected):
            rejected = rejected or result
        elif isinstance(result, RetryableUpstream):
            logger.warning("statistics: %s did not answer: %s", server.name, result.message)
            failed = failed or result
        elif isinstance(result, BaseException):
            raise result
        else:
            answers.append(result)
            answered.append(server)
    if not answers:
        if rejected is not None:
            raise rejected
        assert failed is not None
        raise failed
    return answers, answered


async def answer(
    gw: Gateway,
    call: Call,
    server: str | None,
    fetch: Callable[[UpstreamServer, float], Awaitable[dict[str, Any]]],
) -> tuple[dict[str, Any], list[UpstreamServer]]:
    """The statistics a caller asked for, summed over the servers its model is routed to (or the one
    `server` names): admitted as any request, each server asked with `fetch(server, seconds left)`,
    and only the models the caller's key may use kept. Returns the answer and who gave it."""
    async with admission.admitted(gw, call):
        deadline = forward.plain_deadline(gw, call)
        servers = statistics_servers(
            gw.servers,
            {name: region.servers for name, region in gw.router.regions.items()},
            call.model,
            call.version,
            call.pinned,
            gw.cfg.routing.region_header,
            gw.clock(),
            server,
        )
        answers, answered = await gather_statistics(
            servers, lambda s: fetch(s, max(0.0, deadline - gw.clock()))
        )
        return only_allowed(merge_statistics(answers), call.principal), answered
