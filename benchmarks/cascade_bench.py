"""Cascade benchmark (docs/cascade.md): a small edge model first, the cloud model for what it is
unsure of, on long-tailed digits sent as raw PNG bytes, with a WAN delay between edge and cloud.

One run, side by side:
1. data: scikit-learn's digits as long-tailed image folders (ratio 50; balanced val and test);
2. the cloud model: the `cnn` family with defaults; the edge model: the `mlp` family (two hidden
   layers, --edge-width wide) distilled from it (`--distill-from`); both exported (ONNX FP32 + raw-bytes ensembles) into
   one repository, served by one tritonserver;
3. rules from `skewserve cascade calibrate` on the validation split: per-class thresholds for
   `--target within=X` (the cloud's balanced accuracy within X), then a global threshold at the
   escalation rate the per-class rule reached there (matched escalation);
4. one gateway with two regions: `edge` (the server direct) and `cloud` (the same server behind a
   delay proxy adding --wan-ms to every inference answer), serving both cascades;
5. every test image, one request at a time, to: the edge model only (pinned to `edge`), the cloud
   model only (pinned to `cloud`), the global cascade and the per-class cascade.

Prints per variant: balanced accuracy, worst-class recall, escalation rate, median and p99 latency,
bytes sent upstream (the cascade's `skewserve_gateway_cascade_upstream_bytes_total`; cloud only:
every body), and the issue's goals met or missed by how much. Writes the figures as JSON and a plot.
Usage: python benchmarks/cascade_bench.py [--wan-ms 20] [--within 0.0] [--edge-width 128] [--repeat 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporter.pipeline import export_artifact  # noqa: E402
from exporter.raw_inputs import RAW_SUFFIX  # noqa: E402
from skewserve.cascade_calibrate import Target, calibrate  # noqa: E402
from skewserve.gateway_process import GatewayProcess, start_gateway_process  # noqa: E402
from skewserve.ports import free_port  # noqa: E402
from skewserve.triton_dist import prepare_triton  # noqa: E402
from skewserve.triton_process import TritonServer, TritonServerSpec  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.datasets_builtin import write_digits_lt  # noqa: E402
from training.launch import train  # noqa: E402

EDGE, CLOUD = "digits-small", "digits-big"
VARIANTS = ("edge only", "cloud only", "global cascade", "per-class cascade")
GOAL_BACC_RATIO, GOAL_ESCALATION, GOAL_WORST_GAIN, GOAL_EDGE_LATENCY = 0.99, 0.35, 0.05, 1.5


@dataclass
class Answers:
    """What one variant's requests came back with, in request order."""

    labels: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)
    body_bytes: int = 0


def build_models(work: Path, edge_width: int) -> tuple[Path, Path, Path]:
    data = work / "data"
    write_digits_lt(data, ratio=50.0, seed=0)
    cloud = work / "cloud"
    meta = train(TrainConfig(data_dir=data, out_dir=cloud, model="cnn", seed=0, progress=False))
    print(f"cloud model (cnn): test balanced accuracy {meta['metrics']['test']['balanced_accuracy']:.4f}")
    edge = work / "edge"
    meta = train(
        TrainConfig(
            data_dir=data,
            out_dir=edge,
            model="mlp",
            width=edge_width,
            distill_from=cloud,
            seed=0,
            progress=False,
        )
    )
    acc = meta["metrics"]["test"]["balanced_accuracy"]
    print(
        f"edge model (mlp, width {edge_width}, distilled from the cloud model): test balanced accuracy {acc:.4f}"
    )
    return data, edge, cloud


def rules(
    work: Path, data: Path, edge: Path, cloud: Path, within: float
) -> tuple[Path, Path, dict[str, Any]]:
    per_class = work / "rules" / "per-class.json"
    doc = calibrate(edge, cloud, data, Target.parse(f"within={within}"), "per_class", per_class)
    matched = doc["validation"]["cascade"]["escalation_rate"]
    global_rule = work / "rules" / "global.json"
    calibrate(edge, cloud, data, Target.parse(f"escalation={matched}"), "global", global_rule)
    return per_class, global_rule, doc


def raw_body(png: bytes) -> tuple[bytes, dict[str, str]]:
    """One image as Triton's binary tensor extension: a BYTES element is its 4-byte length, then it."""
    tensor = len(png).to_bytes(4, "little") + png
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "raw",
                    "shape": [1, 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(tensor)},
                }
            ],
            "outputs": [{"name": "probabilities"}],
        }
    ).encode()
    return head + tensor, {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(head)),
    }


def ask(
    conn: http.client.HTTPConnection, model: str, body: bytes, headers: dict[str, str]
) -> tuple[int, str]:
    conn.request("POST", f"/v2/models/{model}/infer", body, headers)
    resp = conn.getresponse()
    payload = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"{model}: HTTP {resp.status}: {payload[:300]!r}")
    out = next(o for o in json.loads(payload)["outputs"] if o["name"] == "probabilities")
    return int(np.argmax(out["data"])), resp.getheader("x-skewserve-cascade-stage") or ""


