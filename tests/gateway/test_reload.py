"""Config reload on a running gateway process: SIGHUP and file polling, under load, real Tritons."""

from __future__ import annotations

import copy
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from skewserve.ports import free_port
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, launch_gateway, start_fleet, stop_fleet, wait_until
from tests.gateway.kube_api import KubeApi, endpoint
from tests.gateway.steady_load import SteadyLoad

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(
    gateway_repo: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[list[TritonServer]]:
    fleet = start_fleet(gateway_repo, {"r": 2}, tmp_path_factory.mktemp("reload_logs"), prepared_triton)
    yield fleet["r"]
    stop_fleet(fleet)


def _config(servers: dict[str, TritonServer], **extra: Any) -> dict[str, Any]:
    return {
        "home_region": "local",
        "listen": {"host": "127.0.0.1", "http_port": free_port(), "grpc_port": free_port(), "ops_port": 0},
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "cache": {"backend": "none"},
        "drain": {"grace_s": 0.2, "timeout_s": 5},
        "regions": [
            {
                "name": "local",
                "servers": [
                    {"name": name, "http": s.http_address, "grpc": s.grpc_address}
                    for name, s in servers.items()
                ],
            }
        ],
        **extra,
    }


def _rewrite(gw: GatewayUnderTest, cfg: dict[str, Any]) -> None:
    """Replace the file the gateway was started from (launch_gateway names it by the HTTP port)."""
    path = gw.log_path.with_suffix(".yaml")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg))
    tmp.replace(path)  # whole or not at all, as a ConfigMap update is


def _reloads(gw: GatewayUnderTest) -> dict[str, Any]:
    return gw.admin()["config_reloads"]


def test_sighup_adds_and_removes_servers_under_load_and_refuses_bad_files(
    pair: list[TritonServer], tmp_path: Path
) -> None:
    a, b = pair
    cfg = _config({"a": a})
    gw = launch_gateway(cfg, tmp_path)
    load = SteadyLoad(gw.http)

    def listed() -> set[str]:
        return {s["name"] for s in gw.admin()["servers"]}

    def hup() -> None:
        gw.proc.send_signal(signal.SIGHUP)

    try:
        wait_until(lambda: gw.server("a")["available"], 30, "server a")
        load.start()
        wait_until(lambda: load.served("a") > 20, 30, "traffic on a")

        # Add b.
        grown = _config({"a": a, "b": b})
        grown["listen"] = cfg["listen"]
        _rewrite(gw, grown)
        hup()
        wait_until(lambda: load.served("b") > 20, 30, "traffic on the added server")
        assert _reloads(gw)["applied"] == 1

        # Remove a: it drains (no new requests), then is closed.
        shrunk = copy.deepcopy(grown)
        shrunk["regions"][0]["servers"] = [grown["regions"][0]["servers"][1]]
        _rewrite(gw, shrunk)
        hup()
        wait_until(lambda: listed() == {"b"} and gw.admin()["servers_draining"] == 0, 30, "a leaving")
        removed_at, served_b = time.monotonic(), load.served("b")
        wait_until(lambda: load.served("b") > served_b + 50, 30, "traffic after removal")
        assert load.served_since("a", removed_at) == 0  # the removed server got nothing more
        assert 'server="a"' not in gw.metrics()  # and its metric labels are gone

        # An invalid file: refused in one line naming the field; the running config stays.
        bad = copy.deepcopy(shrunk)
        bad["regions"][0]["servers"][0]["http"] = "nowhere"
        _rewrite(gw, bad)
        hup()
        wait_until(lambda: _reloads(gw)["refused"] == 1, 30, "the invalid file refused")
        refusals = [
            line
            for line in gw.log_path.read_text().splitlines()
            if "config reload refused" in line and "regions.0.servers.0.http" in line
        ]
        assert len(refusals) == 1 and "'nowhere' is not host:port" in refusals[0]

        # Fields that cannot change live: refused, naming them; nothing of the file applied.
        fixed = copy.deepcopy(grown)  # would also add a back ...
        fixed["cache"] = {"backend": "memory"}  # ... but with a new cache backend
        fixed["listen"] = {**cfg["listen"], "http_port": free_port()}
        _rewrite(gw, fixed)
        hup()
        wait_until(lambda: _reloads(gw)["refused"] == 2, 30, "the fixed-field change refused")
        why = _reloads(gw)["last_refusal"]
        assert re.match(r"cache\.backend, listen\.http_port cannot change while the gateway runs", why), why
        served_b = load.served("b")
        wait_until(lambda: load.served("b") > served_b + 50, 30, "traffic after the refusals")
        assert listed() == {"b"} and load.served_since("a", removed_at) == 0
    finally:
        load.stop()
        gw.stop()
    assert load.failed == [] and load.ok > 200


