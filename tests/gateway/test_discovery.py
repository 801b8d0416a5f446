"""Servers discovered from DNS (a real DNS server on loopback) and from Kubernetes EndpointSlices
(a real HTTP server on loopback speaking the API server's list/watch), added and removed under load."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from skewserve.local_autoscale import shared_ports
from skewserve.ports import free_port
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec, stop_servers
from tests.gateway.conftest import GatewayUnderTest, launch_gateway, wait_until
from tests.gateway.kube_api import KubeApi, endpoint, make_tls
from tests.gateway.steady_load import SteadyLoad

NAME = "triton.skewserve.test."


class LoopbackDns:
    """An authoritative DNS server on a loopback UDP port answering A queries from a mutable set."""

    def __init__(self) -> None:
        self.addresses: set[str] = set()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.queries = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                wire, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            query = dns.message.from_wire(wire)
            response = dns.message.make_response(query)
            question = query.question[0]
            if question.name.to_text() == NAME and question.rdtype == dns.rdatatype.A and self.addresses:
                response.answer.append(dns.rrset.from_text(NAME, 0, "IN", "A", *sorted(self.addresses)))
            elif question.name.to_text() != NAME:
                response.set_rcode(dns.rcode.NXDOMAIN)
            self.queries += 1
            self.sock.sendto(response.to_wire(), peer)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def loopback_dns() -> Iterator[LoopbackDns]:
    server = LoopbackDns()
    yield server
    server.close()


@pytest.mark.slow
def test_servers_join_and_leave_through_dns_under_load_with_zero_failed_requests(
    gateway_repo: Path, prepared_triton: PreparedTriton, loopback_dns: LoopbackDns, tmp_path: Path
) -> None:
    hosts = ["127.0.0.2", "127.0.0.3"]
    http_port, grpc_port, metrics_port = shared_ports(hosts)
    servers = {
        h: TritonServer(
            TritonServerSpec(
                repository=gateway_repo,
                name=f"pod-{h}",
                host=h,
                http_port=http_port,
                grpc_port=grpc_port,
                metrics_port=metrics_port,
            ),
            tmp_path / "logs",
            prepared_triton,
        )
        for h in hosts
    }
    first, second = hosts
    servers[first].start()
    loopback_dns.addresses = {first}
    cfg = {
        "home_region": "local",
        "listen": {"host": "127.0.0.1", "http_port": free_port(), "grpc_port": free_port()},
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "cache": {"backend": "none"},
        "drain": {"grace_s": 0.2, "timeout_s": 5},
        "regions": [
            {
                "name": "local",
                "discover": {
                    "dns_name": NAME,
                    "http_port": http_port,
                    "grpc_port": grpc_port,
                    "interval_s": 0.2,
                    "nameserver": f"127.0.0.1:{loopback_dns.port}",
                },
            }
        ],
    }
    gw = launch_gateway(cfg, tmp_path / "gw")
    stop = threading.Event()
    results: dict[str, list[str] | int] = {"ok": 0, "failed": []}
    body = json.dumps(
        {"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 8], "data": [0.5] * 16}]}
    ).encode()

    def load() -> None:
        while not stop.is_set():
            req = urllib.request.Request(
                f"http://{gw.http}/v2/models/lt/infer",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    r.read()
                results["ok"] += 1  # type: ignore[operator]
            except (urllib.error.URLError, OSError) as exc:  # every failure is recorded, none ignored
                results["failed"].append(repr(exc))  # type: ignore[union-attr]

    def listed() -> dict[str, dict]:
        return {s["name"]: s for s in gw.admin()["servers"]}

    threads = [threading.Thread(target=load) for _ in range(4)]
    try:
        wait_until(lambda: listed().get(f"local/{first}", {}).get("available", False), 30, "the first server")
        for t in threads:
            t.start()
        wait_until(lambda: results["ok"] > 20, 30, "traffic through the first server")

        servers[second].start()  # a new pod: ready first, then published in DNS
        loopback_dns.addresses = {first, second}
        wait_until(
            lambda: listed().get(f"local/{second}", {}).get("requests", 0) > 20,
            90,  # the balancer warms the new server up; a loaded machine sends it fewer requests a second
            "traffic on the new server",
        )

        loopback_dns.addresses = {second}  # the first pod leaves the Service ...
        wait_until(lambda: f"local/{first}" not in listed(), 30, "the first server leaving")
        servers[first].stop()  # ... and only then stops, as a terminating pod does
        served = listed()[f"local/{second}"]["requests"]
        wait_until(lambda: listed()[f"local/{second}"]["requests"] > served + 50, 30, "traffic after removal")
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join()
        gw.stop()
        stop_servers(servers.values())
    assert results["failed"] == [] and results["ok"] > 100
    assert loopback_dns.queries > 3  # re-resolved, not read once


def test_region_needs_servers_or_discovery_and_a_nameserver_is_host_port(tmp_path: Path) -> None:
    from gateway.config import ConfigError, load_gateway_config

    with pytest.raises(
        ConfigError, match=r"region 'a' needs servers or discover \(a DNS name or Kubernetes EndpointSlices\)"
    ):
        load_gateway_config(None, home_region="a", regions=[{"name": "a"}])
    with pytest.raises(
        ConfigError, match=r"regions\.0\.discover\.nameserver: '10\.0\.0\.1' is not host:port"
    ):
        load_gateway_config(
            None,
            home_region="a",
            regions=[{"name": "a", "discover": {"dns_name": "t", "nameserver": "10.0.0.1"}}],
        )


def _pods(
    repo: Path, prepared: PreparedTriton, hosts: list[str], logs: Path
) -> tuple[dict[str, TritonServer], tuple[int, int, int]]:
    ports = shared_ports(hosts)
    servers = {
        h: TritonServer(
            TritonServerSpec(
                repository=repo,
                name=f"pod-{h}",
                host=h,
                http_port=ports[0],
                grpc_port=ports[1],
                metrics_port=ports[2],
            ),
            logs,
            prepared,
        )
        for h in hosts
    }
    return servers, ports


@pytest.mark.slow
def test_servers_follow_endpointslices_under_load_with_zero_failed_requests(
    gateway_repo: Path, prepared_triton: PreparedTriton, tmp_path: Path
) -> None:
    """Add a pod (not ready, then ready), make the first terminating, then delete its slice: the
    gateway follows the watch stream and no client request fails."""
    hosts = ["127.0.0.4", "127.0.0.5"]
    servers, (http_port, grpc_port, _) = _pods(gateway_repo, prepared_triton, hosts, tmp_path / "logs")
    first, second = hosts
    ports = {"http": http_port, "grpc": grpc_port, "metrics": http_port + 2}
    token = tmp_path / "token"
    token.write_text("test-service-account-token\n")
    api = KubeApi("test-service-account-token")
    api.put("triton-a", [endpoint(first)], ports)
    api.put("other-svc", [endpoint("127.0.0.9")], ports, service="redis")  # another Service: ignored
    servers[first].start()
    cfg = {
        "home_region": "local",
        "listen": {"host": "127.0.0.1", "http_port": free_port(), "grpc_port": free_port(), "ops_port": 0},
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "cache": {"backend": "none"},
        "drain": {"grace_s": 0.2, "timeout_s": 5},
        "regions": [
            {
                "name": "local",
                # The ports come from the slices' named ports, not these (nothing listens there).
                "discover": {
                    "http_port": 1,
                    "grpc_port": 2,
                    "interval_s": 0.2,
                    "endpointslices": {
                        "service": "triton",
                        "namespace": "skewserve",
                        "api_url": api.url,
                        "token_file": str(token),
                        "ca_file": None,
                        "watch_timeout_s": 77,
                    },
                },
            }
        ],
    }
    gw = launch_gateway(cfg, tmp_path / "gw")
    load = SteadyLoad(gw.http)

    def listed() -> dict[str, dict]:
        return {s["name"]: s for s in gw.admin()["servers"]}

    def labelled(server: str) -> bool:
        return f'server="{server}"' in gw.metrics()

    a, b = f"local/{first}", f"local/{second}"
    try:
        wait_until(lambda: listed().get(a, {}).get("available", False), 30, "the first endpoint")
        assert set(listed()) == {a}  # the other Service's endpoint is not ours
        load.start()
        wait_until(lambda: load.served(a) > 20, 30, "traffic through the first endpoint")

        servers[second].start()
        api.put("triton-b", [endpoint(second, ready=False)], ports)  # a pod starting: not ready yet
        wait_until(lambda: len(api.watches) >= 1 and api.version == 103, 10, "the watch")
        served = load.served(a)
        wait_until(lambda: load.served(a) > served + 20, 30, "traffic while the new pod is not ready")
        assert b not in listed() and load.served(b) == 0
        api.put("triton-b", [endpoint(second, ready=True)], ports)  # MODIFIED: ready
        wait_until(lambda: load.served(b) > 20, 30, "traffic on the new endpoint")

        # The first pod terminates: not ready but still serving; the second is ready, so it drains.
        api.put("triton-a", [endpoint(first, ready=False, serving=True, terminating=True)], ports)
        wait_until(
            lambda: a not in listed() and gw.admin()["servers_draining"] == 0, 30, "the first draining"
        )
        removed_at = time.monotonic()
        servers[first].stop()  # only then does the pod's process end
        api.delete("triton-a")
        served = load.served(b)
        wait_until(lambda: load.served(b) > served + 50, 30, "traffic after removal")
        assert load.served_since(a, removed_at) == 0
        assert not labelled(a)  # the departed server's metric labels left /metrics with it
        assert labelled(b)
    finally:
        load.stop()
        gw.stop()
        api.close()
        stop_servers(servers.values())
    assert load.failed == [] and load.ok > 100
    # Listed once, then followed the watch stream: no re-list after a watch ended or failed. (On a
    # loaded machine the first list can time out and be retried: that is the initial list, logged.)
    log = gw.log_path.read_text()
    assert "re-listing" not in log and api.unauthorized == 0, log[-2000:]
    assert api.lists == 1 + log.count("listing EndpointSlices of triton for local failed (retrying)")
    assert api.watches[0]["timeoutSeconds"] == "77" and api.watches[0]["allowWatchBookmarks"] == "true"
    assert api.watches[0]["labelSelector"] == "kubernetes.io/service-name=triton"


@pytest.mark.slow
def test_endpointslice_watch_relists_after_410_and_refuses_a_wrong_token(
    gateway_repo: Path, prepared_triton: PreparedTriton, tmp_path: Path
) -> None:
    """A compacted resourceVersion (410 Gone) makes the gateway list again; a token the API server
    refuses changes nothing, and the rotated token file is read on the next attempt."""
    (host,) = hosts = ["127.0.0.6"]
    servers, (http_port, grpc_port, _) = _pods(gateway_repo, prepared_triton, hosts, tmp_path / "logs")
    ports = {"http": http_port, "grpc": grpc_port}
    token = tmp_path / "token"
    token.write_text("stale-token")
    api = KubeApi("fresh-token")
    api.put("triton-a", [endpoint(host)], ports)
    servers[host].start()
    cfg = {
        "home_region": "local",
        "listen": {"host": "127.0.0.1", "http_port": free_port(), "grpc_port": free_port(), "ops_port": 0},
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "cache": {"backend": "none"},
        "regions": [
            {
                "name": "local",
                "discover": {
                    "interval_s": 0.2,
                    "endpointslices": {
                        "service": "triton",
                        "namespace": "skewserve",
                        "api_url": api.url,
                        "token_file": str(token),
                        "ca_file": None,
                        "max_event_bytes": 65536,
                    },
                },
            }
        ],
    }
    gw = launch_gateway(cfg, tmp_path / "gw")
    try:
        wait_until(lambda: api.unauthorized >= 2, 30, "refused lists")
        assert gw.admin()["servers"] == [] and "HTTP 401" in gw.log_path.read_text()
        token.write_text("fresh-token")  # kubelet rotated the projected token
        wait_until(lambda: [s["name"] for s in gw.admin()["servers"]] == [f"local/{host}"], 30, "listed")
        # A slice with the Service's label that the EndpointSlice controller did not make (anyone
        # allowed to create slices in the namespace could) adds no server, listed or watched.
        api.put("forged", [endpoint("127.0.0.7")], ports, managed_by="someone-else")
        api.put("unlabelled", [endpoint("127.0.0.8")], ports, managed_by=None)
        # An event longer than max_event_bytes is never held whole: the watch ends and lists again.
        lists = api.lists
        api.put("triton-a", [endpoint(host)], ports, annotations={"padding": "x" * 200_000})
        wait_until(lambda: api.lists > lists, 30, "a re-list after the oversized event")
        assert (
            "above discover.endpointslices.max_event_bytes (65536): listing again" in gw.log_path.read_text()
        )
        assert [s["name"] for s in gw.admin()["servers"]] == [f"local/{host}"]
        lists = api.lists
        # The change comes with a compaction: the watch's version is gone, the next watch gets 410,
        # and the change arrives by a new list.
        api.put("triton-a", [endpoint(host, ready=False)], ports, compact=True)
        wait_until(lambda: api.lists > lists, 30, "a re-list after 410")
        wait_until(lambda: gw.admin()["servers"] == [], 30, "the not-ready endpoint leaving")
        assert (
            "re-listing EndpointSlices for local: watch: too old resource version" in gw.log_path.read_text()
        )
    finally:
        gw.stop()
        api.close()
        stop_servers(servers.values())


def test_usable_endpoints_follow_endpoint_conditions() -> None:
    """Ready (or unset) and not terminating are used; terminating-but-serving only when nothing is ready."""
    from gateway.fleet.discovery_k8s import usable_endpoints
    from gateway.fleet.discovery_source import Endpoint

    ports = [{"name": "http", "port": 9000}, {"name": "grpc", "port": 9001}]
    slices = {
        "a": {
            "ports": ports,
            "endpoints": [
                endpoint("10.0.0.1"),
                endpoint("10.0.0.2", ready=None),
                endpoint("10.0.0.3", ready=False),
                endpoint("10.0.0.4", ready=False, serving=True, terminating=True),
                {"addresses": [], "conditions": {"ready": True}},
            ],
        }
    }
    assert usable_endpoints(slices, "http", "grpc", 1, 2) == {
        Endpoint("10.0.0.1", 9000, 9001),
        Endpoint("10.0.0.2", 9000, 9001),
    }
    slices["a"]["endpoints"] = slices["a"]["endpoints"][2:]
    assert usable_endpoints(slices, "http", "grpc", 1, 2) == {Endpoint("10.0.0.4", 9000, 9001)}
    slices["a"]["ports"] = []  # unnamed ports: the configured ones
    assert usable_endpoints(slices, "http", "grpc", 1, 2) == {Endpoint("10.0.0.4", 1, 2)}


def test_endpointslices_in_cluster_over_https_verify_the_api_server_with_the_ca_file(tmp_path: Path) -> None:
    """api_url unset: the API server comes from KUBERNETES_SERVICE_HOST/PORT, over https verified
    with `ca_file`; a gateway given another CA refuses the server and lists nothing."""
    ca, tls = make_tls(tmp_path / "tls")
    other_ca, _ = make_tls(tmp_path / "other")
    token = tmp_path / "token"
    token.write_text("t0ken")
    api = KubeApi("t0ken", tls=tls)
    api.put("triton-a", [endpoint("127.0.0.7")], {"http": 1, "grpc": 2})  # listed; nothing listens

    def gateway(ca_file: Path, workdir: str) -> GatewayUnderTest:
        cfg = {
            "home_region": "local",
            "listen": {
                "host": "127.0.0.1",
                "http_port": free_port(),
                "grpc_port": free_port(),
                "ops_port": 0,
            },
            "health": {"interval_s": 0.2, "timeout_s": 0.5},
            "cache": {"backend": "none"},
            "regions": [
                {
                    "name": "local",
                    "discover": {
                        "interval_s": 0.2,
                        "endpointslices": {
                            "service": "triton",
                            "namespace": "skewserve",
                            "token_file": str(token),
                            "ca_file": str(ca_file),
                        },
                    },
                }
            ],
        }
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
        return launch_gateway(cfg, tmp_path / workdir, env)

    trusting = gateway(ca, "trusting")
    distrusting = gateway(other_ca, "distrusting")
    try:
        names = lambda gw: [s["name"] for s in gw.admin()["servers"]]  # noqa: E731
        wait_until(lambda: names(trusting) == ["local/127.0.0.7"], 30, "the endpoint listed over https")
        wait_until(lambda: "CERTIFICATE_VERIFY_FAILED" in distrusting.log_path.read_text(), 30, "the refusal")
        assert names(distrusting) == [] and api.lists == 1
    finally:
        trusting.stop()
        distrusting.stop()
        api.close()


def test_discover_needs_exactly_one_source() -> None:
    from gateway.config import ConfigError, load_gateway_config

    for discover in ({"http_port": 8000}, {"dns_name": "t", "endpointslices": {"service": "triton"}}):
        with pytest.raises(
            ConfigError,
            match=r"regions\.0\.discover: discover needs exactly one source: dns_name .* or endpointslices",
        ):
            load_gateway_config(None, home_region="a", regions=[{"name": "a", "discover": discover}])
    with pytest.raises(
        ConfigError, match=r"discover\.endpointslices\.api_url: 'ftp://x' is not an http\(s\) URL"
    ):
        load_gateway_config(
            None,
            home_region="a",
            regions=[{"name": "a", "discover": {"endpointslices": {"service": "t", "api_url": "ftp://x"}}}],
        )


def test_a_departed_servers_metric_labels_are_removed_and_late_requests_fold() -> None:
    from gateway.operations.metrics import DEPARTED_SERVER, GatewayMetrics

    class Server:
        region, name = "r", "r/10.0.0.1"

    m = GatewayMetrics()
    m.server_joined("r", "r/10.0.0.1")
    m.server_joined("r", "r/10.0.0.2")
    m.request("lt", "r", "r/10.0.0.1", "http", "200", 0.01)
    m.upstream_latency(Server(), 0.01)
    m.ejection(Server(), "test")
    m.request("lt", "r", "r/10.0.0.2", "http", "200", 0.01)
    assert 'server="r/10.0.0.1"' in m.render().decode()
    m.server_left("r", "r/10.0.0.1")
    text = m.render().decode()
    assert 'server="r/10.0.0.1"' not in text and 'server="r/10.0.0.2"' in text
    m.request("lt", "r", "r/10.0.0.1", "http", "200", 0.01)  # finished after it left
    text = m.render().decode()
    assert 'server="r/10.0.0.1"' not in text and f'server="{DEPARTED_SERVER}"' in text
    # Nothing kept by a departed name: discovery's names come and go, and that would only grow.
    assert all(key[2] != "r/10.0.0.1" for key in m._request_children)
    # Back in the fleet (a new server at the old address): its requests count under its name again.
    m.server_joined("r", "r/10.0.0.1")
    m.request("lt", "r", "r/10.0.0.1", "http", "200", 0.01)
    assert 'server="r/10.0.0.1"' in m.render().decode()
    m.server_left("r", "r/10.0.0.1")
    # A name held twice (an old server draining while a new one of its name joined) stays until both left.
    m.server_joined("r", "r/10.0.0.2")
    m.server_left("r", "r/10.0.0.2")
    assert 'server="r/10.0.0.2"' in m.render().decode()
    m.server_left("r", "r/10.0.0.2")
    assert 'server="r/10.0.0.2"' not in m.render().decode()
