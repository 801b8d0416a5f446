"""Gateway pieces with injected clocks: balancing, routing, ejection, budgets, cache, auth, config."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import ConfigError, GatewayConfig, HealthConfig, ServerConfig, load_gateway_config
from gateway.errors import BadRequest, NoReadyServer, PermissionDenied, RateLimited, Unauthenticated
from gateway.fleet.balancer import P2CEwmaBalancer, RoundRobinBalancer
from gateway.fleet.dispatch import HEDGE_MIN_SAMPLES, RetryBudget, _says_gone, hedge_delay
from gateway.fleet.health import OutlierDetector
from gateway.fleet.router import Region, RegionRouter
from gateway.state.auth import Authenticator, TokenBucket, hash_key
from gateway.state.cache import Coalescer, MemoryCache, cache_key
from gateway.upstream.server import UpstreamServer


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _server(
    name: str, region: str, clock: FakeClock, models: dict[str, set[str]] | None = None
) -> UpstreamServer:
    s = UpstreamServer(
        ServerConfig(name=name, http="127.0.0.1:1", grpc="127.0.0.1:2"), region, 2.0, 1.0, clock
    )
    s.healthy = True
    s.ready_models = models if models is not None else {"m": {"1"}}
    s.known_models = set(s.ready_models)
    return s


def _config(**kw: object) -> GatewayConfig:
    base = {
        "home_region": "a",
        "regions": [
            {"name": "a", "servers": [{"name": "a0", "http": "h:1", "grpc": "h:2"}]},
            {"name": "b", "servers": [{"name": "b0", "http": "h:3", "grpc": "h:4"}]},
        ],
    }
    return GatewayConfig(**(base | kw))


def test_tritons_own_answer_for_a_model_it_no_longer_holds_reads_as_gone() -> None:
    """Unloaded (no available versions) or gone with the server's shutdown (not found): the request
    was not run, so it is retried elsewhere; the same words echoed after Triton's prefix are not."""
    model = "slow"
    for said in ("has no available versions", "is not found"):
        assert _says_gone(f'{{"error":"Request for unknown model: \'{model}\' {said}"}}'.encode(), model)
        echoed = f'{{"error":"[request id: Request for unknown model: \'{model}\' {said}] bad input"}}'
        assert not _says_gone(echoed.encode(), model)
    assert not _says_gone(b'{"error":"Request for unknown model: \'other\' is not found"}', model)
    assert not _says_gone(b'{"error":"Request for unknown model: \'slow\' version 2 is not found"}', model)


def test_p2c_avoids_the_slow_server() -> None:
    clock = FakeClock()
    fast, slow = _server("fast", "a", clock), _server("slow", "a", clock)
    for _ in range(20):
        fast.latency.observe(0.001, clock.now)
        slow.latency.observe(0.005, clock.now)
        clock.now += 0.01
    balancer = P2CEwmaBalancer(random.Random(0))
    picks = [balancer.pick([fast, slow]).name for _ in range(100)]
    assert picks.count("fast") == 100  # two servers: P2C compares both every time
    fast.inflight = 10  # fast but queued: 0.001 * 11 > 0.005 * 1
    assert balancer.pick([fast, slow]).name == "slow"
    rr = RoundRobinBalancer()
    assert {rr.pick([fast, slow]).name for _ in range(2)} == {"fast", "slow"}


def test_hedge_delay_is_the_lowest_p95_of_servers_with_enough_samples_above_the_floor() -> None:
    clock = FakeClock()
    fast, slow, fresh = (_server(n, "a", clock) for n in ("fast", "slow", "fresh"))
    assert hedge_delay([fast, slow, fresh], 0.02) == 0.02  # no samples yet: the floor
    for i in range(HEDGE_MIN_SAMPLES):
        fast.latency.observe(0.2 + 0.01 * (i % 2), clock.now)  # p95 about 0.21 s
        slow.latency.observe(2.0 + 0.1 * (i % 2), clock.now)  # slow as a whole: its p95 does not count
        clock.now += 0.01
    fresh.latency.observe(0.001, clock.now)  # one sample: too few to speak for the request class
    delay = hedge_delay([fast, slow, fresh], 0.02)
    assert delay == fast.latency.p95() and 0.2 < delay < 0.3
    assert hedge_delay([fast, slow, fresh], 0.5) == 0.5  # the floor still bounds it from below
    assert hedge_delay([slow], 0.02) == slow.latency.p95()


