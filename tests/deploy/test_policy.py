"""The policy checker (tests/deploy/policy.py): each rule fails its own fixture and nothing else, the
pre-issue-38 manifests fail a rule per finding, and today's manifests (base, every component, every
overlay rendered by `kubectl kustomize`) pass."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import policy

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
FIXTURES = Path(__file__).parent / "policy_fixtures"
CASES = sorted(p for p in FIXTURES.glob("*.yaml") if p.stem not in ("good", "before-issue-38"))
REGIONS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
CLOUDS = ["aws", "azure", "gcp"]  # deploy/k8s/components/<cloud>; s3-web-identity is a part of two


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def _apply(docs: list[dict[str, Any]], op: dict[str, Any]) -> None:
    """One step of a fixture: append or delete an object, or add / replace / remove inside one
    (JSON Pointer paths, RFC 6901)."""
    if op["op"] == "append":
        docs.append(op["value"])
        return
    (index,) = [i for i, d in enumerate(docs) if policy.name(d) == op["target"]]
    if op["op"] == "delete":
        del docs[index]
        return
    *parents, last = _pointer(op["path"])
    node: Any = docs[index]
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) and last != "-" else last
    if op["op"] == "remove":
        del node[key]
    elif op["op"] == "add" and isinstance(node, list):
        node.append(op["value"]) if key == "-" else node.insert(key, op["value"])
    elif op["op"] in ("add", "replace"):
        node[key] = op["value"]
    else:
        raise ValueError(f"unknown fixture op {op['op']!r}")


def _rules(violations: list[policy.Violation]) -> set[str]:
    return {v.rule for v in violations}


def test_the_good_fixture_passes_every_rule_release_included() -> None:
    assert policy.check(_load(FIXTURES / "good.yaml"), release=True) == []


def test_every_rule_has_a_fixture() -> None:
    cases = {yaml.safe_load(p.read_text())["rule"] for p in CASES}
    assert cases == set(policy.RULES) | set(policy.RELEASE_RULES)


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_each_fixture_fails_its_rule_and_no_other(case: Path) -> None:
    spec = yaml.safe_load(case.read_text())
    docs = copy.deepcopy(_load(FIXTURES / "good.yaml"))
    for op in spec["patch"]:
        _apply(docs, op)
    violations = policy.check(docs, release=spec.get("release", False))
    assert _rules(violations) == {spec["rule"]}, [str(v) for v in violations]
    if spec.get("release"):  # a placeholder is only refused before release
        assert policy.check(docs) == []


def test_an_exemption_needs_the_rule_and_a_reason() -> None:
    docs = _load(FIXTURES / "good.yaml")
    (budget,) = [d for d in docs if policy.name(d) == "PodDisruptionBudget/web"]
    docs.remove(budget)
    web = next(d for d in docs if policy.name(d) == "Deployment/web")
    web["metadata"]["annotations"] = {policy.EXEMPT: "pdb-per-workload:"}
    assert _rules(policy.check(docs)) == {"pdb-per-workload"}  # no reason: not exempt
    web["metadata"]["annotations"] = {policy.EXEMPT: "topology-spread: other rule; pdb-per-workload: a cache"}
    assert policy.check(docs) == []


# Each finding of issue 38's review, and the rule that fails on the manifests it was made against.
FINDINGS = {
    "no NetworkPolicy covers the Triton pods": ("network-policy-per-workload", "StatefulSet/triton"),
    "no namespace-wide default deny": ("network-default-deny", "Namespace/skewserve"),
    "the spill-over load balancer exposes Triton across regions": (
        "triton-not-exposed",
        "Service/triton-spillover",
    ),
    "the spill-over load balancer is public on GKE and AKS": (
        "internal-load-balancer",
        "Service/triton-spillover",
    ),
    "shared memory, trace and logging open": ("triton-restricted-apis", "StatefulSet/triton"),
    "Triton runs as root": ("non-root", "StatefulSet/triton"),
    "one static AWS key Secret for Triton and the controller": ("no-static-cloud-keys", "StatefulSet/triton"),
    "the controller reuses the gateway's service account": (
        "dedicated-service-account",
        "Deployment/skewserve-controller",
    ),
    "Triton pods are Burstable": ("gpu-guaranteed", "StatefulSet/triton"),
    "no ephemeral-storage request for the 50Gi emptyDir": ("ephemeral-storage", "StatefulSet/triton"),
    "no larger /dev/shm for the Python backend": ("triton-shm", "StatefulSet/triton"),
    "no preStop delay before drain": ("prestop-grace", "StatefulSet/triton"),
    "no topology spread across zones": ("topology-spread", "StatefulSet/triton"),
    "image tags not pinned by digest": ("image-digest", "StatefulSet/triton"),
    "Triton's root filesystem writable": ("read-only-root-filesystem", "StatefulSet/triton"),
    "the gateway's TLS Secret unreadable to its non-root user": (
        "secret-volume-readable",
        "Deployment/skewserve-gateway",
    ),
}


def test_every_finding_fails_a_rule_on_the_manifests_before_the_fix() -> None:
    found = {(v.rule, v.object) for v in policy.check(_load(FIXTURES / "before-issue-38.yaml"))}
    missed = {finding: hit for finding, hit in FINDINGS.items() if hit not in found}
    assert not missed, missed


def test_base_and_components_pass_without_rendering() -> None:
    """What holds file by file, where no kubectl renders the overlays: the base's objects as written
    (images are still kustomize names here, so digests are checked on the rendered overlays)."""
    kust = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    docs = [d for f in kust["resources"] for d in _load(K8S / "base" / f)]
    for d in docs:
        d.setdefault("metadata", {}).setdefault("namespace", kust["namespace"])
    violations = policy.check(docs, skip=frozenset({"image-digest"}))
    assert violations == [], [str(v) for v in violations]


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: rendering skipped; the file-level checks above still ran")
    return kubectl


@pytest.mark.parametrize("region", REGIONS)
def test_every_overlay_passes_every_rule(region: str) -> None:
    _kubectl()
    violations = policy.check(policy.render(K8S / "overlays" / region))
    assert violations == [], [str(v) for v in violations]


@pytest.mark.parametrize("cloud", CLOUDS)
def test_the_base_with_each_clouds_component_passes(cloud: str, tmp_path: Path) -> None:
    """An overlay on each cloud: the same workloads, that cloud's identity and load balancer."""
    _kubectl()
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [f"{rel}/base"], "components": [f"{rel}/components/{cloud}"]})
    )
    docs = policy.render(tmp_path)
    from tests.deploy.test_kubernetes import _validate

    for doc in docs:  # the Kubernetes 1.32 schema, strict, as for the overlays
        _validate(doc)
    violations = policy.check(docs)
    assert violations == [], [str(v) for v in violations]
    # no cloud leaves a bucket key in the pods: each reaches the bucket by workload identity
    # and Triton's role only reads it; the controller, on its own account, writes
    roles = {workload: _bucket_role(docs, workload, account) for workload, account in ROLE_OWNERS.items()}
    assert roles["StatefulSet/triton"].endswith("-read"), roles
    assert roles["Deployment/skewserve-controller"].endswith("-write"), roles