def drive(gateway: str, model: str, pin: str | None, images: list[tuple[bytes, int]], repeat: int) -> Answers:
    answers = Answers()
    host, port = gateway.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    for _ in range(repeat):
        for png, _label in images:
            body, headers = raw_body(png)
            if pin is not None:
                headers["x-skewserve-region"] = pin
            started = time.perf_counter()
            label, stage = ask(conn, model, body, headers)
            answers.seconds.append(time.perf_counter() - started)
            answers.labels.append(label)
            answers.stages.append(stage)
            answers.body_bytes += len(body)
    conn.close()
    return answers


def recalls(pred: list[int], truth: list[int], classes: int) -> np.ndarray[Any, Any]:
    p, t = np.asarray(pred), np.asarray(truth)
    return np.array([float(np.mean(p[t == c] == c)) for c in range(classes)])


def upstream_bytes(ops: str, cascade: str) -> float:
    with urllib.request.urlopen(f"http://{ops}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("skewserve_gateway_cascade_upstream_bytes_total{")
            and f'cascade="{cascade}"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def serve(
    work: Path, edge_repo_names: tuple[str, str], per_class: Path, global_rule: Path, wan_s: float
) -> tuple[TritonServer, GatewayProcess, subprocess.Popen[bytes]]:
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    triton = TritonServer(
        TritonServerSpec(repository=work / "repo", name="t"), logs, prepare_triton()
    ).start()
    proxy_port = free_port()
    proxy = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loadtests.delay_proxy",
            str(proxy_port),
            str(triton.http_address.rsplit(":", 1)[1]),
            str(wan_s),
            "--only-infer",
        ]
    )
    edge_model, cloud_model = edge_repo_names

    def cascade(name: str, rule: Path) -> dict[str, Any]:
        return {
            "name": name,
            "stages": [
                {"name": "edge", "model": edge_model, "region": "edge", "rule": str(rule)},
                {"name": "cloud", "model": cloud_model, "region": "cloud"},
            ],
        }

    cfg = {
        "home_region": "edge",
        "upstream_protocol": "http",  # the delay proxy reads HTTP/1.1 exchanges
        "listen": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "ops_port": 0},
        "cache": {"backend": "none"},
        "health": {"interval_s": 0.5},
        "regions": [
            {
                "name": "edge",
                "servers": [{"name": "t-edge", "http": triton.http_address, "grpc": triton.grpc_address}],
            },
            {
                "name": "cloud",
                "servers": [
                    {"name": "t-cloud", "http": f"127.0.0.1:{proxy_port}", "grpc": triton.grpc_address}
                ],
            },
        ],
        "cascades": [cascade("digits-per-class", per_class), cascade("digits-global", global_rule)],
    }
    path = work / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    gateway = start_gateway_process(path, logs / "gateway.log")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://{gateway.ops}/admin/upstreams", timeout=5) as r:
            servers = json.loads(r.read())["servers"]
        if all(s["models"].get(edge_model) and s["models"].get(cloud_model) for s in servers):
            return triton, gateway, proxy
        time.sleep(0.5)
    raise RuntimeError("the models never became ready on both regions' servers")


def report(
    results: dict[str, Answers],
    truth: list[int],
    classes: int,
    upstream: dict[str, float],
    wan_s: float,
    out: Path,
) -> dict[str, Any]:
    rows: dict[str, dict[str, float]] = {}
    for name, a in results.items():
        rec = recalls(a.labels, truth, classes)
        escalated = (
            1.0
            if name == "cloud only"
            else 0.0
            if name == "edge only"
            else float(np.mean([s == "cloud" for s in a.stages]))
        )
        edge_answered = [s for s, st in zip(a.seconds, a.stages, strict=True) if st == "edge"]
        rows[name] = {
            "balanced_accuracy": float(rec.mean()),
            "worst_class_recall": float(rec.min()),
            "escalation_rate": escalated,
            "p50_ms": 1000 * float(np.percentile(a.seconds, 50)),
            "p99_ms": 1000 * float(np.percentile(a.seconds, 99)),
            "edge_answered_p50_ms": 1000 * float(np.percentile(edge_answered, 50))
            if edge_answered
            else float("nan"),
            "upstream_bytes": float(a.body_bytes if name == "cloud only" else upstream.get(name, 0.0)),
        }
    print(
        f"\n## Cascade on digits-LT (ratio 50), raw PNG bytes, {len(truth)} requests per variant, WAN +{wan_s * 1000:.0f} ms\n"
    )
    print("| variant | balanced acc. | worst-class recall | escalated | p50 ms | p99 ms | bytes upstream |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['balanced_accuracy']:.4f} | {r['worst_class_recall']:.4f} | {100 * r['escalation_rate']:.1f}% "
            f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['upstream_bytes'] / 1024:.0f} KiB |"
        )
    pc, gl, cl, ed = rows["per-class cascade"], rows["global cascade"], rows["cloud only"], rows["edge only"]
    goals = {
        "balanced accuracy >= 0.99x the cloud's": (
            pc["balanced_accuracy"] / cl["balanced_accuracy"],
            GOAL_BACC_RATIO,
            ">=",
        ),
        "escalated <= 35%": (pc["escalation_rate"], GOAL_ESCALATION, "<="),
        "worst-class recall >= global + 5 pts": (
            pc["worst_class_recall"] - gl["worst_class_recall"],
            GOAL_WORST_GAIN,
            ">=",
        ),
        "edge-answered p50 <= 1.5x the edge model alone": (
            pc["edge_answered_p50_ms"] / ed["p50_ms"],
            GOAL_EDGE_LATENCY,
            "<=",
        ),
    }
    print("\n| goal (per-class cascade) | figure | goal | met |\n|---|---:|---:|---|")
    for name, (value, goal, op) in goals.items():
        met = value >= goal if op == ">=" else value <= goal
        verdict = "yes" if met else f"no, by {abs(value - goal):.3f}"
        print(f"| {name} | {value:.3f} | {op} {goal} | {verdict} |")
    doc = {
        "rows": rows,
        "goals": {k: {"value": v, "goal": g, "op": o} for k, (v, g, o) in goals.items()},
        "wan_ms": wan_s * 1000,
    }
    (out / "cascade_bench.json").write_text(json.dumps(doc, indent=2))
    plot(rows, out / "cascade.png")
    return doc


