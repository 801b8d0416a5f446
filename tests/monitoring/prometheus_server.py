"""A real Prometheus server (Debian's `prometheus` binary) on a free loopback port with a temp TSDB.

Tests hand it scrape targets and rule files, then read its HTTP API: instant queries, rule health,
alert states. Nothing here mocks Prometheus: every expression is evaluated by the server itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from skewserve.ports import free_port
from tests.waiting import wait_until

T = TypeVar("T")


class PrometheusError(AssertionError):
    pass


def fast_rules_copy(source: Path, dest: Path, for_duration: str = "1s") -> Path:
    """The rules in `source` with every `for:` shortened, so an alert's firing is seen in a test."""
    data = yaml.safe_load(source.read_text())
    for group in data["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if "alert" in rule and "for" in rule:
                rule["for"] = for_duration
    dest.write_text(yaml.safe_dump(data, sort_keys=False))
    return dest


class PrometheusServer:
    def __init__(
        self,
        workdir: Path,
        jobs: dict[str, list[str]],
        rule_files: list[Path] = (),  # type: ignore[assignment]
        scrape_interval: str = "1s",
    ) -> None:
        binary = shutil.which("prometheus")
        assert binary, "the prometheus server is required (make setup installs Debian's prometheus)"
        self.binary = binary
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": scrape_interval, "evaluation_interval": "1s"},
                    "rule_files": [str(p) for p in rule_files],
                    "scrape_configs": [
                        {"job_name": job, "scrape_timeout": "900ms", "static_configs": [{"targets": targets}]}
                        for job, targets in jobs.items()
                    ],
                }
            )
        )
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.wait_for(lambda: self._ready(), timeout_s, "prometheus /-/ready")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise PrometheusError(f"prometheus exited: {self.log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- API ---------------------------------------------------------------------------------
    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; raises PrometheusError naming the expression if the server rejects it."""
        data = self.api("query", query=expr)
        result = data["result"]
        return result if data["resultType"] == "vector" else [{"metric": {}, "value": result}]

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("alerts")["alerts"])

    def firing(self, name: str, **labels: str) -> bool:
        return any(
            a["labels"].get("alertname") == name
            and a["state"] == "firing"
            and all(a["labels"].get(k) == v for k, v in labels.items())
            for a in self.alerts()
        )

    def targets_up(self) -> dict[str, str]:
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll an observable state, bounded in time; the message says what never happened."""
        try:
            wait_until(predicate, timeout_s, what, interval=0.2)
        except AssertionError as exc:
            raise PrometheusError(f"{exc}; log: {self.log_path}") from None
