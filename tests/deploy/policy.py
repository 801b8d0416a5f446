"""Policy checks over rendered Kubernetes objects: what a cluster's admission policy would refuse
(Pod Security "restricted", resources, disruption budgets, network isolation, images by digest), and
this project's own rules (Triton's control APIs closed, Triton never behind an outside load
balancer, internal load balancers internal on every cloud).

    kubectl kustomize deploy/k8s/overlays/us-east | python -m tests.deploy.policy -
    python -m tests.deploy.policy --release deploy/k8s/overlays/us-east   # before `kubectl apply`

An object skips a rule only by naming it, with a reason, in its `skewserve.io/policy-exempt`
annotation ("rule: reason; rule: reason"). `--release` also refuses what is only a placeholder
until someone fills it in (digests of zeros, ACCOUNT_ID, set-by-overlay). Every rule has a fixture
that breaks it alone (tests/deploy/policy_fixtures/, tests/deploy/test_policy.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
EXEMPT = "skewserve.io/policy-exempt"
PUBLIC = "skewserve.io/public"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob", "Pod"}
LONG_RUNNING = {"Deployment", "StatefulSet", "DaemonSet"}
ZONE = "topology.kubernetes.io/zone"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
# Triton 24.10's protocol names that are control, not serving (docs: "Limit Endpoint Access").
TRITON_CONTROL_APIS = {"model-repository", "shared-memory", "trace", "logging"}
# Each cloud's own annotation for an internal load balancer; a Service carries all of them so that
# no cloud it is applied on makes it public.
INTERNAL_LB = {
    "AWS": [
        {"service.beta.kubernetes.io/aws-load-balancer-scheme": "internal"},
        {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"},
    ],
    "GCP": [{"networking.gke.io/load-balancer-type": "Internal"}],
    "Azure": [{"service.beta.kubernetes.io/azure-load-balancer-internal": "true"}],
}
STATIC_KEYS = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_APPLICATION_CREDENTIALS",
}
PLACEHOLDERS = ("sha256:" + "0" * 64, "ACCOUNT_ID", "set-by-overlay")


@dataclass(frozen=True)
class Violation:
    rule: str
    object: str
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.object}: {self.message}"


def name(obj: Obj) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def namespace(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("namespace", "default"))


def pod_template(obj: Obj) -> Obj:
    """The pod's metadata and spec of a workload (a Pod is its own template)."""
    if obj["kind"] == "Pod":
        return obj
    if obj["kind"] == "CronJob":
        return dict(obj["spec"]["jobTemplate"]["spec"]["template"])
    return dict(obj["spec"]["template"])


def pod_spec(obj: Obj) -> Obj:
    return dict(pod_template(obj).get("spec", {}))


def pod_labels(obj: Obj) -> dict[str, str]:
    return dict(pod_template(obj).get("metadata", {}).get("labels", {}))


def containers(obj: Obj) -> list[Obj]:
    spec = pod_spec(obj)
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o.get("kind") in WORKLOADS]


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels / matchExpressions) against a label set; {} selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "m": Fraction(1, 1000),
}


def quantity(value: str | int | float) -> Fraction:
    """A Kubernetes quantity ("16Gi", "500m", 4) as an exact number."""
    text = str(value)
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    if match is None or match.group(2) not in {"", *_SUFFIX}:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    return Fraction(match.group(1)) * _SUFFIX.get(match.group(2), 1)


def exempt(obj: Obj, rule: str) -> bool:
    text = obj.get("metadata", {}).get("annotations", {}).get(EXEMPT, "")
    reasons = {k.strip(): v.strip() for k, v in (p.split(":", 1) for p in text.split(";") if ":" in p)}
    return bool(reasons.get(rule))


def _security(obj: Obj, container: Obj, key: str) -> Any:
    """A container's security setting, falling back to the pod's (as the kubelet does)."""
    own = (container.get("securityContext") or {}).get(key)
    return own if own is not None else (pod_spec(obj).get("securityContext") or {}).get(key)