ROLE_OWNERS = {
    "StatefulSet/triton": "ServiceAccount/skewserve-triton",
    "Deployment/skewserve-controller": "ServiceAccount/skewserve-controller",
}


def _bucket_role(docs: list[dict[str, Any]], workload: str, account: str) -> str:
    """The IAM role a workload reaches the bucket as: its pods' AWS_ROLE_ARN, else its service
    account's IRSA annotation (where EKS's webhook sets that variable)."""
    pod = next(d for d in docs if policy.name(d) == workload)
    env = {e["name"]: e.get("value", "") for c in policy.containers(pod) for e in c.get("env", [])}
    annotations = next(d for d in docs if policy.name(d) == account)["metadata"].get("annotations", {})
    role = env.get("AWS_ROLE_ARN") or annotations.get("eks.amazonaws.com/role-arn")
    assert role, f"{workload} has no bucket role (AWS_ROLE_ARN or the IRSA annotation on {account})"
    return str(role)


@pytest.mark.parametrize("region", REGIONS)
def test_release_mode_refuses_the_placeholders_the_repository_ships(region: str) -> None:
    """Until `make images` writes digests and someone sets the account, deploy-check fails, naming them."""
    _kubectl()
    res = subprocess.run(
        [sys.executable, "-m", "tests.deploy.policy", "--release", str(K8S / "overlays" / region)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    refused = {line.split(": ")[2] for line in res.stdout.splitlines() if ": release-placeholders: " in line}
    assert {
        "StatefulSet/triton",
        "ServiceAccount/skewserve-triton",
        "Deployment/skewserve-gateway",
    } <= refused
    assert "release-placeholders" not in {
        v.rule for v in policy.check(policy.render(K8S / "overlays" / region))
    }


def test_the_checker_reads_stdin_and_exits_nonzero_on_a_violation() -> None:
    text = (FIXTURES / "before-issue-38.yaml").read_text()
    res = subprocess.run(
        [sys.executable, "-m", "tests.deploy.policy", "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 1 and "-: triton-restricted-apis: StatefulSet/triton: " in res.stdout
    good = (FIXTURES / "good.yaml").read_text()
    res = subprocess.run(
        [sys.executable, "-m", "tests.deploy.policy", "-"],
        input=good,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 0 and res.stdout == f"-: {len(policy.RULES)} rules pass\n", res.stdout
