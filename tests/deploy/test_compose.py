"""deploy/compose.yaml (one GPU host), checked by Debian's docker-compose (its Compose-spec JSON
schema and interpolation; no Docker engine runs here) and by explicit structure assertions."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.target import TARGET
from gateway.config import ConfigError, load_gateway_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SECRETS = {
    "SKEWSERVE_CACHE_HMAC_SECRET": secrets.token_hex(32),
    "SKEWSERVE_API_KEYS": '[{"name": "team-a", "sha256": "' + "a" * 64 + '"}]',
    "GRAFANA_ADMIN_PASSWORD": "grafana-admin-password",
    "SKEWSERVE_REDIS_PASSWORD": secrets.token_hex(32),
    "SKEWSERVE_CONTROL_KEY": secrets.token_hex(32),
}


def _compose(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is required (Debian package docker-compose; make setup installs it)"
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return subprocess.run(
        [binary, "-f", str(DEPLOY / "compose.yaml"), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        cwd=DEPLOY,
    )


def _volumes(service: dict[str, Any]) -> list[dict[str, Any]]:
    """Volumes in long form (docker-compose 1.29 keeps the short `source:target:ro` strings)."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            kind = "bind" if source.startswith(("/", ".")) else "volume"
            v = {"type": kind, "source": source, "target": target, "read_only": mode == ["ro"]}
        out.append(v)
    return out


def _host_ips(service: dict[str, Any]) -> list[str]:
    return [
        (p.rsplit(":", 2)[0] if p.count(":") == 2 else "") if isinstance(p, str) else p.get("host_ip", "")
        for p in service.get("ports", [])
    ]


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    res = _compose(["config"], SECRETS)
    assert res.returncode == 0, res.stderr
    data: dict[str, Any] = yaml.safe_load(res.stdout)
    return data


def test_compose_refuses_to_start_without_each_secret() -> None:
    for missing in SECRETS:
        res = _compose(["config", "-q"], {k: v for k, v in SECRETS.items() if k != missing})
        assert res.returncode != 0 and f"set {missing}" in res.stderr, (missing, res.stderr)