def _replicas(obj: Obj, objs: list[Obj]) -> int:
    """Declared replicas, else the lowest count an autoscaler targeting it keeps, else 1."""
    if "replicas" in obj.get("spec", {}):
        return int(obj["spec"]["replicas"])
    for scaler in objs:
        ref = scaler.get("spec", {}).get("scaleTargetRef", {})
        if (ref.get("kind"), ref.get("name")) == (obj["kind"], obj["metadata"]["name"]):
            if scaler["kind"] == "HorizontalPodAutoscaler":
                return int(scaler["spec"].get("minReplicas", 1))
            if scaler["kind"] == "ScaledObject":
                return int(scaler["spec"].get("minReplicaCount", 1))
    return 1


# --- Pod Security "restricted" ----------------------------------------------------------------


def rule_non_root(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        for c in containers(obj):
            user = _security(obj, c, "runAsUser")
            if _security(obj, c, "runAsNonRoot") is not True or not isinstance(user, int) or user == 0:
                yield Violation(
                    "non-root",
                    name(obj),
                    f"container {c['name']}: set runAsNonRoot: true and a numeric runAsUser other "
                    f"than 0 (runAsUser is {user!r}; the kubelet can only verify a numeric user)",
                )


def rule_no_privilege_escalation(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        for c in containers(obj):
            sc = c.get("securityContext") or {}
            if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
                yield Violation(
                    "no-privilege-escalation",
                    name(obj),
                    f"container {c['name']}: set allowPrivilegeEscalation: false (and never privileged)",
                )


def rule_drop_all_capabilities(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        for c in containers(obj):
            caps = (c.get("securityContext") or {}).get("capabilities") or {}
            if "ALL" not in caps.get("drop", []) or caps.get("add"):
                yield Violation(
                    "drop-all-capabilities",
                    name(obj),
                    f"container {c['name']}: capabilities must drop [ALL] and add none "
                    f"(drop {caps.get('drop', [])}, add {caps.get('add', [])})",
                )


def rule_seccomp(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        for c in containers(obj):
            profile = _security(obj, c, "seccompProfile") or {}
            if profile.get("type") not in ("RuntimeDefault", "Localhost"):
                yield Violation(
                    "seccomp",
                    name(obj),
                    f"container {c['name']}: set seccompProfile: {{type: RuntimeDefault}} (pod or container)",
                )


def rule_no_host_access(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        spec = pod_spec(obj)
        shared = [k for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
        paths = [v["name"] for v in spec.get("volumes", []) if "hostPath" in v]
        ports = [p["hostPort"] for c in containers(obj) for p in c.get("ports", []) if p.get("hostPort")]
        if shared or paths or ports:
            yield Violation(
                "no-host-access",
                name(obj),
                f"host namespaces {shared}, hostPath volumes {paths}, hostPorts {ports}: use none",
            )


def rule_read_only_root_filesystem(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        if exempt(obj, "read-only-root-filesystem"):
            continue
        for c in containers(obj):
            if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True:
                yield Violation(
                    "read-only-root-filesystem",
                    name(obj),
                    f"container {c['name']}: set readOnlyRootFilesystem: true and mount an emptyDir "
                    "where it writes (/tmp)",
                )


# --- resources ------------------------------------------------------------------------------------


def rule_resources(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        for c in containers(obj):
            res = c.get("resources") or {}
            missing = [f"requests.{k}" for k in ("cpu", "memory") if k not in res.get("requests", {})]
            missing += ["limits.memory"] if "memory" not in res.get("limits", {}) else []
            if missing:
                yield Violation("resources", name(obj), f"container {c['name']}: set {', '.join(missing)}")


def rule_gpu_guaranteed(objs: list[Obj]) -> Iterator[Violation]:
    """A GPU pod is the costliest to lose: the kubelet evicts Guaranteed pods last."""
    for obj in workloads(objs):
        cs = containers(obj)
        gpus = [
            c for c in cs if any(k.endswith("/gpu") for k in (c.get("resources") or {}).get("limits", {}))
        ]
        if not gpus:
            continue
        for c in cs:
            res = c.get("resources") or {}
            req, lim = res.get("requests", {}), res.get("limits", {})
            unequal = [
                k
                for k in ("cpu", "memory")
                if k not in lim or quantity(req.get(k, lim[k])) != quantity(lim[k])
            ]
            if unequal:
                yield Violation(
                    "gpu-guaranteed",
                    name(obj),
                    f"container {c['name']} of a GPU pod: set requests equal to limits for "
                    f"{', '.join(unequal)} (Guaranteed QoS)",
                )


def rule_ephemeral_storage(objs: list[Obj]) -> Iterator[Violation]:
    """Scratch volumes on the node's disk are sized and requested, so the scheduler places the pod
    where they fit and the kubelet evicts the pod, not its neighbours, when one overflows."""
    for obj in workloads(objs):
        spec = pod_spec(obj)
        dirs = [v for v in spec.get("volumes", []) if "emptyDir" in v]
        unsized = [v["name"] for v in dirs if not (v["emptyDir"] or {}).get("sizeLimit")]
        if unsized:
            yield Violation("ephemeral-storage", name(obj), f"emptyDir {unsized}: set a sizeLimit")
            continue
        disk = sum(
            (quantity(v["emptyDir"]["sizeLimit"]) for v in dirs if v["emptyDir"].get("medium") != "Memory"),
            Fraction(0),
        )
        requested = sum(
            (
                quantity(c.get("resources", {}).get("requests", {}).get("ephemeral-storage", 0))
                for c in containers(obj)
            ),
            Fraction(0),
        )
        if disk > requested:
            yield Violation(
                "ephemeral-storage",
                name(obj),
                f"emptyDirs on disk may hold {float(disk) / 2**30:g}Gi but the containers request "
                f"{float(requested) / 2**30:g}Gi of ephemeral-storage: request at least their sizeLimits",
            )


def rule_shm_within_memory_limit(objs: list[Obj]) -> Iterator[Violation]:
    """tmpfs pages count against the memory limit of the container that writes them."""
    for obj in workloads(objs):
        memory = {
            v["name"]: quantity(v["emptyDir"].get("sizeLimit", 0))
            for v in pod_spec(obj).get("volumes", [])
            if "emptyDir" in v and (v["emptyDir"] or {}).get("medium") == "Memory"
        }
        for c in containers(obj):
            mounted = [m["name"] for m in c.get("volumeMounts", []) if m["name"] in memory]
            if not mounted:
                continue
            limit = (c.get("resources") or {}).get("limits", {}).get("memory")
            total = sum((memory[m] for m in mounted), Fraction(0))
            if not total or limit is None or total >= quantity(limit):
                yield Violation(
                    "shm-within-memory-limit",
                    name(obj),
                    f"container {c['name']}: memory-backed emptyDir {mounted} needs a sizeLimit below "
                    f"the container's memory limit ({limit})",
                )


# --- images ---------------------------------------------------------------------------------------


def rule_image_digest(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        for c in containers(obj):
            image = str(c.get("image", ""))
            last = image.split("@")[0].rsplit("/", 1)[-1]
            tag = last.split(":", 1)[1] if ":" in last else ""
            if tag == "latest" or not DIGEST.search(image):
                why = "`latest` names whatever was pushed last" if tag == "latest" else "a tag can move"
                yield Violation(
                    "image-digest",
                    name(obj),
                    f"container {c['name']}: image {image!r} is not pinned by digest ({why}): "
                    "NAME[:TAG]@sha256:<digest> (make images prints them)",
                )


# --- network ---------------------------------------------------------------------------------------


def _policies(objs: list[Obj], ns: str) -> list[Obj]:
    return [o for o in objs if o.get("kind") == "NetworkPolicy" and namespace(o) == ns]


def _selects_by_label(policy: Obj) -> bool:
    """True when the policy's podSelector names labels (it is not the namespace-wide one)."""
    selector = policy["spec"].get("podSelector") or {}
    return bool(selector.get("matchLabels") or selector.get("matchExpressions"))


def rule_network_default_deny(objs: list[Obj]) -> Iterator[Violation]:
    for ns in sorted({namespace(o) for o in workloads(objs)}):
        deny = [
            p
            for p in _policies(objs, ns)
            if not _selects_by_label(p)
            and {"Ingress", "Egress"} <= set(p["spec"].get("policyTypes", []))
            and not p["spec"].get("ingress")
            and not p["spec"].get("egress")
        ]
        if not deny:
            yield Violation(
                "network-default-deny",
                f"Namespace/{ns}",
                "no NetworkPolicy denies all ingress and egress by default (podSelector: {}, "
                "policyTypes: [Ingress, Egress], no rules)",
            )


def rule_network_policy_per_workload(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        labels = pod_labels(obj)
        own = [
            p
            for p in _policies(objs, namespace(obj))
            if _selects_by_label(p)
            and selects(p["spec"]["podSelector"], labels)
            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        ]
        if not own:
            yield Violation(
                "network-policy-per-workload",
                name(obj),
                f"no NetworkPolicy selects pods {labels} by label to say who may reach them",
            )


def _lb_internal_everywhere(service: Obj) -> list[str]:
    annotations = service["metadata"].get("annotations", {})
    missing = []
    for cloud, needed in INTERNAL_LB.items():
        for pair in needed:
            ((key, value),) = pair.items()
            if str(annotations.get(key, "")).lower() != value.lower():
                missing.append(f"{cloud}: {key}: {value!r}")
    return missing


def rule_internal_load_balancer(objs: list[Obj]) -> Iterator[Violation]:
    for svc in objs:
        if svc.get("kind") != "Service" or svc.get("spec", {}).get("type") != "LoadBalancer":
            continue
        if svc["metadata"].get("annotations", {}).get(PUBLIC) == "true":
            continue
        missing = _lb_internal_everywhere(svc)
        ranges = svc["spec"].get("loadBalancerSourceRanges", [])
        open_ranges = [r for r in ranges if ipaddress.ip_network(r, strict=False).prefixlen == 0]
        if missing or not ranges or open_ranges:
            yield Violation(
                "internal-load-balancer",
                name(svc),
                f"a load balancer not marked {PUBLIC}: 'true' must be internal on every cloud "
                f"(missing {missing}) and limited to its callers' networks by loadBalancerSourceRanges "
                f"(got {ranges})",
            )


def rule_triton_not_exposed(objs: list[Obj]) -> Iterator[Violation]:
    """Triton has no authentication of its own: only in-cluster Services may select its pods."""
    tritons = [o for o in workloads(objs) if any(_is_triton(c) for c in containers(o))]
    for svc in objs:
        if svc.get("kind") != "Service" or svc.get("spec", {}).get("type") not in (
            "LoadBalancer",
            "NodePort",
        ):
            continue
        for t in tritons:
            if namespace(t) == namespace(svc) and selects(
                {"matchLabels": svc["spec"].get("selector", {})}, pod_labels(t)
            ):
                yield Violation(
                    "triton-not-exposed",
                    name(svc),
                    f"{svc['spec']['type']} selects Triton pods ({name(t)}): expose the gateways, or "
                    "the mutual-TLS spill-over proxy across regions, never Triton",
                )


# --- credentials ---------------------------------------------------------------------------------


def _identity(obj: Obj, accounts: dict[tuple[str, str], Obj]) -> str | None:
    """The service account whose identity the pod carries (a mounted API token, a projected token,
    or workload-identity annotations on the account); None when it carries none."""
    spec = pod_spec(obj)
    account = spec.get("serviceAccountName", "default")
    sa = accounts.get((namespace(obj), account), {})
    mounted = spec.get("automountServiceAccountToken", sa.get("automountServiceAccountToken", True))
    projected = any(
        "serviceAccountToken" in src
        for v in spec.get("volumes", [])
        for src in (v.get("projected") or {}).get("sources", [])
    )
    annotated = bool(sa.get("metadata", {}).get("annotations"))
    return account if mounted or projected or annotated else None


def rule_dedicated_service_account(objs: list[Obj]) -> Iterator[Violation]:
    accounts = {(namespace(o), o["metadata"]["name"]): o for o in objs if o.get("kind") == "ServiceAccount"}
    users: dict[tuple[str, str], list[str]] = {}
    for obj in workloads(objs):
        account = _identity(obj, accounts)
        if account == "default":
            yield Violation(
                "dedicated-service-account",
                name(obj),
                "carries the namespace's `default` service account identity: give it its own account, "
                "or automountServiceAccountToken: false",
            )
        elif account is not None:
            users.setdefault((namespace(obj), account), []).append(name(obj))
    for (_, account), names in sorted(users.items()):
        if len(names) > 1:
            for n in names:
                yield Violation(
                    "dedicated-service-account",
                    n,
                    f"shares service account {account} with {[m for m in names if m != n]}: each workload "
                    "gets its own, with only the permissions it uses",
                )


def rule_no_static_cloud_keys(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        for c in containers(obj):
            keys = sorted(e["name"] for e in c.get("env", []) if e["name"] in STATIC_KEYS)
            bulk = [s["secretRef"]["name"] for s in c.get("envFrom", []) if "secretRef" in s]
            if keys or bulk:
                yield Violation(
                    "no-static-cloud-keys",
                    name(obj),
                    f"container {c['name']}: static cloud credentials {keys} / whole Secrets in the "
                    f"environment {bulk}: use workload identity (deploy/k8s/components), and name each "
                    "secret value with secretKeyRef",
                )


def rule_secret_volume_readable(objs: list[Obj]) -> Iterator[Violation]:
    """The kubelet writes Secret files as root: a non-root container reads a mode without the
    world bit only through the pod's fsGroup and the group bit."""
    for obj in workloads(objs):
        spec = pod_spec(obj)
        fs_group = (spec.get("securityContext") or {}).get("fsGroup")
        for v in spec.get("volumes", []):
            if "secret" not in v:
                continue
            mode = int((v["secret"] or {}).get("defaultMode", 0o644))
            if mode & 0o004 or (fs_group is not None and mode & 0o040):
                continue
            yield Violation(
                "secret-volume-readable",
                name(obj),
                f"secret volume {v['name']} (mode {mode:04o}) is unreadable to a non-root user: set the "
                "pod's fsGroup and a group-readable defaultMode such as 0440",
            )


# --- lifecycle ---------------------------------------------------------------------------------------


def rule_probes(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        if obj["kind"] not in LONG_RUNNING:
            continue
        for c in pod_spec(obj).get("containers", []):
            missing = [p for p in ("readinessProbe", "livenessProbe") if p not in c]
            if missing:
                yield Violation("probes", name(obj), f"container {c['name']}: set {', '.join(missing)}")


def _prestop_seconds(container: Obj) -> int:
    pre = (container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    command = (pre.get("exec") or {}).get("command", [])
    if len(command) == 2 and command[0] == "sleep":
        return int(command[1])
    return 0


def rule_prestop_grace(objs: list[Obj]) -> Iterator[Violation]:
    """A pod leaves its Services' endpoints only after it was told to stop; a container that serves
    on a port waits in preStop until kube-proxy, load balancers and watchers have dropped it, and
    the grace period leaves time for its own drain after that."""
    for obj in workloads(objs):
        if obj["kind"] not in LONG_RUNNING:
            continue
        grace = int(pod_spec(obj).get("terminationGracePeriodSeconds", 30))
        for c in pod_spec(obj).get("containers", []):
            wait = _prestop_seconds(c)
            if not wait and c.get("ports"):
                yield Violation(
                    "prestop-grace",
                    name(obj),
                    f"container {c['name']} serves on ports but has no preStop wait (e.g. exec sleep 5): "
                    "it would refuse requests still routed to it",
                )
            elif wait >= grace:
                yield Violation(
                    "prestop-grace",
                    name(obj),
                    f"container {c['name']}: preStop waits {wait}s but terminationGracePeriodSeconds is "
                    f"{grace}: the process would be killed before its own drain begins",
                )


def rule_pdb_per_workload(objs: list[Obj]) -> Iterator[Violation]:
    budgets = [o for o in objs if o.get("kind") == "PodDisruptionBudget"]
    for obj in workloads(objs):
        if obj["kind"] not in ("Deployment", "StatefulSet") or exempt(obj, "pdb-per-workload"):
            continue
        mine = [
            b
            for b in budgets
            if namespace(b) == namespace(obj) and selects(b["spec"].get("selector"), pod_labels(obj))
        ]
        if not mine:
            yield Violation(
                "pdb-per-workload",
                name(obj),
                "no PodDisruptionBudget selects its pods: a node drain may evict them all at once",
            )
            continue
        replicas = _replicas(obj, objs)
        for b in mine:
            spec = b["spec"]
            blocked = (
                str(spec.get("maxUnavailable", "")) in ("0", "0%")
                or str(spec.get("minAvailable", "")) == "100%"
            )
            if isinstance(spec.get("minAvailable"), int) and spec["minAvailable"] >= replicas:
                blocked = True
            if blocked:
                yield Violation(
                    "pdb-per-workload",
                    name(b),
                    f"allows no disruption of {name(obj)} ({replicas} replicas): node drains would hang",
                )
            elif replicas > 1 and _evictable(spec, replicas) >= replicas:
                yield Violation(
                    "pdb-per-workload",
                    name(b),
                    f"lets a drain evict all {replicas} replicas of {name(obj)} at once: the region empties",
                )
            if spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow":
                yield Violation(
                    "pdb-per-workload",
                    name(b),
                    "unhealthyPodEvictionPolicy AlwaysAllow evicts pods that are not Ready past the budget: "
                    "servers still loading their models would all go; leave the default IfHealthyBudget",
                )


def _count(value: int | str, replicas: int) -> int:
    """A budget's integer or percentage as pods, rounded up as Kubernetes rounds both fields."""
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(replicas * int(value[:-1]) / 100)
    return int(value)


def _evictable(spec: dict[str, Any], replicas: int) -> int:
    """How many of `replicas` healthy pods a budget lets go at once."""
    if "maxUnavailable" in spec:
        return _count(spec["maxUnavailable"], replicas)
    if "minAvailable" in spec:
        return replicas - _count(spec["minAvailable"], replicas)
    return 0


def rule_topology_spread(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        if obj["kind"] not in ("Deployment", "StatefulSet") or _replicas(obj, objs) < 2:
            continue
        spread = [
            t
            for t in pod_spec(obj).get("topologySpreadConstraints", [])
            if t.get("topologyKey") == ZONE and selects(t.get("labelSelector"), pod_labels(obj))
        ]
        if not spread:
            yield Violation(
                "topology-spread",
                name(obj),
                f"no topologySpreadConstraint over {ZONE} selecting its own pods: one zone's loss could "
                "take every replica",
            )


# --- Triton ------------------------------------------------------------------------------------------


def _is_triton(container: Obj) -> bool:
    args = [*container.get("command", []), *container.get("args", [])]
    return "tritonserver" in str(container.get("image", "")) or (bool(args) and args[0] == "tritonserver")


def _restricted(args: list[str], flag: str) -> dict[str, str]:
    """API -> 'header=value' from Triton's --http-restricted-api / --grpc-restricted-protocol flags."""
    out: dict[str, str] = {}
    for arg in args:
        if arg.startswith(flag + "="):
            apis, _, key = arg.removeprefix(flag + "=").partition(":")
            out.update({api: key for api in apis.split(",")})
    return out


def rule_triton_restricted_apis(objs: list[Obj]) -> Iterator[Violation]:
    for obj in workloads(objs):
        for c in containers(obj):
            if not _is_triton(c):
                continue
            args = [*c.get("command", []), *c.get("args", [])]
            http = _restricted(args, "--http-restricted-api")
            grpc = _restricted(args, "--grpc-restricted-protocol")
            open_http = sorted(TRITON_CONTROL_APIS - set(http))
            open_grpc = sorted(TRITON_CONTROL_APIS - set(grpc))
            keys = {http.get(a) for a in TRITON_CONTROL_APIS} | {grpc.get(a) for a in TRITON_CONTROL_APIS}
            if open_http or open_grpc or len(keys) != 1 or not all(k and "=" in k for k in keys):
                yield Violation(
                    "triton-restricted-apis",
                    name(obj),
                    f"container {c['name']}: Triton's control APIs must answer one key only, on HTTP "
                    f"and gRPC alike (open on HTTP: {open_http}, on gRPC: {open_grpc}; keys {sorted(map(str, keys))})",
                )


def rule_triton_shm(objs: list[Obj]) -> Iterator[Violation]:
    """The Python backend hands tensors to its stub processes through /dev/shm, which a container
    gets as 64Mi unless a memory-backed volume replaces it (Docker's --shm-size)."""
    for obj in workloads(objs):
        memory = {
            v["name"]
            for v in pod_spec(obj).get("volumes", [])
            if "emptyDir" in v and (v["emptyDir"] or {}).get("medium") == "Memory"
        }
        for c in containers(obj):
            if _is_triton(c) and not any(
                m["mountPath"] == "/dev/shm" and m["name"] in memory for m in c.get("volumeMounts", [])
            ):
                yield Violation(
                    "triton-shm",
                    name(obj),
                    f"container {c['name']}: mount an emptyDir {{medium: Memory, sizeLimit: ...}} at "
                    "/dev/shm, sized for the Python backend's tensors",
                )


# --- release -----------------------------------------------------------------------------------------


def rule_release_placeholders(objs: list[Obj]) -> Iterator[Violation]:
    for obj in objs:
        text = yaml.safe_dump(obj)
        found = [p for p in PLACEHOLDERS if p in text]
        if found:
            yield Violation(
                "release-placeholders",
                name(obj),
                f"holds placeholders {found}: make images writes digests; deploy/README.md says what "
                "to set for the rest",
            )


RULES: dict[str, Callable[[list[Obj]], Iterator[Violation]]] = {
    "non-root": rule_non_root,
    "no-privilege-escalation": rule_no_privilege_escalation,
    "drop-all-capabilities": rule_drop_all_capabilities,
    "seccomp": rule_seccomp,
    "no-host-access": rule_no_host_access,
    "read-only-root-filesystem": rule_read_only_root_filesystem,
    "resources": rule_resources,
    "gpu-guaranteed": rule_gpu_guaranteed,
    "ephemeral-storage": rule_ephemeral_storage,
    "shm-within-memory-limit": rule_shm_within_memory_limit,
    "image-digest": rule_image_digest,
    "network-default-deny": rule_network_default_deny,
    "network-policy-per-workload": rule_network_policy_per_workload,
    "internal-load-balancer": rule_internal_load_balancer,
    "triton-not-exposed": rule_triton_not_exposed,
    "dedicated-service-account": rule_dedicated_service_account,
    "no-static-cloud-keys": rule_no_static_cloud_keys,
    "secret-volume-readable": rule_secret_volume_readable,
    "probes": rule_probes,
    "prestop-grace": rule_prestop_grace,
    "pdb-per-workload": rule_pdb_per_workload,
    "topology-spread": rule_topology_spread,
    "triton-restricted-apis": rule_triton_restricted_apis,
    "triton-shm": rule_triton_shm,
}
RELEASE_RULES = {"release-placeholders": rule_release_placeholders}


def check(objs: list[Obj], release: bool = False, skip: frozenset[str] = frozenset()) -> list[Violation]:
    """Every violation of every rule (and of the release rules with `release`), except `skip`."""
    rules = {**RULES, **(RELEASE_RULES if release else {})}
    return [v for rule, fn in rules.items() if rule not in skip for v in fn(objs)]


def render(path: Path) -> list[Obj]:
    """Objects of a kustomization folder (rendered by `kubectl kustomize`) or of a YAML file."""
    if path.is_dir():
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            raise RuntimeError("kubectl (with kustomize 5) is needed to render a kustomization folder")
        res = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"kubectl kustomize {path} failed: {res.stderr.strip()}")
        text = res.stdout
    else:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.deploy.policy", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="kustomization folders, YAML files, or - (stdin)")
    parser.add_argument("--release", action="store_true", help="also refuse placeholders (before applying)")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.paths:
        violations = check(render(path), release=args.release)
        for v in violations:
            print(f"{path}: {v}")
        failed += len(violations)
        if not violations:
            print(f"{path}: {len(RULES) + (len(RELEASE_RULES) if args.release else 0)} rules pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
