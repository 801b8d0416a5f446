"""Whether a server serves what the desired state wants on it: the startup gate of a Triton pod.

A Triton pod in explicit model-control mode is "ready" while it holds nothing; the controller is the
one that knows what it should hold (every model's served versions, those placement gives it, a
canary it passed). Each pass records, per server, what it wanted there and which of those versions
the server did not have loaded when the pass observed it; the controller's API answers
`GET /v1/servers/ready?server=NAME-OR-HOST` from that, and the pod's startup probe
(deploy/k8s/base/triton-startup-probe.py) asks it, so the pod counts as started (for the Service, the
gateways' discovery, the spill-over load balancer, KEDA and rolling updates) only once it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class ServerReadiness:
    server: str
    host: str  # the host of its HTTP endpoint (a pod's IP): what a probe inside the pod knows
    wanted: dict[str, list[int]]
    missing: dict[str, list[int]]

    @property
    def ready(self) -> bool:
        return not self.missing

    def as_json(self) -> dict[str, Any]:
        return {"server": self.server, "wanted": self.wanted, "missing": self.missing}


def readiness_of(
    server: str, http: str, wanted: dict[str, list[int]], loaded: dict[str, list[int]]
) -> ServerReadiness:
    missing = {
        model: gap
        for model, versions in sorted(wanted.items())
        if (gap := sorted(set(versions) - set(loaded.get(model, []))))
    }
    host = urlsplit(http if "://" in http else f"http://{http}").hostname or ""
    return ServerReadiness(server, host, dict(sorted(wanted.items())), missing)


def find(readiness: dict[str, ServerReadiness], who: str) -> ServerReadiness | None:
    """A server by its name (region/name) or by the host of its HTTP endpoint."""
    if who in readiness:
        return readiness[who]
    return next((r for r in readiness.values() if r.host == who), None)
