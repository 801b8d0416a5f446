"""Servers discovered from DNS (a real DNS server on loopback), added and removed under load."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from skewserve.ports import free_port, port_is_free
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec
from tests.gateway.conftest import launch_gateway, wait_until

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


def _shared_ports(hosts: list[str]) -> tuple[int, int, int]:
    """Three consecutive ports free on every host: pods of one Service listen on the same ports."""
    for _ in range(50):
        base = free_port(hosts[0])
        if base + 2 < 65536 and all(port_is_free(base + i, h) for h in hosts for i in range(3)):
            return base, base + 1, base + 2
    raise AssertionError("no common free ports on the loopback addresses")


def test_servers_join_and_leave_through_dns_under_load_with_zero_failed_requests(
    gateway_repo: Path, prepared_triton: PreparedTriton, loopback_dns: LoopbackDns, tmp_path: Path
) -> None:
    hosts = ["127.0.0.2", "127.0.0.3"]
    http_port, grpc_port, metrics_port = _shared_ports(hosts)
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
            30,
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
        for s in servers.values():
            s.stop()
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