def test_router_prefers_home_then_nearest_region_and_counts_saturation() -> None:
    clock = FakeClock()
    cfg = _config(routing={"max_inflight_per_server": 2})
    a0, b0, c0 = _server("a0", "a", clock), _server("b0", "b", clock), _server("c0", "c", clock)
    b0.probe_rtt.observe(0.050, clock.now)
    c0.probe_rtt.observe(0.010, clock.now)
    regions = [Region("a", [a0]), Region("b", [b0]), Region("c", [c0])]
    router = RegionRouter(cfg, regions, {r.name: RoundRobinBalancer() for r in regions}, clock)
    route = router.route("m", "")
    assert (route.server.name, route.spilled) == ("a0", False)
    a0.inflight = 2  # saturated: spill to the nearest other region (c, 10 ms) before b (50 ms)
    route = router.route("m", "")
    assert (route.server.name, route.spilled) == ("c0", True)
    a0.inflight = 0
    b0.ready_models = {"m": {"1", "2"}}
    assert router.route("m", "2").server.name == "b0"  # only b0 has version 2
    a0.ready_models = {}
    assert router.route("m", "").server.name == "c0"
    assert router.route("m", "", pinned="b").server.name == "b0"
    with pytest.raises(NoReadyServer, match="no server in region 'a' has model 'm' ready"):
        router.route("m", "", pinned="a")
    with pytest.raises(BadRequest, match="pinned region 'z' does not exist"):
        router.route("m", "", pinned="z")
    with pytest.raises(NoReadyServer, match="no server in any region has model 'm' version 7 ready"):
        router.route("m", "7")


def test_region_skew_index() -> None:
    clock = FakeClock()
    servers = [_server(f"s{i}", "a", clock) for i in range(3)]
    for s, load in zip(servers, (6, 2, 1), strict=True):
        s.inflight = load
    assert Region("a", servers).skew_index() == pytest.approx(6 / 3)


def test_ejection_backs_off_exponentially_and_readmits() -> None:
    clock = FakeClock()
    s = _server("s", "a", clock)
    detector = OutlierDetector(HealthConfig(eject_after_failures=2, base_ejection_s=1.0, max_ejection_s=3.0))
    detector.failure(s, "boom", clock.now)
    assert s.available(clock.now)
    detector.failure(s, "boom", clock.now)
    assert not s.available(clock.now) and s.ejected_until == clock.now + 1.0
    clock.now += 1.01
    assert s.available(clock.now)  # re-admitted
    detector.failure(s, "again", clock.now)
    detector.failure(s, "again", clock.now)
    assert s.ejected_until == pytest.approx(clock.now + 2.0)
    clock.now += 2.01
    for _ in range(2):
        detector.failure(s, "again", clock.now)
    assert s.ejected_until == pytest.approx(clock.now + 3.0)  # capped
    assert [e.reason for e in s.history] == ["boom", "again", "again"]
    detector.success(s)
    assert s.consecutive_failures == 0


def test_retry_budget_is_a_fraction_of_requests_plus_a_floor() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.25, min_per_s=0.0, clock=clock)
    budget.tokens = 0.0
    for _ in range(4):
        budget.deposit()
    assert budget.try_withdraw() and not budget.try_withdraw()
    floor = RetryBudget(ratio=0.0, min_per_s=2.0, clock=clock)
    floor.tokens = 0.0
    clock.now += 1.0
    assert floor.try_withdraw() and floor.try_withdraw() and not floor.try_withdraw()


@settings(max_examples=80, deadline=None)
@given(
    model=st.text(min_size=1, max_size=5),
    version=st.sampled_from(["", "1", "2"]),
    req=st.binary(max_size=40),
    tensor=st.binary(max_size=40),
    field=st.sampled_from(["protocol", "model", "version", "req", "tensor"]),
)
def test_cache_key_changes_with_every_part(
    model: str, version: str, req: bytes, tensor: bytes, field: str
) -> None:
    args = {"protocol": "grpc", "model": model, "version": version, "req": req, "tensor": tensor}
    key = cache_key(args["protocol"], args["model"], args["version"], args["req"], args["tensor"])
    assert key == cache_key("grpc", model, version, req, tensor)
    changed = dict(args)
    changed[field] = changed[field] + ("x" if isinstance(changed[field], str) else b"x")  # type: ignore[operator]
    assert (
        cache_key(
            changed["protocol"], changed["model"], changed["version"], changed["req"], changed["tensor"]
        )
        != key
    )  # type: ignore[arg-type]