def test_file_change_reloads_and_server_metric_labels_stay_bounded_as_servers_churn(
    pair: list[TritonServer], tmp_path: Path
) -> None:
    """Every round replaces the server by one of a new name (as pods with new addresses replace
    each other): /metrics keeps only the current servers' labels, however many have come and gone."""
    a, b = pair
    cfg = _config({"pod-0": a, "stable": b}, reload={"watch_interval_s": 0.2})
    gw = launch_gateway(cfg, tmp_path)
    load = SteadyLoad(gw.http)

    def server_labels() -> set[str]:
        return set(re.findall(r'server="([^"]*)"', gw.metrics()))

    try:
        wait_until(lambda: gw.server("pod-0")["available"], 30, "pod-0")
        load.start()
        rounds = 6
        for i in range(1, rounds + 1):
            wait_until(lambda i=i: load.served(f"pod-{i - 1}") > 10, 30, f"traffic on pod-{i - 1}")
            churned = copy.deepcopy(cfg)
            churned["regions"][0]["servers"][0]["name"] = f"pod-{i}"
            _rewrite(gw, churned)  # no signal: the gateway polls the file
            wait_until(
                lambda i=i: (
                    {s["name"] for s in gw.admin()["servers"]} == {f"pod-{i}", "stable"}
                    and gw.admin()["servers_draining"] == 0
                ),
                30,
                f"round {i}",
            )
            assert server_labels() <= {f"pod-{i}", "stable", "__departed__"}, server_labels()
        wait_until(lambda: load.served(f"pod-{rounds}") > 10, 30, "traffic on the last pod")
        assert server_labels() <= {f"pod-{rounds}", "stable", "__departed__"}
        assert _reloads(gw)["applied"] == rounds
    finally:
        load.stop()
        gw.stop()
    assert load.failed == []


def test_sighup_adds_a_discovered_region_moves_home_and_removes_the_old_region_under_load(
    pair: list[TritonServer], tmp_path: Path
) -> None:
    """Regions change live too, discovered ones included: a new region found through EndpointSlices
    becomes home, the old region leaves, then the new one's discovery is replaced by a static list."""
    a, b = pair
    token = tmp_path / "token"
    token.write_text("reload-token")
    api = KubeApi("reload-token")
    host, http_port = b.http_address.rsplit(":", 1)
    api.put(
        "triton-far",
        [endpoint(host)],
        {"http": int(http_port), "grpc": int(b.grpc_address.rsplit(":", 1)[1])},
    )
    cfg = _config({"a": a})
    gw = launch_gateway(cfg, tmp_path)
    load = SteadyLoad(gw.http)
    discovered = f"far/{host}"
    far: dict[str, Any] = {
        "name": "far",
        "discover": {
            "interval_s": 0.2,
            "endpointslices": {
                "service": "triton",
                "namespace": "skewserve",
                "api_url": api.url,
                "token_file": str(token),
                "ca_file": None,
            },
        },
    }

    def reload_to(new: dict[str, Any], applied: int) -> None:
        _rewrite(gw, new)
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: _reloads(gw)["applied"] == applied, 30, f"reload {applied}")

    def regions() -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for s in gw.admin()["servers"]:
            out.setdefault(s["region"], set()).add(s["name"])
        return out

    try:
        wait_until(lambda: gw.server("a")["available"], 30, "server a")
        load.start()
        wait_until(lambda: load.served("a") > 20, 30, "traffic on a")

        two = copy.deepcopy(cfg)
        two["regions"].append(far)
        two["home_region"] = "far"
        reload_to(two, 1)
        wait_until(lambda: load.served(discovered) > 20, 30, "traffic in the new home region")
        assert gw.admin()["home_region"] == "far" and regions() == {"local": {"a"}, "far": {discovered}}

        one = copy.deepcopy(two)
        one["regions"] = [far]
        reload_to(one, 2)
        wait_until(
            lambda: regions() == {"far": {discovered}} and gw.admin()["servers_draining"] == 0, 30, "local"
        )
        removed_at, served = time.monotonic(), load.served(discovered)
        wait_until(lambda: load.served(discovered) > served + 50, 30, "traffic after the region left")
        assert load.served_since("a", removed_at) == 0

        # New discovery settings: a new watch whose first report keeps the same server (no drain).
        retuned = copy.deepcopy(one)
        retuned["regions"][0]["discover"]["interval_s"] = 0.3
        before = gw.server(discovered)["requests"]
        reload_to(retuned, 3)
        wait_until(lambda: api.lists == 2, 30, "the new watch's list")
        assert gw.admin()["servers_draining"] == 0 and gw.server(discovered)["requests"] >= before

        static = copy.deepcopy(retuned)  # discovery off: the discovered server drains, a static one joins
        static["regions"] = [
            {"name": "far", "servers": [{"name": "b", "http": b.http_address, "grpc": b.grpc_address}]}
        ]
        reload_to(static, 4)
        wait_until(
            lambda: regions() == {"far": {"b"}} and gw.admin()["servers_draining"] == 0, 30, "static b"
        )
        wait_until(lambda: load.served("b") > 50, 30, "traffic on the static server")
    finally:
        load.stop()
        gw.stop()
        api.close()
    assert load.failed == [] and api.lists == 2 and api.unauthorized == 0


