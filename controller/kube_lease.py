"""The leader election's record as a Kubernetes Lease (coordination.k8s.io/v1), as client-go keeps it.

In a cluster, `skewserve controller --leader-election --leader-lease-in kubernetes` keeps the lease
in a Lease object of its namespace instead of a record in the repository: operators see the leader
with `kubectl get lease`, and the election does not depend on the bucket. The election's rules are
the same (controller/leader.py); this module only reads and writes the record, conditionally:
a write carries the `metadata.resourceVersion` it read, and the API server answers 409 Conflict
when another replica wrote in between (a create of an existing Lease is a 409 AlreadyExists).

The record's fields map onto the Lease's spec: holder -> holderIdentity, term -> leaseTransitions,
duration -> leaseDurationSeconds (whole seconds, rounded up, at least 1 as the API requires; a Lease
without a holder is free at once), renewed -> renewTime.
"""

from __future__ import annotations

import json
import math
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

from controller.errors import ControlError
from controller.leader import LeaseRecord
from repository.errors import StateConflict

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 5.0


@dataclass(frozen=True)
class KubeAccess:
    """Where the API server is and how to authenticate to it (a pod's service account by default)."""

    api_url: str
    namespace: str
    token_file: Path
    ca_file: Path | None

    @classmethod
    def in_cluster(
        cls, api_url: str | None = None, namespace: str | None = None, account_dir: Path = SERVICE_ACCOUNT_DIR
    ) -> KubeAccess:
        if api_url is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
            if not host or not port:
                raise ControlError(
                    "--leader-lease-in kubernetes needs the Kubernetes API: KUBERNETES_SERVICE_HOST/PORT are "
                    "not set (not in a pod); run in the cluster or use --leader-lease-in store"
                )
            api_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        if namespace is None:
            try:
                namespace = (account_dir / "namespace").read_text().strip()
            except OSError as exc:
                raise ControlError(f"the pod's namespace cannot be read from {account_dir}: {exc}") from exc
        ca = account_dir / "ca.crt"
        return cls(api_url.rstrip("/"), namespace, account_dir / "token", ca if ca.is_file() else None)


def _rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _epoch(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.strptime(text.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


class KubeLeaseRecords:
    """`read_record` / `write_record` / `remove_record` (the part of a StateStore the election uses)
    over Lease objects named `skewserve-<record name>`."""

    def __init__(self, access: KubeAccess) -> None:
        self.access = access
        self.tls = ssl.create_default_context(cafile=str(access.ca_file) if access.ca_file else None)
        self.base = f"{access.api_url}/apis/coordination.k8s.io/v1/namespaces/{quote(access.namespace, safe='')}/leases"

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        # Re-read for every request: kubelet rotates projected service-account tokens.
        token = self.access.token_file.read_text().strip()
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        context = self.tls if self.base.startswith("https://") else None
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as answer:
                return answer.status, json.load(answer)
        except urllib.error.HTTPError as exc:
            try:
                status = json.load(exc)
            except ValueError:
                status = {}
            return exc.code, status

    @staticmethod
    def _lease_name(name: str) -> str:
        return f"skewserve-{name}"

    def read_record(self, name: str) -> tuple[bytes | None, object]:
        code, lease = self._request("GET", f"/{self._lease_name(name)}")
        if code == 404:
            return None, None
        if code != 200:
            raise ControlError(f"reading Lease {self._lease_name(name)}: {code} {lease.get('message', '')}")
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        record = LeaseRecord(
            holder=holder,
            term=int(spec.get("leaseTransitions") or 0),
            # released (no holder): free at once, as client-go reads a Lease its holder gave up
            duration_s=float(spec.get("leaseDurationSeconds") or 0) if holder else 0.0,
            renewed=_epoch(spec.get("renewTime")),
        )
        return record.encode(), lease["metadata"]["resourceVersion"]

    def write_record(self, name: str, data: bytes, token: object) -> None:
        record = LeaseRecord.decode(data)
        lease: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self._lease_name(name)},
            "spec": {
                "holderIdentity": record.holder,
                "leaseDurationSeconds": max(1, math.ceil(record.duration_s)),
                "leaseTransitions": record.term,
                "renewTime": _rfc3339(record.renewed),
            },
        }
        if token is None:
            code, status = self._request("POST", "", lease)
        else:
            lease["metadata"]["resourceVersion"] = str(token)
            code, status = self._request("PUT", f"/{self._lease_name(name)}", lease)
        if code == 409:
            raise StateConflict(f"Lease {self._lease_name(name)} changed since it was read")
        if code not in (200, 201):
            raise ControlError(f"writing Lease {self._lease_name(name)}: {code} {status.get('message', '')}")

    def remove_record(self, name: str) -> None:
        code, status = self._request("DELETE", f"/{self._lease_name(name)}")
        if code not in (200, 202, 404):
            raise ControlError(f"deleting Lease {self._lease_name(name)}: {code} {status.get('message', '')}")