def test_cache_key_parts_cannot_run_into_each_other() -> None:
    assert cache_key("grpc", "ab", "1", b"c") != cache_key("grpc", "a", "b1", b"c")
    # Tenants (cache.tenancy per_key) never share a key with each other or with the shared space.
    shared = cache_key("grpc", "m", "1", b"c")
    assert (
        len(
            {
                shared,
                cache_key("grpc", "m", "1", b"c", tenant="a"),
                cache_key("grpc", "m", "1", b"c", tenant="b"),
            }
        )
        == 3
    )


def test_memory_cache_is_bounded_in_bytes_and_expires() -> None:
    clock = FakeClock()
    evicted: list[int] = []
    cache = MemoryCache(max_bytes=10, ttl_s=5.0, clock=clock, on_evict=lambda: evicted.append(1))

    async def run() -> None:
        await cache.set("a", b"12345")
        await cache.set("b", b"12345")
        assert await cache.get("a") == b"12345"  # a is now most recent
        await cache.set("c", b"123")
        assert await cache.get("b") is None and await cache.get("a") == b"12345" and cache.size_bytes() == 8
        clock.now += 5.0
        assert await cache.get("a") is None and cache.size_bytes() == 3

    asyncio.run(run())
    assert len(evicted) == 1 and cache.stats.evictions == 1


def test_coalescer_shares_one_call_and_never_keeps_errors() -> None:
    calls = 0

    async def run() -> None:
        nonlocal calls
        c = Coalescer()

        async def work() -> int:
            nonlocal calls
            calls += 1
            await asyncio.sleep(0.01)
            return 42

        results = await asyncio.gather(*(c.run("k", work) for _ in range(5)))
        assert [r for r, _ in results] == [42] * 5 and sum(shared for _, shared in results) == 4

        async def fail() -> int:
            raise ValueError("upstream said no")

        with pytest.raises(ValueError):
            await c.run("k", fail)
        assert await c.run("k", work) == (42, False)

    asyncio.run(run())
    assert calls == 2


def test_auth_keys_models_and_buckets() -> None:
    clock = FakeClock()
    from gateway.config import AuthConfig

    auth = Authenticator(
        AuthConfig(
            keys=[{"name": "k", "sha256": hash_key("secret"), "models": ["m"], "rate_per_s": 1, "burst": 2}]
        ),
        clock,
    )
    with pytest.raises(Unauthenticated, match="missing API key"):
        auth.authenticate(None, None)
    with pytest.raises(Unauthenticated, match="invalid API key"):
        auth.authenticate("Bearer nope", None)
    principal = auth.authenticate("Bearer secret", None)
    with pytest.raises(PermissionDenied, match="API key 'k' may not use model 'x'"):
        auth.admit(principal, "x")
    auth.admit(principal, "m")
    auth.admit(principal, "m")
    with pytest.raises(RateLimited) as info:
        auth.admit(principal, "m")
    assert info.value.headers == {"retry-after": "1"}
    clock.now += 1.0
    auth.admit(principal, "m")
    assert Authenticator(AuthConfig()).authenticate(None, None) is None
    bucket = TokenBucket(2.0, 1.0, clock)
    assert bucket.take() == 0.0 and bucket.take() == pytest.approx(0.5)


def test_bad_config_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(
        "home_region: mars\nregions:\n  - name: earth\n    servers: [{name: s, http: '127.0.0.1:8000', grpc: 'localhost'}]\n"
    )
    with pytest.raises(ConfigError, match=r"regions\.0\.servers\.0\.grpc: 'localhost' is not host:port"):
        load_gateway_config(path)
    path.write_text(
        "home_region: mars\nregions:\n  - name: earth\n    servers: [{name: s, http: '127.0.0.1:8000', grpc: '127.0.0.1:8001'}]\n"
    )
    with pytest.raises(ConfigError, match=r"home_region 'mars' is not one of the regions \['earth'\]"):
        load_gateway_config(path)
    path.write_text(
        "home_region: earth\nretries: {max_attempts: 0}\nregions:\n  - name: earth\n    servers: [{name: s, http: '127.0.0.1:8000', grpc: '127.0.0.1:8001'}]\n"
    )
    with pytest.raises(
        ConfigError, match=r"retries\.max_attempts: Input should be greater than or equal to 1 \(got 0\)"
    ):
        load_gateway_config(path)
    path.write_text(
        "home_region: earth\ncache: {backend: redis}\nregions:\n  - name: earth\n    servers: [{name: s, http: '127.0.0.1:8000', grpc: '127.0.0.1:8001'}]\n"
    )
    with pytest.raises(ConfigError, match="cache.hmac_secret must be set"):
        load_gateway_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_gateway_config(tmp_path / "missing.yaml")