def test_a_reload_whose_discovery_fails_changes_nothing(pair: list[TritonServer], tmp_path: Path) -> None:
    """Issue 22: a reload that adds a server and a discovered region whose source cannot be built
    (a nameserver that is not an IP address) is refused whole: the server never joined, the
    config the gateway reports is the old one, and the refusal names the cause."""
    a, b = pair
    cfg = _config({"a": a})
    gw = launch_gateway(cfg, tmp_path)
    try:
        new = copy.deepcopy(cfg)
        new["regions"][0]["servers"].append({"name": "b", "http": b.http_address, "grpc": b.grpc_address})
        new["regions"].append(
            {"name": "dns", "discover": {"dns_name": "triton.example", "nameserver": "localhost:53"}}
        )
        _rewrite(gw, new)
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: _reloads(gw)["refused"] == 1, timeout=30)
        reloads = _reloads(gw)
        assert reloads["applied"] == 0
        assert "region dns" in reloads["last_refusal"] and "nameserver localhost" in reloads["last_refusal"]
        admin = gw.admin()
        assert {s["name"] for s in admin["servers"]} == {"a"}
        assert list(admin["skew_index"]) == ["local"] and admin["region_order"] == ["local"]
        # A later valid reload still applies: the gateway was left in its old state, not a broken one.
        new["regions"].pop()
        _rewrite(gw, new)
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: _reloads(gw)["applied"] == 1, timeout=30)
        wait_until(lambda: {s["name"] for s in gw.admin()["servers"]} == {"a", "b"}, timeout=30)
    finally:
        gw.stop()


def _worker_views(gw: GatewayUnderTest) -> list[dict[str, Any]]:
    return [w for w in gw.admin()["workers"] if w is not None]


def _two_workers(cfg: dict[str, Any], tmp_path: Path) -> GatewayUnderTest:
    """`cfg` with listen.workers 2, started, both workers answering on the ops listener."""
    cfg["listen"]["workers"] = 2
    gw = launch_gateway(cfg, tmp_path)
    try:
        wait_until(lambda: len(_worker_views(gw)) == 2, timeout=30)
    except BaseException:
        gw.stop()
        raise
    return gw


def test_every_worker_ends_on_the_same_config_or_none_does(pair: list[TritonServer], tmp_path: Path) -> None:
    """Issue 22: with listen.workers > 1 each worker reloads on its own (SIGHUP fans out); a refused
    reload is refused by all of them, an applied one applied by all."""
    a, b = pair
    cfg = _config({"a": a})
    gw = _two_workers(cfg, tmp_path)
    try:

        def views() -> list[dict[str, Any]]:
            return _worker_views(gw)

        new = copy.deepcopy(cfg)
        new["regions"][0]["servers"].append({"name": "b", "http": b.http_address, "grpc": b.grpc_address})
        new["regions"].append(
            {"name": "dns", "discover": {"dns_name": "t.example", "nameserver": "localhost:53"}}
        )
        _rewrite(gw, new)
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: [v["config_reloads"]["refused"] for v in views()] == [1, 1], timeout=30)
        assert all({s["name"] for s in v["servers"]} == {"a"} for v in views())
        new["regions"].pop()
        _rewrite(gw, new)
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: [v["config_reloads"]["applied"] for v in views()] == [1, 1], timeout=30)
        wait_until(lambda: all({s["name"] for s in v["servers"]} == {"a", "b"} for v in views()), timeout=30)
    finally:
        gw.stop()