def test_triton_runs_the_pinned_image_on_a_reserved_gpu(rendered: dict[str, Any]) -> None:
    triton = rendered["services"]["triton"]
    assert triton["image"] == TARGET.image
    assert triton["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    args = triton["command"]
    assert "--model-repository=/models" in args and "--model-control-mode=explicit" in args
    # the repository API is reachable from this host only (rollout), never from outside
    assert _host_ips(triton) == ["127.0.0.1", "127.0.0.1"]
    assert [v for v in _volumes(triton) if v["target"] == "/models"][0]["read_only"] is True
    assert triton["healthcheck"]["test"][-1].endswith("/v2/health/ready")


def test_triton_starts_empty_and_only_the_controller_holds_its_model_control_key(
    rendered: dict[str, Any],
) -> None:
    from controller.triton_admin import CONTROL_HEADER

    args = rendered["services"]["triton"]["command"]
    assert not any(a.startswith("--load-model") for a in args)  # one broken model cannot stop start-up
    assert "--strict-readiness=false" in args
    # the header the controller sends, the key it holds, and the same control APIs as the clusters'
    control = (
        f"model-repository,shared-memory,trace,logging:{CONTROL_HEADER}={SECRETS['SKEWSERVE_CONTROL_KEY']}"
    )
    assert f"--http-restricted-api={control}" in args
    assert f"--grpc-restricted-protocol={control}" in args
    assert "--backend-config=tensorrt,version-compatible=true" in args
    controller = rendered["services"]["controller"]
    assert controller["environment"]["SKEWSERVE_CONTROL_KEY"] == SECRETS["SKEWSERVE_CONTROL_KEY"]
    assert controller["entrypoint"][:2] == ["skewserve", "controller"]
    assert "--servers-version-compatible" in controller["entrypoint"]
    assert "SKEWSERVE_CONTROL_KEY" not in rendered["services"]["gateway"].get("environment", {})


def test_repository_location_can_be_object_storage() -> None:
    res = _compose(["config"], {**SECRETS, "SKEWSERVE_MODEL_REPOSITORY": "s3://models-bucket/prod"})
    assert res.returncode == 0, res.stderr
    triton = yaml.safe_load(res.stdout)["services"]["triton"]
    assert "--model-repository=s3://models-bucket/prod" in triton["command"]
    # Temporary credentials work, and models copied from the bucket land on a volume of their own.
    assert "AWS_SESSION_TOKEN" in triton["environment"]
    mount = triton["environment"]["TRITON_AWS_MOUNT_DIRECTORY"]
    assert any(str(v).endswith(":" + mount) or mount in str(v) for v in triton["volumes"]), triton["volumes"]


def test_gateway_gets_its_config_and_secrets_and_starts_after_its_dependencies(
    rendered: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = rendered["services"]["gateway"]
    assert (ROOT / gw["build"]["dockerfile"]).is_file()
    mount = next(v for v in _volumes(gw) if v["target"] == "/etc/skewserve/gateway.yaml")
    config_file = Path(mount["source"])
    with pytest.raises(ConfigError, match=r"cache\.hmac_secret must be set"):
        load_gateway_config(config_file)
    for key, value in gw["environment"].items():
        monkeypatch.setenv(key, value)
    cfg = load_gateway_config(config_file)
    assert cfg.auth.keys[0].name == "team-a" and cfg.cache.backend == "redis"
    servers = {s.http.split(":")[0] for r in cfg.regions for s in r.servers}
    password = SECRETS["SKEWSERVE_REDIS_PASSWORD"]
    assert servers == {"triton"} and cfg.cache.redis_url == f"redis://:{password}@redis:6379/0"
    redis = rendered["services"]["redis"]
    assert redis["command"][-2:] == ["--requirepass", password]  # Redis asks for the same password
    assert redis["environment"]["REDISCLI_AUTH"] == password  # and its health check sends it
    assert gw["depends_on"] == {
        "triton": {"condition": "service_healthy"},
        "redis": {"condition": "service_healthy"},
    }
    grace = int(gw["stop_grace_period"].removesuffix("s"))
    assert grace > cfg.drain.grace_s + cfg.drain.timeout_s
    # metrics and admin reachable from this host (README: ops access), never from outside it
    # docker-compose v1 renders short syntax ("127.0.0.1:8082:8082"), v2 long syntax: read either.
    ops = [
        (p["host_ip"], str(p["published"]))
        if isinstance(p, dict)
        else tuple(p.rsplit(":", 1)[0].rsplit(":", 1))
        for p in gw["ports"]
        if int(str(p["target"] if isinstance(p, dict) else p.rsplit(":", 1)[1]).split("/")[0])
        == cfg.listen.ops_port
    ]
    assert ops == [("127.0.0.1", "8082")]


def test_every_bind_mount_exists_and_prometheus_config_passes_promtool(
    rendered: dict[str, Any], tmp_path: Path
) -> None:
    mounts = {
        v["target"]: Path(v["source"])
        for svc in rendered["services"].values()
        for v in _volumes(svc)
        if v["type"] == "bind"
    }
    for target, source in mounts.items():
        if target != "/models":  # the repository is the user's (README: export first)
            assert source.exists(), f"{source} (mounted at {target}) does not exist"
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package prometheus)"
    prom = mounts["/etc/prometheus/prometheus.yml"].read_text()
    for rule_file in yaml.safe_load(prom)["rule_files"]:  # each one mounted, and read by promtool
        prom = prom.replace(rule_file, str(mounts[rule_file]))
    (tmp_path / "prometheus.yml").write_text(prom)
    res = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
    targets = {
        t for sc in yaml.safe_load(prom)["scrape_configs"] for c in sc["static_configs"] for t in c["targets"]
    }
    assert targets == {"gateway:8082", "triton:8002"}  # the gateway's ops listener


def test_grafana_is_provisioned_with_the_datasource_and_dashboard(rendered: dict[str, Any]) -> None:
    grafana = rendered["services"]["grafana"]
    mounts = {v["target"]: Path(v["source"]) for v in _volumes(grafana)}
    provisioning = mounts["/etc/grafana/provisioning"]
    ds = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"]
    provider = yaml.safe_load((provisioning / "dashboards" / "skewserve.yaml").read_text())["providers"][0]
    dashboard_dir = provider["options"]["path"]
    dashboards = [t for t in mounts if t.startswith(dashboard_dir + "/")]
    assert sorted(mounts[t].name for t in dashboards) == ["skewserve-gateway.json", "skewserve-training.json"]


def test_images_are_pinned_by_exact_tag(rendered: dict[str, Any]) -> None:
    for name, svc in rendered["services"].items():
        image = svc["image"]
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        assert tag and tag != "latest" and any(c.isdigit() for c in tag), f"{name}: {image} is not pinned"


def test_the_controller_reads_the_servers_of_the_gateway_config_without_its_secrets() -> None:
    from controller.fleet import fleet_config

    fleet = fleet_config(DEPLOY / "compose" / "gateway.yaml")
    assert [(r.name, [s.http for s in r.servers]) for r in fleet.regions] == [("local", ["triton:8000"])]