def test_environment_overrides_the_file_and_reaches_the_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gw.toml"
    path.write_text(
        'home_region = "a"\n[[regions]]\nname = "a"\n[[regions.servers]]\nname = "a0"\nhttp = "127.0.0.1:1"\ngrpc = "127.0.0.1:2"\n'
        '[[regions]]\nname = "b"\n[[regions.servers]]\nname = "b0"\nhttp = "127.0.0.1:3"\ngrpc = "127.0.0.1:4"\n'
    )
    monkeypatch.setenv("SKEWSERVE_GATEWAY_HOME_REGION", "b")
    monkeypatch.setenv("SKEWSERVE_GATEWAY_CACHE__TTL_S", "7.5")
    monkeypatch.setenv("SKEWSERVE_GATEWAY_ROUTING__MAX_INFLIGHT_PER_SERVER", "3")
    monkeypatch.setenv("SKEWSERVE_GATEWAY_BALANCING__POLICY", "round_robin")
    cfg = load_gateway_config(path)
    assert cfg.home_region == "b" and cfg.cache.ttl_s == 7.5
    from gateway.core import Gateway

    async def build() -> None:  # the gRPC channels belong to an event loop
        gw = Gateway(cfg)
        assert gw.router.home == "b" and gw.router.max_inflight == 3
        assert isinstance(gw.router.balancers["a"], RoundRobinBalancer)
        assert gw.cache.ttl_s == 7.5  # type: ignore[union-attr]
        await gw.stop()

    asyncio.run(build())
    monkeypatch.setenv("SKEWSERVE_GATEWAY_LIMITS__MAX_INFLIGHT", "-1")
    with pytest.raises(
        ConfigError, match=r"limits\.max_inflight: Input should be greater than or equal to 1"
    ):
        load_gateway_config(path)


