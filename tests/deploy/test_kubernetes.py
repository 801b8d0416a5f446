"""Kubernetes manifests (deploy/k8s: kustomize base + one overlay per region), validated against the
Kubernetes schema with kubernetes-validate, rendered with `kubectl kustomize` where kubectl exists."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from exporter.object_store import ObjectRepository
from exporter.target import TARGET
from gateway.config import ConfigError, load_gateway_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"  # the version the manifests are validated for (README, Deploy)
REGIONS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
SECRET_ENV = {
    "SKEWSERVE_GATEWAY_CACHE__HMAC_SECRET": secrets.token_hex(32),
    "SKEWSERVE_GATEWAY_AUTH__KEYS": '[{"name": "team-a", "sha256": "' + "b" * 64 + '"}]',
}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return data


def _base_resources() -> list[dict[str, Any]]:
    return [d for f in _kustomization(K8S / "base")["resources"] for d in _docs(K8S / "base" / f)]


def _by_id(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


# Custom resources the Kubernetes schema set lacks: validated structurally in test_autoscaling.py.
CUSTOM_RESOURCES = {"keda.sh/v1alpha1", "monitoring.coreos.com/v1"}


def _validate(doc: dict[str, Any]) -> None:
    if doc["apiVersion"] in CUSTOM_RESOURCES:
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(
            f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}"
        ) from exc


def test_every_base_resource_is_valid_kubernetes() -> None:
    docs = _base_resources()
    for doc in docs:
        _validate(doc)
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds
    assert "Secret" not in kinds  # secrets are created by a documented command, never shipped


def test_triton_waits_for_loading_before_liveness_and_reads_the_repository_from_outside() -> None:
    triton = _by_id(_base_resources())[("StatefulSet", "triton")]
    container = triton["spec"]["template"]["spec"]["containers"][0]
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/v2/health/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # load + warm-up budget
    assert "--model-repository=$(MODEL_REPOSITORY)" in container["args"]
    # Nothing baked in or mounted but the scratch volume Triton copies loaded models into: the
    # repository itself is object storage.
    assert [m["name"] for m in container.get("volumeMounts", [])] == ["triton-models"]
    assert container["envFrom"] == [{"secretRef": {"name": "skewserve-model-store"}}]
    generators = {g["name"]: g for g in _kustomization(K8S / "base")["configMapGenerator"]}
    literals = dict(lit.split("=", 1) for lit in generators["skewserve-triton"]["literals"])
    assert ObjectRepository.parse(literals["MODEL_REPOSITORY"]).url == "s3://skewserve-models/prod"
    images = {i["name"]: i for i in _kustomization(K8S / "base")["images"]}
    assert f"{images['tritonserver']['newName']}:{images['tritonserver']['newTag']}" == TARGET.image


def test_triton_starts_empty_and_the_controller_alone_holds_the_model_control_key() -> None:
    resources = _by_id(_base_resources())
    triton = resources[("StatefulSet", "triton")]["spec"]["template"]["spec"]["containers"][0]
    args = triton["args"]
    assert not any(a.startswith("--load-model") for a in args) and "--strict-readiness=false" in args
    assert "--http-restricted-api=model-repository:skewserve-control=$(SKEWSERVE_CONTROL_KEY)" in args
    assert "--grpc-restricted-protocol=model-repository:skewserve-control=$(SKEWSERVE_CONTROL_KEY)" in args
    assert "--backend-config=tensorrt,version-compatible=true" in args
    key_ref = {"secretKeyRef": {"name": "skewserve-control", "key": "SKEWSERVE_CONTROL_KEY"}}
    assert {"name": "SKEWSERVE_CONTROL_KEY", "valueFrom": key_ref} in triton["env"]
    controller = resources[("Deployment", "skewserve-controller")]["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert controller["command"] == ["skewserve", "controller"]
    assert {"name": "SKEWSERVE_CONTROL_KEY", "valueFrom": key_ref} in controller["env"]
    assert "--servers-version-compatible" in controller["args"]
    assert "--regions=$(SKEWSERVE_CONTROLLER_REGIONS)" in controller["args"]
    # one controller per region: a canary is promoted once every region's controller passed it
    assert f"--canary-regions={','.join(sorted(REGIONS, reverse=True))}" in controller["args"]
    startup = triton["startupProbe"]
    assert "--load-timeout=600" in controller["args"]  # a load may take the pod's start-up budget
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600
    gateway = resources[("Deployment", "skewserve-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert "skewserve-control" not in str(gateway)


def test_pod_disruption_budgets_select_the_pods_they_protect() -> None:
    docs = _base_resources()
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    budgets = {
        d["metadata"]["name"]: d["spec"]["selector"]["matchLabels"]
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
    }
    assert budgets == {"triton": pods["triton"], "skewserve-gateway": pods["skewserve-gateway"]}


@pytest.mark.parametrize("region", REGIONS)
def test_overlay_patches_and_replaces_existing_resources_by_name(region: str) -> None:
    base = _by_id(_base_resources())
    overlay = K8S / "overlays" / region
    kust = _kustomization(overlay)
    assert kust["resources"] == ["../../base"]
    base_generators = {g["name"] for g in _kustomization(K8S / "base")["configMapGenerator"]}
    for gen in kust["configMapGenerator"]:
        assert gen["behavior"] == "replace" and gen["name"] in base_generators, gen
    for patch_file in kust["patches"]:
        for patch in _docs(overlay / patch_file["path"]):
            target = base.get((patch["kind"], patch["metadata"]["name"]))
            assert target is not None, (
                f"{region}: patch of {patch['kind']}/{patch['metadata']['name']} targets nothing"
            )
            assert patch["apiVersion"] == target["apiVersion"]
            patched = patch.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
            existing = (
                {c["name"]: c for c in target["spec"]["template"]["spec"]["containers"]} if patched else {}
            )
            for c in patched:
                assert c["name"] in existing, f"{region}: container {c['name']} not in the base"
                base_env = {e["name"] for e in existing[c["name"]].get("env", [])}
                assert {e["name"] for e in c.get("env", [])} <= base_env


@pytest.mark.parametrize("region", REGIONS)
def test_overlay_gateway_config_takes_its_home_region_from_the_environment(
    region: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    overlay = K8S / "overlays" / region
    config = overlay / "gateway.yaml"
    env = {
        p["metadata"]["name"]: {
            e["name"]: e["value"] for e in p["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        for p in _docs(overlay / "region.yaml")
        if p["kind"] == "Deployment"
    }
    # the gateway's home region, and the controller reconciling that region's pods only (the other
    # region's load balancer is no server to load models on)
    assert env == {
        "skewserve-gateway": {"SKEWSERVE_GATEWAY_HOME_REGION": region},
        "skewserve-controller": {"SKEWSERVE_CONTROLLER_REGIONS": region},
    }
    monkeypatch.setenv("SKEWSERVE_GATEWAY_HOME_REGION", region)
    with pytest.raises(ConfigError, match=r"cache\.hmac_secret must be set"):
        load_gateway_config(config)  # no secret in the file: the Secret is required
    for k, v in SECRET_ENV.items():
        monkeypatch.setenv(k, v)
    cfg = load_gateway_config(config)
    assert cfg.home_region == region and sorted(r.name for r in cfg.regions) == REGIONS
    for r in cfg.regions:
        hosts = {s.http.rsplit(":", 1)[0] for s in r.servers}
        if r.name == region:  # local pods discovered from the Triton Service's EndpointSlices
            assert hosts == set() and r.discover is not None and r.discover.endpointslices is not None
            assert r.discover.endpointslices.service == "triton"
            assert r.discover.endpointslices.namespace is None  # the pod's own: where the Role grants
        else:  # another cluster: an address that resolves across clusters
            assert hosts == {f"triton.{r.name}.skewserve.internal"}, hosts
    spill = _by_id(_docs(overlay / "region.yaml"))[("Service", "triton-spillover")]["metadata"]["annotations"]
    assert spill["external-dns.alpha.kubernetes.io/hostname"] == f"triton.{region}.skewserve.internal"
    assert spill["service.beta.kubernetes.io/aws-load-balancer-scheme"] == "internal"


@pytest.mark.parametrize("region", REGIONS)
def test_rendered_overlay_is_valid_kubernetes(region: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: rendering skipped; the file-level tests above still ran")
    res = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / region)], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    for doc in docs:
        _validate(doc)
    ids = _by_id(docs)
    gateway = ids[("Deployment", "skewserve-gateway")]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in gateway["containers"][0]["env"]}
    assert env["SKEWSERVE_GATEWAY_HOME_REGION"]["value"] == region
    assert env["SKEWSERVE_GATEWAY_CACHE__HMAC_SECRET"]["valueFrom"]["secretKeyRef"] == {
        "name": "skewserve-gateway",
        "key": "cache-hmac-secret",
    }
    config_map = gateway["volumes"][0]["configMap"]["name"]
    rendered_config = ids[("ConfigMap", config_map)]["data"]["gateway.yaml"]
    assert rendered_config == (K8S / "overlays" / region / "gateway.yaml").read_text()
    triton = ids[("StatefulSet", "triton")]["spec"]["template"]["spec"]["containers"][0]
    assert triton["image"] == TARGET.image
    assert all(d["metadata"].get("namespace") == "skewserve" for d in docs if d["kind"] != "Namespace")
    assert all(d["metadata"]["labels"]["skewserve.io/region"] == region for d in docs)


def test_gateway_service_account_may_list_and_watch_endpointslices_and_nothing_else() -> None:
    """Discovery reads the `triton` Service's EndpointSlices with the gateway pods' service account."""
    ids = _by_id(_base_resources())
    gateway = ids[("Deployment", "skewserve-gateway")]["spec"]["template"]["spec"]
    account = gateway["serviceAccountName"]
    assert ("ServiceAccount", account) in ids
    assert gateway.get("automountServiceAccountToken", True)  # the token discovery authenticates with
    bindings = [
        d
        for d in ids.values()
        if d["kind"] == "RoleBinding"
        and {"kind": "ServiceAccount", "name": account, "namespace": "skewserve"} in d["subjects"]
    ]
    assert len(bindings) == 1 and bindings[0]["roleRef"]["kind"] == "Role"
    role = ids[("Role", bindings[0]["roleRef"]["name"])]
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    assert _kustomization(K8S / "base")["namespace"] == "skewserve"  # where the Role and the Service are
    services = {d["metadata"]["name"] for d in ids.values() if d["kind"] == "Service"}
    assert "triton" in services  # the service the overlays' discover.endpointslices.service names


def test_readme_creates_every_secret_the_manifests_reference() -> None:
    readme = (ROOT / "README.md").read_text()
    refs: set[tuple[str, str]] = set()
    for doc in _base_resources():
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            refs |= {
                (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                for e in c.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            }
            refs |= {(s["secretRef"]["name"], "") for s in c.get("envFrom", []) if "secretRef" in s}
    assert refs, "the manifests reference no Secret"
    for name, key in refs:
        assert f"create secret generic {name}" in readme, name
        if key:
            assert f"--from-literal={key}=" in readme, key
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert f"--from-literal={key}=" in readme


def test_redis_needs_a_password_and_only_gateways_reach_it_or_the_ops_port() -> None:
    ids = _by_id(_base_resources())
    redis = ids[("Deployment", "redis")]["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    redis_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["env"]}
    assert (
        redis_env["REDIS_PASSWORD"]
        == redis_env["REDISCLI_AUTH"]
        == {"name": "skewserve-redis", "key": "password"}
    )
    gateway = ids[("Deployment", "skewserve-gateway")]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in gateway["containers"][0]["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "skewserve-redis",
        "key": "password",
    }
    # $(VAR) expands only a variable defined earlier in the list.
    names = [e["name"] for e in gateway["containers"][0]["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("SKEWSERVE_GATEWAY_CACHE__REDIS_URL")
    assert env["SKEWSERVE_GATEWAY_CACHE__REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@redis.")
    policy = ids[("NetworkPolicy", "redis-from-gateways")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app": "redis"}
    assert policy["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": {"app": "skewserve-gateway"}}}],
            "ports": [{"port": 6379, "protocol": "TCP"}],
        }
    ]
    ingress = ids[("NetworkPolicy", "skewserve-gateway-ingress")]["spec"]["ingress"]
    open_ports = {p["port"] for rule in ingress if "from" not in rule for p in rule["ports"]}
    scraped = [rule for rule in ingress if "from" in rule]
    assert open_ports == {8080, 8081}  # the public ports; the ops port only from scrapers
    assert [p["port"] for rule in scraped for p in rule["ports"]] == [8082]
    assert scraped[0]["from"][0]["podSelector"]["matchLabels"] == {"skewserve.io/scraper": "true"}


def test_the_gateway_serves_tls_from_the_certificate_secret() -> None:
    ids = _by_id(_base_resources())
    spec = ids[("Deployment", "skewserve-gateway")]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
    volume = next(v for v in spec["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "skewserve-gateway-tls"
    assert env["SKEWSERVE_GATEWAY_LISTEN__TLS__CERT_FILE"] == f"{mount['mountPath']}/tls.crt"
    assert env["SKEWSERVE_GATEWAY_LISTEN__TLS__KEY_FILE"] == f"{mount['mountPath']}/tls.key"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    service = ids[("Service", "skewserve-gateway")]["spec"]
    assert service["externalTrafficPolicy"] == "Local"  # per-source bounds see clients, not nodes
    assert {p["name"] for p in service["ports"]} == {"http", "grpc"}  # never the ops port
    assert "create secret tls skewserve-gateway-tls" in (ROOT / "README.md").read_text()


def test_pod_monitors_give_the_job_labels_the_alerts_and_compose_use() -> None:
    """Each PodMonitor names its job from the pods' `app` label, selects pods that exist and scrapes
    a port they declare; those jobs are the ones the alert rules and compose's scrape config name."""
    docs = _base_resources()
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    jobs = set()
    for monitor in (d for d in docs if d["kind"] == "PodMonitor"):
        spec = monitor["spec"]
        assert spec["jobLabel"] == "app"
        wanted = spec["selector"]["matchLabels"]
        (pods,) = [
            w for w in workloads if wanted.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        ports = {
            p["name"] for c in pods["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
        }
        for endpoint in spec["podMetricsEndpoints"]:
            assert endpoint["port"] in ports, (monitor["metadata"]["name"], endpoint)
        jobs.add(pods["spec"]["template"]["metadata"]["labels"]["app"])
    assert jobs == {"triton", "skewserve-gateway"}
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in compose["scrape_configs"]} == jobs
    import re

    rules = (ROOT / "deploy" / "prometheus" / "rules.yml").read_text()
    for pattern in re.findall(r'job=~"([^"]+)"', rules):
        assert any(re.fullmatch(pattern, job) for job in jobs), (
            f"alert selector job=~{pattern!r} matches no job"
        )


def test_triton_copies_models_from_the_bucket_onto_a_sized_volume() -> None:
    (triton,) = [d for d in _base_resources() if d["kind"] == "StatefulSet"]
    pod = triton["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = mounts[env["TRITON_AWS_MOUNT_DIRECTORY"]]
    (spec,) = [v for v in pod["volumes"] if v["name"] == volume]
    assert spec["emptyDir"]["sizeLimit"]


@pytest.mark.parametrize("region", REGIONS)
def test_the_controller_reads_its_regions_servers_without_the_gateways_secrets(region: str) -> None:
    from controller.fleet import fleet_config

    fleet = fleet_config(K8S / "overlays" / region / "gateway.yaml")  # no secret in the environment
    local = next(r for r in fleet.regions if r.name == region)
    assert local.discover is not None and local.discover.endpointslices is not None
