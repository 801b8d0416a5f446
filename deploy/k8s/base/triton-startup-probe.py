"""Startup probe of a Triton pod: it counts as started once it serves what the controller wants on it.

Triton in explicit model-control mode is ready while it holds nothing, so a pod that only passed
Triton's own readiness would take traffic (the Service, the gateways' discovery, the spill-over load
balancer), count as capacity (KEDA) and let a rolling update move on while it is still empty. The
controller knows what the pod should hold (every model's served versions, what placement gives it):
this probe asks it, `GET /v1/servers/ready?server=<the pod's IP>` (controller/server_readiness.py),
and exits 0 when it answers `ready`, 1 when it answers `loading` (a version is missing) or `unknown`
(the controller has not reached the pod yet).

When no controller answers (none deployed, a take-over in progress, the token refused), the probe
falls back to Triton alone, so a controller outage never keeps pods from starting: started once it
serves a model, or once the repository holds none. Python's standard library only: it runs in the
NGC Triton image.

Environment: SKEWSERVE_PROBE_URL (Triton, default http://127.0.0.1:8000), SKEWSERVE_CONTROL_KEY
(Triton's restricted repository API), SKEWSERVE_CONTROLLER_URL (unset: Triton alone),
SKEWSERVE_SERVER (the pod's IP), SKEWSERVE_CONTROLLER_TOKEN_FILE (this caller's bearer token).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

TIMEOUT_S = 4


def _call(url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, data=body, headers=headers or {})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
        return json.load(answer)


def controller_verdict() -> int | None:
    """0 ready, 1 not yet; None when no controller gave a verdict (the caller falls back)."""
    base = os.environ.get("SKEWSERVE_CONTROLLER_URL", "").rstrip("/")
    server = os.environ.get("SKEWSERVE_SERVER", "")
    if not base or not server:
        return None
    headers = {}
    token_file = os.environ.get("SKEWSERVE_CONTROLLER_TOKEN_FILE", "")
    try:
        if token_file:
            headers["Authorization"] = f"Bearer {open(token_file).read().strip()}"
        url = f"{base}/v1/servers/ready?{urllib.parse.urlencode({'server': server})}"
        _call(url, headers=headers)
        return 0
    except urllib.error.HTTPError as exc:
        try:
            state = json.load(exc).get("state")
        except ValueError:
            state = None
        if state in ("loading", "unknown"):
            print(f"the controller says {server} is {state}", file=sys.stderr)
            return 1
        print(f"no verdict from the controller ({exc.code} {state}): Triton alone decides", file=sys.stderr)
        return None
    except (OSError, ValueError) as exc:
        print(f"no controller answered ({exc}): Triton alone decides", file=sys.stderr)
        return None


def triton_alone() -> int:
    """0 once Triton serves a model, or once the repository holds none."""
    triton = os.environ.get("SKEWSERVE_PROBE_URL", "http://127.0.0.1:8000").rstrip("/")
    try:
        if _call(f"{triton}/v2/models/stats")["model_stats"]:
            return 0
        key = {"skewserve-control": os.environ.get("SKEWSERVE_CONTROL_KEY", "")}
        return 1 if _call(f"{triton}/v2/repository/index", b"{}", key) else 0
    except (OSError, ValueError, KeyError) as exc:
        print(f"Triton did not answer: {exc}", file=sys.stderr)
        return 1


def main() -> int:
    verdict = controller_verdict()
    return triton_alone() if verdict is None else verdict


if __name__ == "__main__":
    sys.exit(main())