def test_cli_gateway_refuses_bad_config_with_the_field(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("home_region: a\nregions: []\n")
    res = subprocess.run(
        [sys.executable, "-m", "skewserve", "gateway", "--config", str(path)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert "regions: List should have at least 1 item" in res.stdout + res.stderr


def test_large_keys_are_hashed_off_the_loop_with_the_same_result() -> None:
    from gateway.state.cache import OFF_LOOP_BYTES, cache_key_async

    big = b"x" * (OFF_LOOP_BYTES + 1)
    assert asyncio.run(cache_key_async("grpc", "m", "1", big)) == cache_key("grpc", "m", "1", big)
    assert asyncio.run(cache_key_async("grpc", "m", "1", b"small")) == cache_key("grpc", "m", "1", b"small")


def test_reloaded_keys_keep_their_buckets_and_removed_keys_are_refused() -> None:
    from gateway.config import AuthConfig

    clock = FakeClock()
    a = {"name": "a", "sha256": hash_key("key-a"), "rate_per_s": 0.001, "burst": 1}
    b = {"name": "b", "sha256": hash_key("key-b")}
    auth = Authenticator(AuthConfig(keys=[a, b]), clock)
    principal = auth.authenticate(None, "key-a")
    Authenticator.admit(principal, "m")  # a's only token
    reloaded = auth.with_keys(AuthConfig(keys=[a]))
    with pytest.raises(RateLimited):  # a reload does not refill a's bucket
        Authenticator.admit(reloaded.authenticate(None, "key-a"), "m")
    with pytest.raises(Unauthenticated, match="invalid API key"):
        reloaded.authenticate(None, "key-b")
    changed = reloaded.with_keys(AuthConfig(keys=[{**a, "burst": 2}]))  # a changed entry: a new bucket
    Authenticator.admit(changed.authenticate(None, "key-a"), "m")


def test_tritons_version_not_ready_answer_is_read_from_its_first_byte() -> None:
    from gateway.fleet.dispatch import not_ready_version

    said = b'{"error":"Request for unknown model: \'lt\' version 2 is not at ready state"}'
    assert not_ready_version(said, "lt") == "2"
    assert not_ready_version(said, "other") is None
    # a client's words echoed later in an error never pass for Triton's own
    echoed = b'{"error":"[request id: Request for unknown model: \'lt\' version 2 is not at ready state]"}'
    assert not_ready_version(echoed, "lt") is None
    assert (
        not_ready_version(
            b'{"error":"Request for unknown model: \'lt\' version x is not at ready state"}', "lt"
        )
        is None
    )


def test_an_infer_urls_target_is_read_with_or_without_a_query() -> None:
    """The protocol's reading of an infer URL (compiled: httptools reports a missing query or path as
    None, which its stubs call bytes; compiled code took every query-less request for a parser error)."""
    from gateway.fronts.infer_exchange import infer_target

    assert infer_target(b"/v2/models/m/infer") == ("m", "", b"/v2/models/m/infer", b"")
    assert infer_target(b"/v2/models/m/versions/2/infer?a=1") == (
        "m",
        "2",
        b"/v2/models/m/versions/2/infer",
        b"a=1",
    )
    assert infer_target(b"/v2/models/m%20x/infer") == ("m x", "", b"/v2/models/m%20x/infer", b"")
    for other in (b"/v2/models/m", b"/v2/models/m/ready", b"http://h", b"*", b"/v2/models/\xc3\xa9/infer"):
        assert infer_target(other) is None, other


def test_the_targets_of_urls_seen_are_remembered_within_bounds() -> None:
    """Each URL's target is remembered (a repeat is one lookup), in at most TARGETS_MAX entries of
    URLs up to TARGET_URL_MAX bytes: a client sending new URLs cannot grow it, nor change what
    another URL reads as."""
    from gateway.fronts import infer_exchange
    from gateway.fronts.infer_exchange import TARGET_URL_MAX, TARGETS_MAX, infer_target

    mine = infer_target(b"/v2/models/mine/infer")
    assert mine == ("mine", "", b"/v2/models/mine/infer", b"")
    assert infer_target(b"/v2/models/mine/infer") is mine  # remembered, not parsed again
    for n in range(3 * TARGETS_MAX):
        assert infer_target(b"/v2/models/m%d/infer?n=%d" % (n, n)) == (
            f"m{n}",
            "",
            b"/v2/models/m%d/infer" % n,
            b"n=%d" % n,
        )
        assert infer_target(b"/x%d" % n) is None
        assert len(infer_exchange._TARGETS) <= TARGETS_MAX
    long = b"/v2/models/" + b"m" * TARGET_URL_MAX + b"/infer"
    assert infer_target(long) == ("m" * TARGET_URL_MAX, "", long, b"")
    assert long not in infer_exchange._TARGETS
    assert infer_target(b"/v2/models/mine/infer") == mine


def test_the_head_refuses_exactly_the_bytes_uvicorns_regex_refuses() -> None:
    """The response head checks header values by deleting a table of bytes (`_CONTROL`, cheaper than
    a regex search); the table must be the regex's own set, whatever uvicorn's version."""
    from gateway.fronts.infer_exchange import _CONTROL, HEADER_VALUE_RE

    assert _CONTROL == bytes(b for b in range(256) if HEADER_VALUE_RE.search(bytes([b])))


def test_the_response_head_refuses_a_split_value_and_follows_uvicorns_renewed_defaults() -> None:
    from gateway.fronts.infer_exchange import InferExchange

    async def main() -> list[bytes | str]:
        def exchange(defaults: list[tuple[bytes, bytes]]) -> InferExchange:
            target = ("m", "", b"/v2/models/m/infer", b"")
            return InferExchange(None, None, None, defaults, lambda: None, False, True, target, [], "c")

        first = [(b"date", b"Mon, 07 Dec 2026 22:00:00 GMT"), (b"server", b"skewserve")]
        second = [(b"date", b"Mon, 07 Dec 2026 22:00:01 GMT"), (b"server", b"skewserve")]
        heads: list[bytes | str] = [
            exchange(first)._head(200, [(b"x-tabbed", b"a\tb")], 2),
            exchange(second)._head(200, [], 0),  # uvicorn put a new list in place: its date shows
        ]
        try:
            exchange(first)._head(200, [(b"content-type", b"a"), (b"x-split", b"a\r\ninjected: 1")], 0)
        except ValueError as exc:
            heads.append(str(exc))
        return heads

    tabbed, renewed, refused = asyncio.run(main())
    assert tabbed == (
        b"HTTP/1.1 200 OK\r\ndate: Mon, 07 Dec 2026 22:00:00 GMT\r\nserver: skewserve\r\n"
        b"x-tabbed: a\tb\r\ncontent-length: 2\r\n\r\n"
    )
    assert b"22:00:01" in renewed and b"22:00:00" not in renewed
    assert refused == "invalid value of response header b'x-split'"
