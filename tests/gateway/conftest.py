"""Real processes for gateway tests: Triton fleets, gateway processes, redis-server."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from skewserve.gateway_process import GatewayProcess, start_gateway_process
from skewserve.ports import free_port
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonFleet, TritonServer, TritonServerSpec, stop_servers
from tests.waiting import wait_until as wait_until  # re-exported: gateway tests import it from here


def start_fleet(
    repo: Path, layout: dict[str, int], log_dir: Path, prepared: PreparedTriton, **spec: Any
) -> dict[str, list[TritonServer]]:
    """Servers named `<region>-<i>`, launched together (their model loads overlap), by region."""
    specs = [
        TritonServerSpec(repository=repo, region=region, name=f"{region}-{i}", **spec)
        for region, n in layout.items()
        for i in range(n)
    ]
    fleet = TritonFleet(specs, log_dir, prepared).start()
    return fleet.by_region()


def stop_fleet(fleet: dict[str, list[TritonServer]]) -> None:
    stop_servers(s for servers in fleet.values() for s in servers)


@pytest.fixture(scope="module")
def one_triton(
    gateway_repo: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[dict[str, list[TritonServer]]]:
    """One server (region us-east), one per test module that asks for it."""
    f = start_fleet(gateway_repo, {"us-east": 1}, tmp_path_factory.mktemp("one_triton_logs"), prepared_triton)
    yield f
    stop_fleet(f)


@pytest.fixture(scope="module")
def fleet(
    gateway_repo: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[dict[str, list[TritonServer]]]:
    """2 regions x 2 servers, shared by the tests that do not harm servers."""
    f = start_fleet(
        gateway_repo, {"us-east": 2, "eu-west": 2}, tmp_path_factory.mktemp("fleet_logs"), prepared_triton
    )
    yield f
    stop_fleet(f)


def gateway_config(
    fleet: dict[str, list[TritonServer]], home: str = "us-east", **overrides: Any
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "home_region": home,
        "listen": {"host": "127.0.0.1", "http_port": free_port(), "grpc_port": free_port(), "ops_port": 0},
        "log_json": True,
        "health": {"interval_s": 0.2, "timeout_s": 1.0, "eject_after_failures": 2, "base_ejection_s": 1.0},
        "cache": {"backend": "memory", "models": ["lt"], "ttl_s": 60},
        "drain": {"grace_s": 0.5, "timeout_s": 5},
        "regions": [
            {
                "name": region,
                "servers": [
                    {"name": s.spec.name, "http": s.http_address, "grpc": s.grpc_address} for s in servers
                ],
            }
            for region, servers in fleet.items()
        ],
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


class GatewayUnderTest(GatewayProcess):
    """A gateway process plus the admin/metrics reads tests make (on its ops listener)."""

    def admin(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(f"http://{self.ops}/admin/upstreams", timeout=5) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://{self.ops}/metrics", timeout=5) as r:
            return r.read().decode()

    def server(self, name: str) -> dict[str, Any]:
        return next(s for s in self.admin()["servers"] if s["name"] == name)


def launch_gateway(cfg: dict[str, Any], workdir: Path, env: dict[str, str] | None = None) -> GatewayUnderTest:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"gateway-{cfg['listen']['http_port']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    gw = start_gateway_process(path, path.with_suffix(".log"), env=env)
    return GatewayUnderTest(
        gw.proc, gw.host, gw.http_port, gw.grpc_port, gw.log_path, gw.ops_port, gw.ops_host
    )


@pytest.fixture()
def make_gateway(tmp_path: Path) -> Iterator[Callable[..., GatewayUnderTest]]:
    started: list[GatewayUnderTest] = []

    def make(cfg: dict[str, Any], env: dict[str, str] | None = None) -> GatewayUnderTest:
        gw = launch_gateway(cfg, tmp_path, env)
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


@pytest.fixture(scope="module")
def shared_gateway(
    fleet: dict[str, list[TritonServer]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayUnderTest]:
    gw = launch_gateway(gateway_config(fleet), tmp_path_factory.mktemp("gw"))
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is required (make setup installs it)"
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    # As deployed (deploy/ sets requirepass): every client of the tests' Redis must hold the password.
    password = secrets.token_hex(16)
    proc = subprocess.Popen(
        [
            binary,
            "--requirepass",
            password,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    import redis

    client = redis.Redis(port=port, password=password)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.05)
    yield f"redis://:{password}@127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)
