"""`skewserve demo` / `make demo`: the whole product end to end on the local default.

data synth -> torchrun training (2 ranks) -> export (FP32 + FP16 variant) -> two regions of real
tritonserver + the gateway -> tritonclient calls over HTTP and gRPC -> a locust load with hot keys
-> summary -> clean stop. Each step says what it does; a failing step stops the demo with its reason.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

T = TypeVar("T")


class DemoFailed(RuntimeError):
    pass


class Demo:
    def __init__(
        self,
        out: Path,
        repo: Path,
        console: Console,
        load_seconds: float = 20.0,
        epochs: int = 20,
        users: int = 4,
    ) -> None:
        self.out = out
        self.repo = repo
        self.console = console
        self.load_seconds = load_seconds
        self.epochs = epochs
        self.users = users
        self.n_steps = 9
        self.step_no = 0
        self.started = time.monotonic()

    def step(self, title: str, fn: Callable[[], T]) -> T:
        self.step_no += 1
        self.console.rule(f"[bold]step {self.step_no}/{self.n_steps}: {title}")
        t = time.monotonic()
        try:
            result = fn()
        except Exception as exc:
            raise DemoFailed(f"step {self.step_no} ({title}) failed: {exc}") from exc
        self.console.print(f"[green]done[/green] in {time.monotonic() - t:.1f}s")
        return result

    def run(self) -> dict[str, Any]:
        from skewserve.stack import LocalStack, StackConfig

        data = self.out / "data"
        artifact = self.out / "artifact"
        self.step(
            "generate a long-tailed data set (10 classes, imbalance ratio 100)", lambda: self._synth(data)
        )
        meta = self.step(
            f"train with 2 ranks via torchrun ({self.epochs} epochs, logit-adjusted loss)",
            lambda: self._train(data, artifact),
        )
        versions = self.step(
            "export to ONNX (FP32 + FP16 variant), check parity, publish to the model repository",
            lambda: self._export(artifact),
        )
        stack = LocalStack(
            StackConfig(
                repository=self.repo.resolve(),
                regions={"us-east": 1, "eu-west": 1},
                gateway={
                    "home_region": "us-east",
                    "listen": {"http_port": 0, "grpc_port": 0, "ops_port": 0},
                    "cache": {"backend": "memory", "models": ["longtail"]},
                    "health": {"interval_s": 0.5},
                },
            ),
            self.out / "logs",
        )
        try:
            self.step(
                "start 2 regions of tritonserver (CPU profile) and the gateway", lambda: self._start(stack)
            )
            self.step(
                "roll out the new versions: canary on every server, then promote (desired state)",
                lambda: self._rollout(stack, versions),
            )
            self.step(
                "classify test rows through the gateway with tritonclient (HTTP and gRPC)",
                lambda: self._calls(stack, data, meta),
            )
            load = self.step(
                f"locust: {self.load_seconds:.0f}s of Zipf hot-key traffic, 10% to the cold FP16 model",
                lambda: self._load(stack),
            )
            summary = self.step("summary", lambda: self._summary(stack, meta, load, versions))
        finally:
            self.step("stop the gateway and the servers", stack.stop)
        self.console.print(
            f"[bold green]demo finished in {time.monotonic() - self.started:.0f}s[/bold green]"
        )
        return summary

    # -- steps -------------------------------------------------------------------------------------
    def _synth(self, data: Path) -> None:
        from training.synth import SynthSpec, write

        spec = SynthSpec(n_classes=10, imbalance_ratio=100, seed=0)
        write(spec, data)
        self.console.print(f"training class sizes {spec.class_sizes()} -> {escape(str(data))}")

    def _train(self, data: Path, artifact: Path) -> dict[str, Any]:
        from training.config import TrainConfig
        from training.launch import train

        cfg = TrainConfig(
            data_dir=data, out_dir=artifact, nproc=2, epochs=self.epochs, patience=None, progress=True
        )
        meta = train(cfg)
        m = meta["metrics"]["test"]
        p = meta["provenance"]
        self.console.print(
            f"test balanced accuracy {m['balanced_accuracy']:.3f}, macro-F1 {m['macro_f1']:.3f}; "
            f"world size {p['world_size']}, rank imbalance {p['mean_imbalance_ratio']:.2f}"
        )
        return meta

    def _rollout(self, stack: Any, versions: dict[str, int]) -> None:
        """A published version serves only once rolled out (a model's first version serves at once)."""
        from controller.rollout import rollout
        from repository.disk_store import DiskStateStore

        store = DiskStateStore(self.repo.resolve())
        for name, version in versions.items():
            state = store.current(name)
            if state is not None and version in state.served:
                self.console.print(f"  {name} version {version}: the model's first version, served at once")
                continue
            result = rollout(
                store, name, version, stack.controller.servers, stack.control_key, stack.config.controller
            )
            for step in result.steps:
                self.console.print(f"  {step}")
            self.console.print(f"  {name} version {version} promoted")

    def _export(self, artifact: Path) -> dict[str, int]:
        from exporter.errors import ParityError
        from exporter.pipeline import export_artifact

        out = {}
        for name, precision in (("longtail", "fp32"), ("longtail_fp16", "fp16")):
            try:
                result = export_artifact(artifact, self.repo, name, precision=precision, tensorrt="auto")
            except ParityError as exc:
                if precision != "fp16":
                    raise
                # The gate working as meant: a model with near-tied classes flips arg-maxes in FP16.
                self.console.print(
                    f"  [yellow]{name}: the FP16 parity gate refused this model[/yellow] ({escape(str(exc))}); "
                    "publishing the cold model in FP32 instead"
                )
                result = export_artifact(artifact, self.repo, name, precision="fp32", tensorrt="auto")
            for r in result.parity:
                self.console.print(f"  {name}: parity {r.summary()}")
            for notice in result.notices:
                self.console.print(f"  [yellow]notice:[/yellow] {escape(notice)}")
            out[name] = result.published.version
            self.console.print(f"  published {name} version {result.published.version}")
        return out

    def _start(self, stack: Any) -> None:
        stack.start()
        for s in stack.fleet.servers:
            self.console.print(
                f"  tritonserver {s.spec.region}/{s.spec.name}: http {s.http_url} grpc {s.grpc_address}"
            )
        self.console.print(f"  gateway: http://{stack.gateway_http} grpc {stack.gateway_grpc} (home us-east)")

    def _calls(self, stack: Any, data: Path, meta: dict[str, Any]) -> None:
        import pandas as pd
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        test = pd.read_parquet(data / "test.parquet").groupby("label").head(1).head(6)
        x = test[meta["preprocessing"]["feature_names"]].to_numpy(dtype=np.float32)
        http = httpclient.InferenceServerClient(stack.gateway_http)
        inp = httpclient.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        top = http.infer(
            "longtail", [inp], outputs=[httpclient.InferRequestedOutput("probabilities", class_count=1)]
        ).as_numpy("probabilities")
        grpc = grpcclient.InferenceServerClient(stack.gateway_grpc)
        ginp = grpcclient.InferInput("features", list(x.shape), "FP32")
        ginp.set_data_from_numpy(x)
        labels = grpc.infer("longtail", [ginp]).as_numpy("label").ravel()
        table = Table(title="predictions through the gateway")
        for col in ("true class", "HTTP (classification ext.)", "score", "gRPC label"):
            table.add_column(col)
        for true, entry, label in zip(test["label"], top, labels, strict=True):
            score, _, name = entry[0].decode().split(":")
            table.add_row(true, name, f"{float(score):.3f}", meta["classes"][int(label)])
        self.console.print(table)

    def _load(self, stack: Any) -> Any:
        from loadtests.mix import MixSettings
        from loadtests.runner import LoadTestSpec, run_loadtest

        spec = LoadTestSpec(
            target=f"http://{stack.gateway_http}",
            protocol="http-binary",
            users=self.users,
            spawn_rate=self.users,
            duration_s=self.load_seconds,
            shape="steady",
            out_dir=self.out / "loadtest",
            metrics_url=f"http://{stack.gateway_ops}/metrics",
            mix=MixSettings(
                model="longtail",
                n_features=16,
                keys=500,
                zipf_s=1.1,
                cold_model="longtail_fp16",
                cold_fraction=0.1,
            ),
        )
        with self.console.status(f"locust running for {self.load_seconds:.0f}s"):
            return run_loadtest(spec)

    def _summary(
        self, stack: Any, meta: dict[str, Any], load: Any, versions: dict[str, int]
    ) -> dict[str, Any]:
        import urllib.request

        table = Table(title="load test through the gateway")
        for col in ("request", "requests", "failures", "rps", "p50 ms", "p95 ms", "p99 ms"):
            table.add_column(col, justify="left" if col == "request" else "right")
        for r in [*load.rows, load.total]:
            table.add_row(
                r.name,
                str(r.requests),
                str(r.failures),
                f"{r.rps:.0f}",
                f"{r.p50_ms:.1f}",
                f"{r.p95_ms:.1f}",
                f"{r.p99_ms:.1f}",
            )
        self.console.print(table)
        with urllib.request.urlopen(f"http://{stack.gateway_ops}/admin/upstreams", timeout=5) as resp:
            admin = json.loads(resp.read())
        hit = load.cache_hit_rate
        self.console.print(
            f"gateway cache hit rate {100 * hit:.1f}% (hot model), spill-overs {load.spillovers:.0f}, "
            f"skew index {admin['skew_index']}"
        )
        metrics = json.loads((self.out / "artifact" / "metrics.json").read_text())["test"]
        recall = Table(title="per-class recall of the model (test split, class-balanced)")
        recall.add_column("class")
        recall.add_column("training rows", justify="right")
        recall.add_column("recall", justify="right")
        for name, count in zip(meta["classes"], meta["class_counts"], strict=True):
            recall.add_row(name, str(count), f"{metrics['per_class'][name]['recall']:.3f}")
        self.console.print(recall)
        self.console.print(
            f"report: {escape(str(load.files['html']))}, latency plot: {escape(str(load.files['png']))}"
        )
        return {
            "requests": load.total.requests,
            "failures": load.total.failures,
            "cache_hit_rate": hit,
            "spillovers": load.spillovers,
            "p99_ms": load.total.p99_ms,
            "versions": versions,
            "balanced_accuracy": metrics["balanced_accuracy"],
        }
