"""Routing's model index (gateway/fleet/model_index.py) and its kept region order answer as a walk
of the fleet would, after every kind of change to what servers hold, to which servers and regions
there are, to probes' round-trip times and to the home region; and a health probe that finds what it
found before rebuilds nothing."""

from __future__ import annotations

import asyncio
import random

from gateway.config import GatewayConfig, ServerConfig
from gateway.core import Gateway
from gateway.upstream.server import FLEET_CHANGES, UpstreamServer

MODELS = ("m0", "m1", "m2", "m3")
VERSIONS = ("", "1", "2", "10")


def _config() -> GatewayConfig:
    return GatewayConfig(
        home_region="a",
        regions=[
            {
                "name": "a",
                "servers": [
                    {"name": f"a{i}", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"} for i in range(3)
                ],
            },
            {"name": "b", "servers": [{"name": "b0", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]},
            {"name": "c", "servers": [{"name": "c0", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]},
        ],
    )


def _walk_latest(gw: Gateway, model: str) -> str:
    numbered = [int(v) for s in gw.router.servers() for v in s.ready_models.get(model, ()) if v.isdigit()]
    return str(max(numbered)) if numbered else ""


def _assert_index_equals_the_walk(gw: Gateway, step: str) -> None:
    router = gw.router
    index = router.index()
    servers = router.servers()
    others = sorted((r for r in router.regions.values() if r.name != router.home), key=lambda r: r.rtt_s())
    nearest = [router.home, *(r.name for r in others)]
    assert [r.name for r in router.region_order()] == nearest, step
    for model in MODELS:
        assert router.latest_version(model) == _walk_latest(gw, model), step
        assert router.knows_model(model) == any(model in s.known_models for s in servers), step
        for version in VERSIONS[1:]:
            listed = any(version in s.ready_models.get(model, ()) for s in servers)
            assert router.listed(model, version) == listed, step
        for region in router.regions.values():
            for version in VERSIONS:
                holding = [s for s in region.servers if s.has_model(model, version)]
                indexed = [s for s in index.holders(region.name, model) if s.has_model(model, version)]
                assert indexed == holding, f"{step}: region {region.name} {model} v{version!r}"
            assert router.has_alternative(model, "", region.name, ()) == any(
                s.available(0.0) and s.has_model(model, "") for s in region.servers
            ), step


def _random_models(rng: random.Random) -> dict[str, set[str]]:
    return {m: {v for v in VERSIONS[1:] if rng.random() < 0.5} for m in MODELS if rng.random() < 0.5}


def test_the_index_answers_as_the_walk_after_every_kind_of_change() -> None:
    """400 random changes of every kind the gateway makes (a probe's models and round-trip time, a
    version or model Triton said is gone, servers joining and leaving, regions added and removed, the
    home region moved): after each, every routing answer read from the index, and the region order,
    equal the same answers walking the fleet."""
    rng = random.Random(39)

    async def run() -> None:
        gw = Gateway(_config(), clock=lambda: 0.0)
        joined = 0
        for server in gw.router.servers():
            server.healthy = True
        _assert_index_equals_the_walk(gw, "start")
        for step in range(400):
            servers = gw.router.servers()
            server = rng.choice(servers) if servers else None
            kind = rng.choice(
                ("probe", "known", "forget_model", "forget_version", "join", "leave", "region", "rtt", "home")
            )
            if kind == "probe" and server is not None:
                server.ready_models = _random_models(rng)
                server.known_models = server.known_models | set(server.ready_models)
            elif kind == "known" and server is not None:
                server.known_models = {m for m in MODELS if rng.random() < 0.5}
            elif kind == "forget_model" and server is not None:
                server.forget_model(rng.choice(MODELS))
            elif kind == "forget_version" and server is not None:
                server.forget_version(rng.choice(MODELS), rng.choice(VERSIONS[1:]))
            elif kind == "join":
                region = rng.choice(sorted(gw.router.regions))
                joined += 1
                new = UpstreamServer(
                    ServerConfig(name=f"j{joined}", http="127.0.0.1:1", grpc="127.0.0.1:2"), region, 1.0, 1.0
                )
                new.healthy, new.ready_models = True, _random_models(rng)
                gw.router.index()  # built with the probed server outside: joining must count
                assert gw.attach_server(new)
            elif kind == "leave" and server is not None and len(servers) > 1:
                gw.remove_server(server)
            elif kind == "rtt" and server is not None:
                server.probe_rtt.observe(rng.uniform(0.001, 0.1), rng.uniform(0.0, 5.0))
            elif kind == "home":
                gw.router.set_home(rng.choice(("a", "b")))
            elif kind == "region":
                if "d" in gw.router.regions:
                    gw.remove_region("d")
                else:
                    gw.add_region("d", 5.0)
            _assert_index_equals_the_walk(gw, f"step {step} ({kind})")
        await gw.stop()  # removed servers' drain tasks end and close them

    asyncio.run(run())


def test_probes_of_a_real_triton_that_find_nothing_new_rebuild_nothing(one_triton) -> None:
    """A gateway probing a real Triton builds its index once from the first probe; later rounds
    that find the same models change nothing, so a request never pays for a rebuild in a steady
    fleet. Routing reads the index: the server's model routes, at the version Triton reports."""
    triton = one_triton["us-east"][0]
    cfg = GatewayConfig(
        home_region="us-east",
        regions=[
            {
                "name": "us-east",
                "servers": [{"name": "t0", "http": triton.http_address, "grpc": triton.grpc_address}],
            }
        ],
    )

    async def run() -> None:
        gw = Gateway(cfg)
        try:
            await gw.health.probe_all()
            assert gw.router.route("lt", "").server.name == "t0"
            assert gw.router.latest_version("lt") == "1" and gw.router.knows_model("lt_nocache")
            index = gw.router.index()
            builds, changes = index.builds, FLEET_CHANGES.count
            for _ in range(3):
                await gw.health.probe_all()
                gw.router.route("lt", "")
            assert (FLEET_CHANGES.count, index.builds) == (changes, builds)
        finally:
            await gw.stop()

    asyncio.run(run())


def test_an_odd_version_from_one_server_leaves_routing_of_every_model_working() -> None:
    """Triton's statistics are read as sent: a version string that looks like digits to `isdigit`
    but is no number ("²", or more digits than int() reads) is not a number for the highest
    version, and routing of the other models and of that one goes on."""
    gw = Gateway(_config(), clock=lambda: 0.0)
    a0, a1 = gw.router.regions["a"].servers[:2]
    for server in (a0, a1):
        server.healthy = True
    a0.ready_models = {"m0": {"1"}}
    a1.ready_models = {"m1": {"²", "9" * 5000, "3"}}
    assert gw.router.route("m0", "").server is a0
    assert gw.router.route("m1", "").server is a1
    assert gw.router.latest_version("m1") == "3" and gw.router.listed("m1", "²")


def test_a_server_keeps_a_copy_of_the_models_it_is_given() -> None:
    """Whoever assigned a server's models and changes its own mapping afterwards changes nothing
    routing would not see: the server holds a copy."""
    gw = Gateway(_config(), clock=lambda: 0.0)
    server = gw.router.regions["a"].servers[0]
    server.healthy = True
    mine = {"m0": {"1"}}
    server.ready_models = mine
    mine["m0"].add("2")
    mine["m1"] = {"1"}
    assert not server.has_model("m0", "2") and not server.has_model("m1", "")
    assert not gw.router.listed("m0", "2") and gw.router.latest_version("m0") == "1"


def test_a_reloaded_fixed_rtt_reorders_the_regions_at_once() -> None:
    """A reload that changes a region's `rtt_ms` moves it in the nearest-region order for the very
    next request, not after the next probe."""
    from gateway.reload import apply_fleet

    def config(b_rtt_ms: float) -> GatewayConfig:
        server = {"http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}
        return GatewayConfig(
            home_region="a",
            regions=[
                {"name": "a", "servers": [{"name": "a0", **server}]},
                {"name": "b", "rtt_ms": b_rtt_ms, "servers": [{"name": "b0", **server}]},
                {"name": "c", "rtt_ms": 10.0, "servers": [{"name": "c0", **server}]},
            ],
        )

    async def run() -> None:
        gw = Gateway(config(50.0), clock=lambda: 0.0)
        try:
            assert [r.name for r in gw.router.region_order()] == ["a", "c", "b"]
            await apply_fleet(gw, config(5.0))
            assert [r.name for r in gw.router.region_order()] == ["a", "b", "c"]
        finally:
            await gw.stop()

    asyncio.run(run())
