"""Kubernetes manifests (deploy/k8s: kustomize base + one overlay per region), validated against the
Kubernetes schema with kubernetes-validate, rendered with `kubectl kustomize` where kubectl exists.
The generic policy rules (security, resources, budgets, images) are in test_policy.py; these are the
project's own contracts between manifests, configs and commands."""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from exporter.target import TARGET
from gateway.config import ConfigError, load_gateway_config
from repository.s3 import ObjectRepository

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


def _pod(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = _by_id(docs)[(kind, name)]["spec"]["template"]["spec"]
    return spec


def _render(region: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: rendering skipped; the file-level tests still ran")
    res = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / region)], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


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
    # started = serves what the controller wants on it (tests/controller/test_server_readiness.py),
    # or with no controller answering, a model (or the repository holds none): test_triton_pod.py
    assert startup["exec"]["command"] == ["python3", "/etc/skewserve/probe/triton-startup-probe.py"]
    env = {e["name"]: e for e in container["env"]}
    assert env["SKEWSERVE_SERVER"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["SKEWSERVE_CONTROLLER_URL"]["value"] == "http://skewserve-controller:8090"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # load + warm-up budget
    assert startup["timeoutSeconds"] >= 5  # an interpreter's start plus two calls, on a busy node
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert "--model-repository=$(MODEL_REPOSITORY)" in container["args"]
    # Nothing baked in or mounted but scratch: the model copies, /tmp (the root filesystem is
    # read-only) and the Python backend's shared memory; the repository itself is object storage,
    # reached with the pod's own identity, never a key from a Secret.
    assert {m["mountPath"]: m["name"] for m in container["volumeMounts"]} == {
        "/var/lib/triton-models": "triton-models",
        "/tmp": "tmp",
        "/dev/shm": "dshm",
        "/etc/skewserve/probe": "probe",
        "/var/run/skewserve/controller-token": "controller-token",
    }
    assert "envFrom" not in container
    generators = {g["name"]: g for g in _kustomization(K8S / "base")["configMapGenerator"]}
    literals = dict(lit.split("=", 1) for lit in generators["skewserve-triton"]["literals"])
    assert ObjectRepository.parse(literals["MODEL_REPOSITORY"]).url == "s3://skewserve-models/prod"
    images = {i["name"]: i for i in _kustomization(K8S / "base")["images"]}
    assert f"{images['tritonserver']['newName']}:{images['tritonserver']['newTag']}" == TARGET.image
    assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", i["digest"]) for i in images.values())


def test_triton_starts_empty_and_the_controller_alone_holds_the_model_control_key() -> None:
    resources = _by_id(_base_resources())
    triton = resources[("StatefulSet", "triton")]["spec"]["template"]["spec"]["containers"][0]
    args = triton["args"]
    assert not any(a.startswith("--load-model") for a in args) and "--strict-readiness=false" in args
    # the repository, shared-memory, trace and logging APIs answer the controller's key only
    control = "model-repository,shared-memory,trace,logging:skewserve-control=$(SKEWSERVE_CONTROL_KEY)"
    assert f"--http-restricted-api={control}" in args
    assert f"--grpc-restricted-protocol={control}" in args
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
    spillover = resources[("Deployment", "skewserve-spillover")]["spec"]["template"]["spec"]
    assert "skewserve-control" not in str(spillover)


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
    assert budgets == {
        "triton": pods["triton"],
        "skewserve-gateway": pods["skewserve-gateway"],
        "skewserve-spillover": pods["skewserve-spillover"],
    }
    # no budget for the two that say why (tests/deploy/policy.py reads the reason)
    exempt = {
        d["metadata"]["name"]
        for d in docs
        if "pdb-per-workload:" in d["metadata"].get("annotations", {}).get("skewserve.io/policy-exempt", "")
    }
    assert exempt == {"skewserve-controller", "redis"}


@pytest.mark.parametrize("region", REGIONS)
def test_overlay_patches_and_replaces_existing_resources_by_name(region: str) -> None:
    base = _by_id(_base_resources())
    overlay = K8S / "overlays" / region
    kust = _kustomization(overlay)
    assert kust["resources"] == ["../../base"]
    base_generators = {g["name"] for g in _kustomization(K8S / "base")["configMapGenerator"]}
    for gen in kust["configMapGenerator"]:
        assert gen["behavior"] == "replace" and gen["name"] in base_generators, gen
    for inline in (p for p in kust["patches"] if "target" in p):
        target = inline["target"]
        assert (target["kind"], target["name"]) in base, f"{region}: inline patch targets nothing"
    for patch_file in (p for p in kust["patches"] if "path" in p):
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
    region: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    overlay = K8S / "overlays" / region
    config = overlay / "gateway.yaml"
    peer = next(r for r in REGIONS if r != region)
    env = {
        p["metadata"]["name"]: {
            e["name"]: e["value"] for e in p["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        for p in _docs(overlay / "region.yaml")
        if p["kind"] == "Deployment"
    }
    # the gateway's home region, the controller reconciling that region's pods only (the other
    # region's pods are that region's controller's), and the peer this region spills over to
    assert env == {
        "skewserve-gateway": {"SKEWSERVE_GATEWAY_HOME_REGION": region},
        "skewserve-controller": {"SKEWSERVE_CONTROLLER_REGIONS": region},
        "skewserve-spillover": {"SPILLOVER_PEER_HOST": f"spillover.{peer}.skewserve.internal"},
    }
    monkeypatch.setenv("SKEWSERVE_GATEWAY_HOME_REGION", region)
    with pytest.raises(ConfigError, match=r"cache\.hmac_secret must be set"):
        load_gateway_config(config)  # no secret in the file: the Secret is required
    for k, v in SECRET_ENV.items():
        monkeypatch.setenv(k, v)
    cfg = load_gateway_config(config)
    assert cfg.home_region == region and sorted(r.name for r in cfg.regions) == REGIONS
    egress = {
        p["name"]: p["port"]
        for d in _base_resources()
        if (d["kind"], d["metadata"]["name"]) == ("Service", "skewserve-spillover-egress")
        for p in d["spec"]["ports"]
    }
    for r in cfg.regions:
        if r.name == region:  # local pods discovered from the Triton Service's EndpointSlices
            assert not r.servers and r.discover is not None and r.discover.endpointslices is not None
            assert r.discover.endpointslices.service == "triton"
            assert r.discover.endpointslices.namespace is None  # the pod's own: where the Role grants
        else:  # the peer region, through this region's spill-over proxy: never the peer's Triton
            host = "skewserve-spillover-egress.skewserve.svc.cluster.local"
            assert [(s.http, s.grpc) for s in r.servers] == [
                (f"{host}:{egress['http']}", f"{host}:{egress['grpc']}")
            ]
    # this region's internal load balancer, under the name the peer's proxy dials
    spill = _by_id(_docs(overlay / "region.yaml"))[("Service", "skewserve-spillover")]
    assert spill["metadata"]["annotations"] == {
        "external-dns.alpha.kubernetes.io/hostname": f"spillover.{region}.skewserve.internal"
    }


def test_the_two_regions_dial_each_others_spillover_names() -> None:
    """Each region's SPILLOVER_PEER_HOST is the name the other region publishes (external-dns)."""
    published, dialled = {}, {}
    for region in REGIONS:
        ids = _by_id(_docs(K8S / "overlays" / region / "region.yaml"))
        svc = ids[("Service", "skewserve-spillover")]["metadata"]["annotations"]
        published[region] = svc["external-dns.alpha.kubernetes.io/hostname"]
        proxy = ids[("Deployment", "skewserve-spillover")]["spec"]["template"]["spec"]["containers"][0]
        dialled[region] = proxy["env"][0]["value"]
    assert len(REGIONS) == 2  # one peer per region: spillover-haproxy.cfg has one peer backend pair
    for region in REGIONS:
        (peer,) = [r for r in REGIONS if r != region]
        assert dialled[region] == published[peer]


@pytest.mark.parametrize("region", REGIONS)
def test_the_gateway_reaches_its_controller_with_the_mounted_token(region: str) -> None:
    """traffic.controller_url names the controller Service's port; traffic.token_file lies in the
    mount of the Secret skewserve-gateway-controller-token (key `token`); no cold_start, because
    no placement is configured for the controller."""
    data = yaml.safe_load((K8S / "overlays" / region / "gateway.yaml").read_text())
    assert "cold_start" not in data
    assert "--placement" not in str(_by_id(_base_resources())[("Deployment", "skewserve-controller")])
    ids = _by_id(_base_resources())
    service = ids[("Service", "skewserve-controller")]["spec"]
    (port,) = service["ports"]
    assert data["traffic"]["controller_url"] == f"http://skewserve-controller:{port['port']}"
    pod = _pod(_base_resources(), "Deployment", "skewserve-gateway")
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == "controller-token")
    assert volume["secret"]["secretName"] == "skewserve-gateway-controller-token"
    assert data["traffic"]["token_file"] == f"{mounts['controller-token']}/token"


@pytest.mark.parametrize("region", REGIONS)
def test_rendered_overlay_is_valid_kubernetes(region: str) -> None:
    docs = _render(region)
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
    assert re.fullmatch(re.escape(TARGET.image) + r"@sha256:[0-9a-f]{64}", triton["image"]), triton["image"]
    controller = ids[("Deployment", "skewserve-controller")]["spec"]["template"]["spec"]
    fleet = ids[("ConfigMap", controller["volumes"][0]["configMap"]["name"])]["data"]["fleet.yaml"]
    assert fleet == (K8S / "overlays" / region / "controller-fleet.yaml").read_text()
    proxy = ids[("Deployment", "skewserve-spillover")]["spec"]["template"]["spec"]
    haproxy = ids[("ConfigMap", proxy["volumes"][0]["configMap"]["name"])]["data"]["haproxy.cfg"]
    assert haproxy == (K8S / "base" / "spillover-haproxy.cfg").read_text()
    # the load balancer takes the peer's network only, which is also all the proxy may dial
    (peer_cidr,) = ids[("Service", "skewserve-spillover")]["spec"]["loadBalancerSourceRanges"]
    egress = ids[("NetworkPolicy", "skewserve-spillover")]["spec"]["egress"]
    assert [rule["to"] for rule in egress if "ipBlock" in rule["to"][0]] == [
        [{"ipBlock": {"cidr": peer_cidr}}]
    ]
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


def _secret_refs(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(Secret, key) of every env reference, and (Secret, "") of every mounted Secret."""
    refs: set[tuple[str, str]] = set()
    for doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            refs |= {
                (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                for e in c.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            }
            refs |= {(s["secretRef"]["name"], "") for s in c.get("envFrom", []) if "secretRef" in s}
        refs |= {(v["secret"]["secretName"], "") for v in spec.get("volumes", []) if "secret" in v}
    return refs


def test_the_deploy_readme_creates_every_secret_the_manifests_reference() -> None:
    """deploy/README.md's per-region commands create each Secret with the keys the pods read, and no
    bucket key: the pods reach the bucket by workload identity."""
    guide = (ROOT / "deploy" / "README.md").read_text()
    refs = _secret_refs(_base_resources())
    assert {name for name, _ in refs} == {
        "skewserve-gateway",
        "skewserve-control",
        "skewserve-redis",
        "skewserve-gateway-tls",
        "skewserve-gateway-controller-token",
        "skewserve-triton-controller-token",
        "skewserve-controller-tokens",
        "skewserve-spillover-tls",
    }
    for name, key in refs:
        assert re.search(rf"create secret (generic|tls) {name}\b", guide), name
        if key:
            assert f"--from-literal={key}=" in guide, key
    # the gateway's token (key `token`) and the controller's directory of them (a key per caller)
    assert "create secret generic skewserve-gateway-controller-token --from-literal=token=" in guide
    assert "--from-literal=gateway-us-east=" in guide
    # the Triton pods' startup probe asks the controller as the caller `triton`
    assert "create secret generic skewserve-triton-controller-token --from-literal=token=" in guide
    assert "--from-literal=triton=" in guide
    for forbidden in ("AWS_SECRET_ACCESS_KEY", "skewserve-model-store"):
        assert forbidden not in guide, forbidden


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
    policy = ids[("NetworkPolicy", "redis")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app": "redis"}
    assert policy["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": {"app": "skewserve-gateway"}}}],
            "ports": [{"port": 6379, "protocol": "TCP"}],
        }
    ]
    ingress = ids[("NetworkPolicy", "skewserve-gateway")]["spec"]["ingress"]
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
    assert "create secret tls skewserve-gateway-tls" in (ROOT / "deploy" / "README.md").read_text()


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
    assert jobs == {"triton", "skewserve-gateway", "skewserve-controller", "skewserve-spillover"}
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus.yml").read_text())
    # compose runs no controller API and no second region
    assert {j["job_name"] for j in compose["scrape_configs"]} == {"triton", "skewserve-gateway"}
    rules = "".join(p.read_text() for p in (ROOT / "deploy" / "prometheus").glob("*rules.yml"))
    for pattern in re.findall(r'job=~?"([^"]+)"', rules):
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
def test_the_controller_reads_every_pod_of_its_region_started_or_not(region: str) -> None:
    """Its fleet is the `triton-control` Service, which lists pods before their startupProbe passes
    (they need the controller's loads to pass it); the gateways' `triton` Service lists ready ones."""
    from controller.fleet import fleet_config

    fleet = fleet_config(K8S / "overlays" / region / "controller-fleet.yaml")
    (local,) = fleet.regions
    assert local.name == region and local.discover is not None and local.discover.endpointslices is not None
    ids = _by_id(_base_resources())
    control = ids[("Service", local.discover.endpointslices.service)]["spec"]
    gateways = ids[("Service", "triton")]["spec"]
    assert control["publishNotReadyAddresses"] is True and gateways["publishNotReadyAddresses"] is False
    assert control["selector"] == gateways["selector"] == {"app": "triton"}
    # the EndpointSlice port names discovery reads (discover.endpointslices.*_port_name)
    assert {p["name"] for p in control["ports"]} >= {"http", "grpc"}


def test_the_controller_runs_two_replicas_and_only_the_leader_serves() -> None:
    """The interface the controller is built to: --listen, --tokens-dir, --leader-election; /healthz
    for liveness, /readyz (leader) for readiness, so the Service sends gateways to the leader."""
    ids = _by_id(_base_resources())
    deployment = ids[("Deployment", "skewserve-controller")]
    spec = deployment["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    # the follower never turns ready while the leader lives: a rollout may take both old replicas
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == spec["replicas"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert "--listen=0.0.0.0:8090" in args and "--leader-election" in args
    assert "--leader-lease-in=kubernetes" in args  # a Lease object (tests/controller/test_kube_lease.py)
    tokens = next(a.split("=", 1)[1] for a in args if a.startswith("--tokens-dir="))
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[tokens])
    assert volume["secret"]["secretName"] == "skewserve-controller-tokens"
    (port,) = container["ports"]
    assert port == {"name": "api", "containerPort": 8090}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "api"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "api"}
    (service_port,) = ids[("Service", "skewserve-controller")]["spec"]["ports"]
    assert (service_port["port"], service_port["targetPort"]) == (8090, "api")
    monitor = ids[("PodMonitor", "skewserve-controller")]["spec"]["podMetricsEndpoints"]
    assert monitor == [{"port": "api", "path": "/metrics", "interval": "15s"}]
    # its own account: EndpointSlices read, as the gateway's, its Lease, and nothing else
    assert pod["serviceAccountName"] == "skewserve-controller"
    binding = ids[("RoleBinding", "skewserve-controller-discovery")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "skewserve-controller", "namespace": "skewserve"}
    ]
    role = ids[("Role", binding["roleRef"]["name"])]
    lease = {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update"],
    }
    assert role["rules"] == [*ids[("Role", "skewserve-gateway-discovery")]["rules"], lease]


def _allowed_from(policies: list[dict[str, Any]], target: dict[str, str]) -> set[tuple[str, int]]:
    """(caller, port) pairs the NetworkPolicies admit into pods labelled `target`; a caller is its
    `app` label, "scraper", or "anywhere"."""
    from tests.deploy.policy import selects

    out: set[tuple[str, int]] = set()
    for p in policies:
        if not p["spec"]["podSelector"] or not selects(p["spec"]["podSelector"], target):
            continue
        for rule in p["spec"].get("ingress", []):
            callers = [
                "scraper"
                if "skewserve.io/scraper" in f.get("podSelector", {}).get("matchLabels", {})
                else f["podSelector"]["matchLabels"]["app"]
                for f in rule.get("from", [])
            ] or ["anywhere"]
            out |= {(c, port["port"]) for c in callers for port in rule["ports"]}
    return out


def test_triton_is_reachable_only_from_the_gateways_controller_spillover_proxy_and_scrapers() -> None:
    docs = _base_resources()
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    deny = _by_id(docs)[("NetworkPolicy", "default-deny")]["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    assert _allowed_from(policies, {"app": "triton"}) == {
        ("skewserve-gateway", 8000),
        ("skewserve-gateway", 8001),
        ("skewserve-spillover", 8000),
        ("skewserve-spillover", 8001),
        ("skewserve-controller", 8000),
        ("scraper", 8002),
    }
    assert _allowed_from(policies, {"app": "skewserve-controller"}) == {
        ("skewserve-gateway", 8090),
        ("triton", 8090),  # the Triton pods' startup probe: /v1/servers/ready
        ("scraper", 8090),
    }
    # the other regions arrive only on the mutual-TLS ports; the plain ones are this region's gateways'
    assert _allowed_from(policies, {"app": "skewserve-spillover"}) == {
        ("anywhere", 8443),
        ("anywhere", 8444),
        ("skewserve-gateway", 8000),
        ("skewserve-gateway", 8001),
        ("scraper", 8404),
    }
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    exposed = {n: s for n, s in services.items() if s.get("type") == "LoadBalancer"}
    assert set(exposed) == {"skewserve-gateway", "skewserve-spillover"}
    assert {p["port"] for p in exposed["skewserve-spillover"]["ports"]} == {8443, 8444}


@pytest.mark.parametrize("region", REGIONS)
def test_termination_grace_covers_prestop_and_each_drain(region: str, tmp_path: Path) -> None:
    """Gateway: preStop, then drain.grace_s not-ready, then up to drain.timeout_s for in-flight
    requests, all inside the grace period. Triton: preStop, then --exit-timeout-secs."""
    from tests.deploy.policy import _prestop_seconds

    docs = _base_resources()
    cfg = yaml.safe_load((K8S / "overlays" / region / "gateway.yaml").read_text())
    gateway = _pod(docs, "Deployment", "skewserve-gateway")
    need = _prestop_seconds(gateway["containers"][0]) + cfg["drain"]["grace_s"] + cfg["drain"]["timeout_s"]
    assert gateway["terminationGracePeriodSeconds"] > need
    triton = _pod(docs, "StatefulSet", "triton")
    exit_timeout = next(
        int(a.split("=")[1]) for a in triton["containers"][0]["args"] if a.startswith("--exit-timeout-secs=")
    )
    assert triton["terminationGracePeriodSeconds"] > _prestop_seconds(triton["containers"][0]) + exit_timeout


def test_triton_shared_memory_fits_the_python_backend_as_on_one_host() -> None:
    """The same /dev/shm as compose's shm_size (1 GB), inside the memory limit it is charged to."""
    from tests.deploy.policy import quantity

    pod = _pod(_base_resources(), "StatefulSet", "triton")
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory" and quantity(dshm["emptyDir"]["sizeLimit"]) >= 10**9
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    assert compose["services"]["triton"]["shm_size"] == "1gb"


def _documented_rollouts() -> list[tuple[str, list[str]]]:
    """Every in-cluster `skewserve rollout` the deploy guides show: (file, its arguments after `skewserve`)."""
    import shlex

    found = []
    for doc in (ROOT / "docs" / "deploy.md", ROOT / "deploy" / "README.md"):
        text = doc.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            if "exec deploy/skewserve-controller -- skewserve rollout" in line:
                words = shlex.split(line.split("#", 1)[0])
                found.append((str(doc.relative_to(ROOT)), words[words.index("--") + 2 :]))
    return found


def test_the_in_cluster_rollout_is_documented_as_the_servers_run() -> None:
    """The command parses against the real CLI (nothing runs) and matches the manifests: plans built
    version-compatible accepted, a load given the pods' start-up budget, the controller's own fleet
    file and the repository the pods read."""
    import typer

    from skewserve.commands.main import app

    documented = _documented_rollouts()
    assert {name for name, _ in documented} == {"docs/deploy.md", "deploy/README.md"}
    cli = typer.main.get_command(app)
    docs = _base_resources()
    triton = _pod(docs, "StatefulSet", "triton")["containers"][0]
    controller = _pod(docs, "Deployment", "skewserve-controller")["containers"][0]
    startup = triton["startupProbe"]["periodSeconds"] * triton["startupProbe"]["failureThreshold"]
    config = next(a.split("=", 1)[1] for a in controller["args"] if a.startswith("--config="))
    literals = dict(
        lit.split("=", 1)
        for g in _kustomization(K8S / "base")["configMapGenerator"]
        for lit in g.get("literals", [])
    )
    for name, args in documented:
        rollout = cli.get_command(cli.make_context("skewserve", [args[0]], resilient_parsing=True), args[0])
        assert rollout is not None and args[0] == "rollout"
        params = rollout.make_context("rollout", args[1:]).params  # an unknown flag raises here
        assert "--backend-config=tensorrt,version-compatible=true" in triton["args"]
        assert params["version_compatible"] is True, name
        assert params["load_timeout"] == startup, name
        assert str(params["config"]) == config and params["regions"] in REGIONS, name
        assert params["repo"] == literals["MODEL_REPOSITORY"], name
        # the canary record must wait for every region, as the controllers do (the fleet file names
        # one region, which would otherwise be the default)
        assert f"--canary-regions={params['canary_regions']}" in controller["args"], name