def _infer_status(gw: GatewayUnderTest, key: str) -> tuple[int, str]:
    """HTTP status and gRPC code of one inference with `key`, each on a fresh connection."""
    import http.client

    import grpc

    from tests.gateway.test_data_plane import infer_request

    conn = http.client.HTTPConnection(gw.host, gw.http_port, timeout=10)
    try:
        conn.request(
            "POST",
            "/v2/models/lt/infer",
            b'{"inputs":[{"name":"features","shape":[1,8],"datatype":"FP32","data":[0,0,0,0,0,0,0,0]}]}',
            {"x-api-key": key, "Content-Type": "application/json"},
        )
        status = conn.getresponse().status
    finally:
        conn.close()
    with grpc.insecure_channel(f"{gw.host}:{gw.grpc_port}") as ch:
        stub = ch.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda r: r.SerializeToString(),
            response_deserializer=lambda b: b,
        )
        try:
            stub(infer_request(), timeout=10, metadata=(("x-api-key", key),))
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name  # type: ignore[attr-defined]
    return status, code


def test_a_leaked_key_is_revoked_live_on_every_worker(pair: list[TritonServer], tmp_path: Path) -> None:
    """Issue 23, item 6: remove a key from the file, SIGHUP: every worker refuses it at once, the
    other keys keep working, and turning authentication off stays a restart."""
    from gateway.state.auth import hash_key

    keep, leaked = "sk-keep-5d1c0e9a7b", "sk-leaked-3f8e2a6c41"
    keys = [{"name": "keep", "sha256": hash_key(keep)}, {"name": "leaked", "sha256": hash_key(leaked)}]
    cfg = _config({"a": pair[0]}, auth={"keys": keys})
    gw = _two_workers(cfg, tmp_path)
    try:

        def views() -> list[dict[str, Any]]:
            return _worker_views(gw)

        assert _infer_status(gw, leaked) == (200, "OK")
        new = copy.deepcopy(cfg)
        new["auth"]["keys"] = keys[:1]
        _rewrite(gw, new)
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: [v["config_reloads"]["applied"] for v in views()] == [1, 1], timeout=30)
        for _ in range(6):  # fresh connections: both workers answer some
            assert _infer_status(gw, leaked) == (401, "UNAUTHENTICATED")
            assert _infer_status(gw, keep) == (200, "OK")
        new["auth"]["keys"] = []  # auth off: per-client limits instead of per-key ones, a restart
        _rewrite(gw, new)
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: [v["config_reloads"]["refused"] for v in views()] == [1, 1], timeout=30)
        assert "turning authentication off cannot happen live" in views()[0]["config_reloads"]["last_refusal"]
        assert _infer_status(gw, keep) == (200, "OK") and _infer_status(gw, leaked)[0] == 401
    finally:
        gw.stop()


def test_a_revoked_keys_open_stream_is_ended_and_other_streams_go_on(
    pair: list[TritonServer], tmp_path: Path
) -> None:
    """Issue 40, item 5: a ModelStreamInfer stream opened with a key that a reload then revokes
    is ended (UNAUTHENTICATED, no further answer); a stream of a key that stays goes on."""
    import queue

    import grpc

    from gateway.state.auth import hash_key
    from tests.gateway.test_data_plane import infer_request

    keep, leaked = "sk-keep-9a7b5d1c0e", "sk-leaked-2a6c413f8e"
    keys = [{"name": "keep", "sha256": hash_key(keep)}, {"name": "leaked", "sha256": hash_key(leaked)}]
    cfg = _config({"a": pair[0]}, auth={"keys": keys})
    gw = launch_gateway(cfg, tmp_path)
    channels = []
    try:

        def stream(key: str) -> tuple[queue.Queue[Any], Iterator[Any]]:
            ch = grpc.insecure_channel(f"{gw.host}:{gw.grpc_port}")
            channels.append(ch)
            call = ch.stream_stream(
                "/inference.GRPCInferenceService/ModelStreamInfer",
                request_serializer=lambda r: r.SerializeToString(),
                response_deserializer=lambda b: b,
            )
            sent: queue.Queue[Any] = queue.Queue()
            answers = call(iter(sent.get, None), timeout=60, metadata=(("x-api-key", key),))
            return sent, answers

        streams = {key: stream(key) for key in (keep, leaked)}
        for sent, answers in streams.values():
            sent.put(infer_request())
            assert next(answers)  # open and answered
        new = copy.deepcopy(cfg)
        new["auth"]["keys"] = keys[:1]
        _rewrite(gw, new)
        gw.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: _reloads(gw)["applied"] == 1, timeout=30)
        sent, answers = streams[leaked]
        sent.put(infer_request())
        with pytest.raises(grpc.RpcError) as ended:
            got = next(answers)
            raise AssertionError(f"the revoked key's stream was answered: {got[:80]!r}")
        assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        assert "revoked" in (ended.value.details() or "")  # type: ignore[attr-defined]
        sent, answers = streams[keep]
        sent.put(infer_request())
        assert next(answers)
        for sent, _ in streams.values():
            sent.put(None)
    finally:
        for ch in channels:
            ch.close()
        gw.stop()
