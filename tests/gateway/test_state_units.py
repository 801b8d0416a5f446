"""Units of the gateway's state under hostile input and faults: breaker, throttled log, coalescer,
rate limiter bounds, secret checks, and the config fields that reach each of them."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import pytest

from gateway.config import GatewayConfig, secret_weakness
from gateway.errors import UpstreamRejected, UpstreamTimeout
from gateway.operations.metrics import OTHER_MODEL, GatewayMetrics
from gateway.state.coalesce import Coalescer
from gateway.state.limits import RateLimiter, client_address
from gateway.state.redis_link import CircuitBreaker, ThrottledLog


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _cfg(**overrides: Any) -> GatewayConfig:
    data: dict[str, Any] = {
        "home_region": "a",
        "regions": [{"name": "a", "servers": [{"name": "s", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]}],
    }
    data.update(overrides)
    return GatewayConfig(**data)


def test_breaker_opens_after_n_failures_and_probes_once_per_cooldown() -> None:
    clock = FakeClock()
    b = CircuitBreaker(3, 5.0, clock)
    assert not b.failure() and not b.failure() and b.allows()
    assert b.success() is False and b.consecutive == 0  # a success resets the count
    assert [b.failure() for _ in range(3)] == [False, False, True]
    assert b.state == "open" and not b.allows() and b.opened == 1
    clock.now += 4.9
    assert not b.probe_due()
    clock.now += 0.1
    assert b.probe_due() and b.state == "half_open" and not b.probe_due()  # one probe at a time
    assert not b.failure() and b.state == "open" and b.opened == 1  # a failed probe: another cool-down
    clock.now += 4.0
    assert not b.probe_due()
    clock.now += 1.0
    assert b.probe_due() and b.success() and b.allows()


def test_throttled_log_says_how_many_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    log = ThrottledLog(logging.getLogger("t.throttle"), 10.0, clock)
    with caplog.at_level(logging.WARNING, "t.throttle"):
        assert log.warning("get", "redis get failed (%s)", "x")
        assert not any(log.warning("get", "redis get failed (%s)", "x") for _ in range(99))
        assert log.warning("set", "redis set failed")  # other kinds have their own interval
        clock.now += 10.0
        assert log.warning("get", "redis get failed (%s)", "y")
    assert [r.getMessage() for r in caplog.records] == [
        "redis get failed (x)",
        "redis set failed",
        "redis get failed (y) (99 similar message(s) suppressed in the last 10s)",
    ]


def test_a_follower_ends_at_its_own_deadline_and_the_leader_is_unaffected() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        c = Coalescer(clock=loop.time)
        release = asyncio.Event()
        followed: list[int] = []

        async def slow() -> int:
            await release.wait()
            return 7

        leader = asyncio.ensure_future(c.run("k", slow))
        await asyncio.sleep(0)
        with pytest.raises(UpstreamTimeout, match="waiting for an identical in-flight request"):
            await c.run("k", slow, loop.time() + 0.05, lambda: followed.append(1))
        assert not leader.done() and followed == [1]
        release.set()
        assert await leader == (7, False)

    asyncio.run(run())


def test_followers_retry_when_the_leader_is_cancelled_or_times_out() -> None:
    async def run() -> None:
        c = Coalescer()
        calls = 0
        gate = asyncio.Event()

        async def work() -> int:
            nonlocal calls
            calls += 1
            await gate.wait()
            return calls

        leader = asyncio.ensure_future(c.run("k", work))
        await asyncio.sleep(0)
        follower = asyncio.ensure_future(c.run("k", work))
        await asyncio.sleep(0)
        leader.cancel()
        await asyncio.sleep(0)
        assert not follower.done()  # it now leads: the cancellation stayed the leader's
        gate.set()
        assert await follower == (2, False)

        async def own_deadline() -> int:
            raise UpstreamTimeout("deadline exceeded after 1 attempt(s)")

        gate2 = asyncio.Event()

        async def first() -> int:
            await gate2.wait()
            return await own_deadline()

        async def second() -> int:
            return 99

        lead = asyncio.ensure_future(c.run("t", first))
        await asyncio.sleep(0)
        follow = asyncio.ensure_future(c.run("t", second))
        await asyncio.sleep(0)
        gate2.set()
        with pytest.raises(UpstreamTimeout):
            await lead
        assert await follow == (99, False)

        async def rejected() -> int:  # Triton's own answer to the request is the same for an identical one
            await asyncio.sleep(0.01)
            raise UpstreamRejected("bad input")

        results = await asyncio.gather(c.run("r", rejected), c.run("r", second), return_exceptions=True)
        assert all(isinstance(r, UpstreamRejected) for r in results)
        assert len(c) == 0

    asyncio.run(run())


def test_coalescing_table_is_bounded_in_entries() -> None:
    async def run() -> None:
        c = Coalescer(max_entries=2)
        gate = asyncio.Event()

        async def work() -> int:
            await gate.wait()
            return 1

        tasks = [asyncio.ensure_future(c.run(f"k{i}", work)) for i in range(5)]
        await asyncio.sleep(0)
        assert len(c) == 2 and c.overflow == 3
        gate.set()
        assert [await t for t in tasks] == [(1, False)] * 5
        assert len(c) == 0

    asyncio.run(run())


def test_client_buckets_are_bounded_and_the_limit_names_the_client() -> None:
    clock = FakeClock()
    cfg = _cfg(limits={"per_client_rate_per_s": 1, "per_client_burst": 2, "max_tracked_clients": 3})
    limiter = RateLimiter(cfg, None, GatewayMetrics(), clock)

    async def run() -> None:
        await limiter.check(None, "10.0.0.1")
        await limiter.check(None, "10.0.0.1")
        from gateway.errors import RateLimited

        with pytest.raises(RateLimited, match=r"client address '10.0.0.1' exceeded \(1/s\)") as info:
            await limiter.check(None, "10.0.0.1")
        assert info.value.headers == {"retry-after": "1"}
        for i in range(100):
            await limiter.check(None, f"10.1.0.{i}")
        assert limiter.tracked_clients() == 3

    asyncio.run(run())


def test_per_client_limit_is_off_when_auth_is_on_and_by_default() -> None:
    from gateway.state.auth import hash_key

    keys = {"keys": [{"name": "k", "sha256": hash_key("x")}]}
    on = _cfg(limits={"per_client_rate_per_s": 5}, auth=keys)
    assert RateLimiter(on, None, GatewayMetrics()).client_rate == 0
    assert RateLimiter(_cfg(), None, GatewayMetrics()).client_rate == 0


@pytest.mark.parametrize(
    ("peer", "host"),
    [("ipv4:127.0.0.1:5123", "127.0.0.1"), ("ipv6:[::1]:5123", "::1"), ("127.0.0.1", "127.0.0.1"), ("", "")],
)
def test_client_address_of_grpc_peers_and_http_hosts(peer: str, host: str) -> None:
    assert client_address(peer) == host


@pytest.mark.parametrize(
    ("secret", "why"),
    [
        ("short", "must be set"),
        ("change-me-to-a-long-random-secret", "placeholder"),
        ("set-by-env-SKEWSERVE_GATEWAY_CACHE__HMAC_SECRET", "placeholder"),
        ("x" * 64, "too little entropy"),
        ("abcabcabcabcabcabcab", "too little entropy"),
        pytest.param(secrets.token_hex(32), None, id="token_hex"),
        pytest.param(secrets.token_urlsafe(24), None, id="token_urlsafe"),
    ],
)
def test_secret_weakness(secret: str, why: str | None) -> None:
    found = secret_weakness(secret)
    assert (found is None) if why is None else (found is not None and why in found)


def test_new_config_fields_reach_the_code_using_them() -> None:
    from gateway.core import Gateway
    from gateway.state.redis_link import RedisLink

    cfg = _cfg(
        cache={
            "backend": "redis",
            "redis_url": "redis://127.0.0.1:1/0",
            "hmac_secret": secrets.token_hex(32),
            "redis_timeout_s": 0.07,
            "breaker_failures": 9,
            "breaker_cooldown_s": 3.5,
            "write_queue": 17,
            "max_coalescing": 33,
            "namespace": "ns1",
        },
        limits={
            "shared": "auto",
            "max_tracked_clients": 5,
            "per_client_rate_per_s": 2,
            "per_client_burst": 4,
        },
    )

    async def build() -> None:
        gw = Gateway(cfg)
        link = gw.redis
        assert isinstance(link, RedisLink)
        assert link.timeout_s == 0.07 and link.breaker.threshold == 9 and link.breaker.cooldown_s == 3.5
        assert link.client.connection_pool.connection_kwargs["socket_timeout"] == 0.07
        assert gw.cache._queue.maxsize == 17  # type: ignore[union-attr]
        assert gw.coalescer.max_entries == 33
        assert gw.limiter.link is link and gw.limiter.prefix == "ns1:rl:"
        assert gw.limiter.max_clients == 5 and gw.limiter.client_rate == 2 and gw.limiter.client_burst == 4
        await gw.stop()
        local = Gateway(cfg.model_copy(update={"limits": cfg.limits.model_copy(update={"shared": "local"})}))
        assert local.limiter.link is None
        await local.stop()

    asyncio.run(build())


def test_model_labels_fold_unknown_and_unadmitted_models() -> None:
    from gateway.core import Gateway
    from gateway.pipeline import admission
    from gateway.pipeline.call import Call

    async def run() -> None:
        gw = Gateway(_cfg())
        gw.servers[0].known_models = {"lt"}  # what the repository index reported
        assert gw.model_label("lt") == OTHER_MODEL  # not admitted in this context
        await admission.enter(gw, Call("http", 0.0, "lt", named=True))
        assert gw.model_label("lt") == "lt"
        await admission.enter(gw, Call("http", 0.0, "invented", named=True))
        assert gw.model_label("invented") == OTHER_MODEL and gw.model_label("lt") == OTHER_MODEL
        for i in range(500):
            gw.metrics.request(f"m{i}", "", "", "http", "404", 0.001)
        assert len(gw.metrics._children) <= 4
        await gw.stop()

    asyncio.run(run())


def test_a_leaders_connection_failure_is_not_shared_with_its_followers() -> None:
    """Issue 9 review item 4: a RetryableUpstream of the leader's own (its server, its connection)
    makes followers try again on their own, as a cancelled leader does."""
    from gateway.errors import UpstreamUnavailable

    async def run() -> None:
        c = Coalescer()
        gate = asyncio.Event()

        async def broken() -> int:
            await gate.wait()
            raise UpstreamUnavailable("127.0.0.1:1: connection closed before a response")

        async def fine() -> int:
            return 5

        lead = asyncio.ensure_future(c.run("k", broken))
        await asyncio.sleep(0)
        follow = asyncio.ensure_future(c.run("k", fine))
        await asyncio.sleep(0)
        gate.set()
        with pytest.raises(UpstreamUnavailable):
            await lead
        assert await follow == (5, False)
        assert len(c) == 0

    asyncio.run(run())


def test_requests_pinned_to_other_regions_do_not_coalesce() -> None:
    """Issue 9 review item 4: the pin routes the fetch, so it is part of the coalescing key (not the
    cache key): a request pinned elsewhere runs its own fetch, an identically pinned one follows."""
    from gateway.core import Gateway

    async def run() -> None:
        gw = Gateway(_cfg())
        gate = asyncio.Event()
        calls: list[str] = []

        def fetcher(name: str) -> Any:
            async def fetch() -> tuple[bytes, bytes | None]:
                calls.append(name)
                await gate.wait()
                return name.encode(), None  # nothing stored: each answer stays its own

            return fetch

        lead = asyncio.ensure_future(gw.cached("key", "lt", fetcher("a"), bytes, None, "a"))
        await asyncio.sleep(0)
        same_pin = asyncio.ensure_future(gw.cached("key", "lt", fetcher("a-2"), bytes, None, "a"))
        unpinned = asyncio.ensure_future(gw.cached("key", "lt", fetcher("any"), bytes, None, None))
        await asyncio.sleep(0)
        gate.set()
        assert await lead == (b"a", "miss")
        assert await same_pin == (b"a", "coalesced")
        assert await unpinned == (b"any", "miss")
        assert calls == ["a", "any"]
        await gw.stop()

    asyncio.run(run())


def test_body_budget_bounds_each_caller_and_the_worker_and_forgets_idle_callers() -> None:
    from gateway.errors import BodiesExhausted
    from gateway.state.body_budget import BodyBudget

    budget = BodyBudget(limit=1000, per_caller=600)
    budget.reserve("key:a", 500)
    with pytest.raises(BodiesExhausted, match="max_buffered_body_bytes_per_caller"):
        budget.reserve("key:a", 200)  # a's own bound; nothing counted for the refused bytes
    budget.reserve("key:b", 450)
    with pytest.raises(BodiesExhausted, match=r"more than 1000 bytes .*\(limits.max_buffered_body_bytes\)"):
        budget.reserve("key:c", 100)
    assert (budget.held, budget.callers()) == (950, 2)
    budget.release("key:a", 500)
    budget.release("key:b", 450)
    assert (budget.held, budget.callers()) == (0, 0)
    same = BodyBudget(limit=1000, per_caller=1000)  # equal bounds: the refusal names the worker's
    same.reserve("key:a", 900)
    with pytest.raises(BodiesExhausted, match=r"\(limits.max_buffered_body_bytes\)"):
        same.reserve("key:a", 200)


@pytest.mark.parametrize(
    "name",
    [
        "Expect", "expect", "Connection", "Keep-Alive", "TE", "Trailer", "Transfer-Encoding", "Upgrade",
        "Proxy-Authorization", "Proxy-Connection", "Host", "Content-Length", "Authorization", "X-Api-Key",
        "x-skewserve-peer", "X-Skewserve-Target-Ip", "x-skewserve-target-port", "x-skewserve-client",
        "x-skewserve-region", "x-skewserve-timeout-ms", "x-my-region", "x-my-client",
    ],
)  # fmt: skip
def test_hop_by_hop_keys_and_the_gateways_own_headers_are_never_forwarded(name: str) -> None:
    from gateway.core import Gateway

    async def run() -> bool:
        cfg = _cfg(
            routing={"header_forward_pattern": ".*", "region_header": "x-my-region"},
            traffic={"controller_url": "http://127.0.0.1:1", "sticky_header": "x-my-client"},
        )
        gw = Gateway(cfg)
        assert gw.forwarded("x-tenant-id") and gw.forwarded("X-Tenant-Id")
        return gw.forwarded(name)

    assert asyncio.run(run()) is False


def test_forwarded_metadata_is_checked_as_headers_are() -> None:
    from gateway.errors import BadRequest
    from gateway.forward_headers import forwarded_metadata

    def everything(name: str) -> bool:
        return name != "authorization"

    md = {"x-tenant": "acme", "authorization": "Bearer k", "x-blob-bin": b"\x00\x01", "x-a": "b"}
    assert forwarded_metadata(md, everything) == (("x-tenant", "acme"), ("x-a", "b"))
    with pytest.raises(BadRequest, match=r"^x-tenant metadata must be printable ASCII, got 'café'$"):
        forwarded_metadata({"x-tenant": "café"}, everything)
    with pytest.raises(BadRequest, match=r"^x-tenant header of 300 bytes is longer than 256"):
        forwarded_metadata({"x-tenant": "v" * 300}, everything)
    with pytest.raises(
        BadRequest, match=r"^forwarded headers total 4\d{3} bytes, above the gateway's limit of 4096"
    ):
        forwarded_metadata({f"x-t{i:02d}": "v" * 250 for i in range(17)}, everything)


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ({"Authorization": "x"}, "header 'Authorization' is never passed on to Triton"),
        ({"x-skewserve-region": "x"}, "header 'x-skewserve-region' is never passed on to Triton"),
        ({"bad name": "x"}, "header name 'bad name' is not a valid HTTP header / gRPC metadata name"),
        ({"x-tenant": "caf\u00e9"}, "header 'x-tenant': the value must be printable ASCII of at most 256"),
    ],
)
def test_a_keys_bound_headers_are_checked_at_start(headers: dict[str, str], error: str) -> None:
    from pydantic import ValidationError

    from gateway.config import ApiKeyConfig

    with pytest.raises(ValidationError, match=error):
        ApiKeyConfig(name="k", sha256="0" * 64, headers=headers)
    assert ApiKeyConfig(name="k", sha256="0" * 64, headers={"X-Tenant": "acme"}).headers == {
        "x-tenant": "acme"
    }


def test_the_data_plane_refuses_exactly_the_paths_no_worker_serves() -> None:
    """HAProxy answers UNIMPLEMENTED from the headers for every path but these: the list it gets is
    the one the workers serve (GrpcFront.methods() and the stream)."""
    from gateway.core import Gateway
    from gateway.fronts.grpc_front import UNARY_METHODS, GrpcFront

    # methods() names bound methods; nothing is started. (Real instances: compiled classes have no
    # bare __new__, and a compiled GrpcFront takes only a Gateway.)
    front = GrpcFront(Gateway(_cfg()))
    assert tuple(front.methods()) == UNARY_METHODS


def test_a_stream_message_bound_that_lets_a_caller_hold_more_than_its_share_is_refused_at_start() -> None:
    from pydantic import ValidationError

    from gateway.config import LimitsConfig

    with pytest.raises(
        ValidationError,
        match=r"limits.max_stream_message_bytes \(4194304\) times limits.max_streams_per_caller \(32\)",
    ):
        LimitsConfig(max_stream_message_bytes=4 * 1024 * 1024)
    assert LimitsConfig(max_stream_message_bytes=1 << 20).stream_message_bytes == 1 << 20
    assert LimitsConfig(max_streams_per_caller=4).stream_message_bytes == 16 * 1024 * 1024
