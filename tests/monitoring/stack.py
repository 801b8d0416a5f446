"""A small real stack for monitoring tests: Triton servers with their response cache, a gateway, traffic."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

from tests.fixtures_models import write_affine_model

TRITON_CACHE = ("local,size=1048576",)


def write_monitoring_repo(repo: Path) -> Path:
    """`affine` (cached by the gateway) and `tcached` (cached by Triton's own response cache)."""
    write_affine_model(repo, "affine")
    model = write_affine_model(repo, "tcached")
    for cfg in (model / "config.pbtxt", model / "configs" / "local.pbtxt"):
        cfg.write_text(cfg.read_text() + "\nresponse_cache { enable: true }\n")
    return repo


class Traffic(threading.Thread):
    """Steady requests through the gateway until stopped: repeats (cache hits) and fresh inputs."""

    def __init__(self, gateway_http: str) -> None:
        super().__init__(daemon=True)
        self.base = f"http://{gateway_http}"
        self.stop_event = threading.Event()
        self.sent = 0
        self.failed = 0

    def _infer(self, model: str, value: float) -> None:
        body = json.dumps(
            {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [value] * 4}]}
        ).encode()
        req = urllib.request.Request(
            f"{self.base}/v2/models/{model}/infer", data=body, headers={"Content-Type": "application/json"}
        )
        self.sent += 1
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            self.failed += 1

    def run(self) -> None:
        i = 0
        while not self.stop_event.wait(0.02):
            i += 1
            self._infer("affine", float(i % 5))  # five distinct inputs: gateway cache hits after the first
            self._infer("tcached", float(i % 3))  # Triton's response cache answers the repeats
            self._infer("affine", float(i) + 0.5)  # always new: reaches Triton

    def stop(self) -> None:
        self.stop_event.set()
        self.join(15)
