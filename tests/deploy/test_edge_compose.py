"""deploy/edge/compose.yaml (an edge site: one CPU Triton, one gateway whose cascade's last stage is
the cloud gateway), checked by Debian's docker-compose (no Docker engine runs here) and its gateway
config by the gateway's own loader, with the container paths it names pointed at real files."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.target import TARGET
from gateway.config import load_gateway_config
from gateway.fleet.cascade import Cascade, check_rules
from gateway.fleet.cascade_rule import rule_document, write_rule
from tests.deploy.test_compose import _host_ips, _volumes
from tests.gateway.tls_certs import self_signed_certificate

ROOT = Path(__file__).resolve().parents[2]
EDGE = ROOT / "deploy" / "edge"
KEY_TARGET = "/run/secrets/cloud_key"
CA_TARGET = "/run/secrets/cloud_ca"
RULE_DIR_TARGET = "/etc/skewserve/cascade"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What a site sets: its clients' keys, the cloud's address, the key and CA files, the rule folder."""
    work = tmp_path_factory.mktemp("edge_site")
    (work / "cloud.key").write_text("the-cloud-key\n")
    ca, _ = self_signed_certificate(work)
    rules = work / "cascade"
    classes = [f"class_{i}" for i in range(3)]
    write_rule(rules / "rule.json", rule_document("per_class", classes, 1.2, [0.5, 0.9, 2.0], 1))
    return {
        "SKEWSERVE_API_KEYS": '[{"name": "site-app", "sha256": "' + "b" * 64 + '"}]',
        "SKEWSERVE_CLOUD_GATEWAY_IP": "10.20.30.40",
        "SKEWSERVE_CLOUD_KEY_FILE": str(work / "cloud.key"),
        "SKEWSERVE_CLOUD_CA_FILE": str(ca),
        "SKEWSERVE_CASCADE_DIR": str(rules),
    }


def _compose(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is required (Debian package docker-compose; make setup installs it)"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SKEWSERVE_")}
    return subprocess.run(
        [binary, "-f", str(EDGE / "compose.yaml"), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        cwd=EDGE,
    )


@pytest.fixture(scope="module")
def rendered(site: dict[str, str]) -> dict[str, Any]:
    res = _compose(["config"], site)
    assert res.returncode == 0, res.stderr
    data: dict[str, Any] = yaml.safe_load(res.stdout)
    return data


def test_the_site_refuses_to_start_without_each_setting(site: dict[str, str]) -> None:
    for missing in site:
        res = _compose(["config", "-q"], {k: v for k, v in site.items() if k != missing})
        assert res.returncode != 0 and f"set {missing}" in res.stderr, (missing, res.stderr)


def test_one_cpu_triton_with_the_local_profile_reachable_only_by_the_gateway(
    rendered: dict[str, Any],
) -> None:
    assert sorted(rendered["services"]) == ["gateway", "triton"]
    triton = rendered["services"]["triton"]
    assert triton["image"] == TARGET.image
    assert "deploy" not in triton  # no GPU reserved
    args = triton["command"]
    assert "--model-config-name=local" in args and "--model-repository=/models" in args
    assert "ports" not in triton
    assert [v for v in _volumes(triton) if v["target"] == "/models"][0]["read_only"] is True
    assert triton["healthcheck"]["test"][-1].endswith("/v2/health/ready")


def test_the_gateway_config_loads_and_its_cascade_ends_at_the_cloud_gateway_over_tls_with_the_key(
    rendered: dict[str, Any], site: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = rendered["services"]["gateway"]
    assert (ROOT / gw["build"]["dockerfile"]).is_file()
    mounts = {v["target"]: Path(v["source"]) for v in _volumes(gw)}
    assert mounts[RULE_DIR_TARGET] == Path(site["SKEWSERVE_CASCADE_DIR"])  # the folder: renames show
    secret = next(s for s in gw["secrets"] if (s if isinstance(s, str) else s["source"]) == "cloud_key")
    assert isinstance(secret, str) or secret.get("target", "cloud_key") == "cloud_key"
    assert Path(rendered["secrets"]["cloud_key"]["file"]) == Path(site["SKEWSERVE_CLOUD_KEY_FILE"])
    assert Path(rendered["secrets"]["cloud_ca"]["file"]) == Path(site["SKEWSERVE_CLOUD_CA_FILE"])
    # The config as the container reads it: its container paths pointed at the files mounted there.
    text = mounts["/etc/skewserve/gateway.yaml"].read_text()
    assert KEY_TARGET in text and CA_TARGET in text and RULE_DIR_TARGET + "/" in text
    text = text.replace(KEY_TARGET, site["SKEWSERVE_CLOUD_KEY_FILE"])
    text = text.replace(CA_TARGET, site["SKEWSERVE_CLOUD_CA_FILE"])
    text = text.replace(RULE_DIR_TARGET + "/", site["SKEWSERVE_CASCADE_DIR"] + "/")
    (tmp_path / "gateway.yaml").write_text(text)
    for key, value in gw["environment"].items():
        monkeypatch.setenv(key, value)
    cfg = load_gateway_config(tmp_path / "gateway.yaml")
    check_rules(cfg)
    assert cfg.auth.keys[0].name == "site-app"
    assert [(r.name, [s.http for s in r.servers]) for r in cfg.regions] == [("edge", ["triton:8000"])]
    (cascade,) = cfg.cascades
    edge, cloud = cascade.stages
    assert (edge.model, edge.gateway, edge.rule) == (
        "digits-small",
        None,
        site["SKEWSERVE_CASCADE_DIR"] + "/rule.json",
    )
    assert cloud.gateway is not None and cloud.rule is None
    assert (cloud.gateway.http, cloud.gateway.grpc) == ("cloud-gateway:8080", "cloud-gateway:8081")
    # over TLS, verified against the site's CA: the key never crosses in clear
    assert (cloud.gateway.tls, cloud.gateway.plaintext) == (True, False)
    assert cloud.gateway.ca_file == site["SKEWSERVE_CLOUD_CA_FILE"]
    assert gw["extra_hosts"] == [f"cloud-gateway:{site['SKEWSERVE_CLOUD_GATEWAY_IP']}"]
    assert cascade.name in cfg.cache.models
    # the key file reaches the cloud stage's requests
    assert Cascade(cascade, 1.0).stages[1].headers == (("x-api-key", "the-cloud-key"),)
    grace = int(gw["stop_grace_period"].removesuffix("s"))
    assert grace > cfg.drain.grace_s + cfg.drain.timeout_s
    ops = [p for p in gw["ports"] if str(cfg.listen.ops_port) in str(p)]
    assert [ip for ip in _host_ips({"ports": ops})] == ["127.0.0.1"]