def plot(rows: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in rows.items():
        left.scatter(100 * r["escalation_rate"], r["balanced_accuracy"], s=60, label=name)
        left.scatter(
            100 * r["escalation_rate"],
            r["worst_class_recall"],
            s=60,
            marker="x",
            color=left.collections[-1].get_facecolor(),
        )
    left.set_xlabel("requests escalated to the cloud (%)")
    left.set_ylabel("test balanced accuracy (o), worst-class recall (x)")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    names = list(rows)
    x = np.arange(len(names))
    right.bar(x - 0.2, [rows[n]["p50_ms"] for n in names], 0.4, label="p50")
    right.bar(x + 0.2, [rows[n]["p99_ms"] for n in names], 0.4, label="p99")
    right.set_xticks(x, [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    right.set_ylabel("latency per request (ms)")
    right.legend()
    fig.suptitle("Edge-cloud cascade on digits-LT (raw PNG bytes through the gateway)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wan-ms", type=float, default=20.0, help="delay added to each cloud answer")
    parser.add_argument(
        "--within", type=float, default=0.0, help="per-class target: cloud's balanced accuracy within this"
    )
    parser.add_argument("--repeat", type=int, default=2, help="passes over the test images per variant")
    parser.add_argument("--edge-width", type=int, default=128, help="the edge mlp's hidden width")
    parser.add_argument("--out", type=Path, default=Path("benchmarks"), help="where the JSON and plot go")
    args = parser.parse_args()
    wan_s = args.wan_ms / 1000
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cascade-bench-") as tmp:
        work = Path(tmp)
        data, edge, cloud = build_models(work, args.edge_width)
        for artifact, name in ((edge, EDGE), (cloud, CLOUD)):
            export_artifact(artifact, work / "repo", name, tensorrt="off")
        per_class, global_rule, doc = rules(work, data, edge, cloud, args.within)
        v = doc["validation"]
        print(
            f"rules on the validation split: per-class escalates {100 * v['cascade']['escalation_rate']:.1f}% "
            f"(balanced acc. {v['cascade']['balanced_accuracy']:.4f}; cloud {v['cloud']['balanced_accuracy']:.4f}, "
            f"edge {v['edge']['balanced_accuracy']:.4f}); global at the same rate"
        )
        images = [
            (p.read_bytes(), int(p.parent.name.rsplit("_", 1)[1]))
            for p in sorted((data / "test").glob("*/*.png"))
        ]
        triton, gateway, proxy = serve(
            work, (EDGE + RAW_SUFFIX, CLOUD + RAW_SUFFIX), per_class, global_rule, wan_s
        )
        try:
            results = {
                "edge only": drive(gateway.http, EDGE + RAW_SUFFIX, "edge", images, args.repeat),
                "cloud only": drive(gateway.http, CLOUD + RAW_SUFFIX, "cloud", images, args.repeat),
                "global cascade": drive(gateway.http, "digits-global", None, images, args.repeat),
                "per-class cascade": drive(gateway.http, "digits-per-class", None, images, args.repeat),
            }
            upstream = {
                "global cascade": upstream_bytes(gateway.ops, "digits-global"),
                "per-class cascade": upstream_bytes(gateway.ops, "digits-per-class"),
            }
        finally:
            gateway.stop()
            proxy.terminate()
            proxy.wait(10)
            triton.stop()
        truth = [label for _, label in images] * args.repeat
        report(results, truth, 10, upstream, wan_s, args.out)


if __name__ == "__main__":
    main()
