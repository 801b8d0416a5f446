"""`skewserve loadtest`: run locust headless for a bounded time and report.

Writes `<out>/locust_stats.csv` (+ history, failures), `<out>/report.html` (locust's report) and
`<out>/latency.png`; returns the summary and SLO breaches so the caller can exit non-zero.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.mix import InputDesc, MixSettings
from loadtests.report import RowStats, Slo, check_slo, plot_history, read_stats
from loadtests.shapes import SHAPES

USER_CLASSES = {"http": "HttpJsonUser", "http-binary": "HttpBinaryUser", "grpc": "GrpcUser"}
LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", text)
    if not m:
        raise ValueError(f"duration {text!r} is not like 30s, 2m or 1h")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


@dataclass
class LoadTestSpec:
    target: str
    protocol: str
    mix: MixSettings
    users: int = 4
    spawn_rate: float = 4.0
    duration_s: float = 20.0
    max_requests: int | None = None  # stop once this many requests were answered (or the duration ends)
    shape: str = "steady"
    out_dir: Path = Path("runs/loadtest")
    metrics_url: str | None = None
    slo: Slo | None = None

    def __post_init__(self) -> None:
        if self.protocol not in USER_CLASSES:
            raise ValueError(f"protocol must be one of {', '.join(USER_CLASSES)}, got {self.protocol!r}")
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {self.shape!r}")
        if self.users < 1 or self.duration_s <= 0:
            raise ValueError("users must be >= 1 and duration > 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.max_requests}")


@dataclass
class LoadTestResult:
    rows: list[RowStats]
    total: RowStats
    cache_hit_rate: float | None
    spillovers: float | None
    breaches: list[str]
    files: dict[str, Path] = field(default_factory=dict)


def host_for(spec: LoadTestSpec) -> str:
    if spec.protocol == "grpc":
        return spec.target.removeprefix("grpc://")
    return spec.target if spec.target.startswith("http") else f"http://{spec.target}"


def scrape(url: str) -> dict[str, float]:
    """Sum Prometheus samples by metric name and label subset we read (cache and spill-over)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {"hit": 0.0, "miss": 0.0, "spill": 0.0}
    for line in text.splitlines():
        if line.startswith("skewserve_gateway_cache_requests_total{"):
            kind = "hit" if 'result="hit"' in line else "miss"
            out[kind] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("skewserve_gateway_spillovers_total{"):
            out["spill"] += float(line.rsplit(" ", 1)[1])
    return out


def run_loadtest(spec: LoadTestSpec) -> LoadTestResult:
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / "locust"
    env = {
        **os.environ,
        **spec.mix.to_env(),
        "SKEWSERVE_LT_SHAPE": spec.shape,
        "SKEWSERVE_LT_USERS": str(spec.users),
        "SKEWSERVE_LT_SPAWN_RATE": str(spec.spawn_rate),
        "SKEWSERVE_LT_DURATION_S": str(spec.duration_s),
        "SKEWSERVE_LT_MAX_REQUESTS": str(spec.max_requests or ""),
    }
    # The project root on PYTHONPATH so the locustfile can import loadtests.* wherever it is run from.
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        USER_CLASSES[spec.protocol],
        "--headless",
        "--host",
        host_for(spec),
        "--csv",
        str(prefix),
        "--csv-full-history",
        "--html",
        str(out / "report.html"),
        "--only-summary",
        "--loglevel",
        "WARNING",
        "--stop-timeout",
        "5",
        "--exit-code-on-error",
        "0",
    ]
    before = scrape(spec.metrics_url) if spec.metrics_url else None
    log = out / "locust.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=spec.duration_s + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"locust exited with {proc.returncode}; see {log}:\n{log.read_text()[-1500:]}")
    after = scrape(spec.metrics_url) if spec.metrics_url else None
    rows = read_stats(prefix)
    total = next(r for r in rows if r.name == "Aggregated")
    plot_history(prefix, out / "latency.png")
    hit_rate = spill = None
    if before is not None and after is not None:
        hits, misses = after["hit"] - before["hit"], after["miss"] - before["miss"]
        hit_rate = hits / (hits + misses) if hits + misses else None
        spill = after["spill"] - before["spill"]
    breaches = check_slo(total, spec.slo) if spec.slo else []
    # What `skewserve plan --loadtest` reads besides locust's CSV: whether the cache served the run.
    summary = {
        "model": spec.mix.model,
        "protocol": spec.protocol,
        "cache_hit_rate": hit_rate,
        "spillovers": spill,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    files = {
        "stats": Path(f"{prefix}_stats.csv"),
        "history": Path(f"{prefix}_stats_history.csv"),
        "html": out / "report.html",
        "png": out / "latency.png",
    }
    return LoadTestResult(
        [r for r in rows if r.name != "Aggregated"], total, hit_rate, spill, breaches, files
    )


def model_inputs(target: str, protocol: str, model: str) -> tuple[InputDesc, ...]:
    """The model's inputs as the endpoint serves them: name, datatype, per-item shape (-1 dynamic).

    With SKEWSERVE_API_KEY set (a gateway that requires keys), these reads carry it as the users do.
    """
    key = os.environ.get("SKEWSERVE_API_KEY")
    headers = {"x-api-key": key} if key else None
    if protocol == "grpc":
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(target.removeprefix("grpc://"))
        meta = client.get_model_metadata(model, headers=headers, as_json=True)
        config = client.get_model_config(model, headers=headers, as_json=True)["config"]
        batched = int(config.get("max_batch_size", 0)) > 0
    else:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(target.removeprefix("http://").removeprefix("https://"))
        meta = client.get_model_metadata(model, headers=headers)
        batched = int(client.get_model_config(model, headers=headers).get("max_batch_size", 0)) > 0
    out = []
    for inp in meta["inputs"]:
        shape = tuple(int(d) for d in inp["shape"])
        out.append((str(inp["name"]), str(inp["datatype"]), shape[1:] if batched else shape))
    return tuple(out)
