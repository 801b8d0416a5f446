"""Traffic shares and shadow traffic through the real gateway, on real tritonservers run by the
controller: a canary's share holds per client and over many clients and is promoted once its
traffic gate passes; shadow traffic is stratified by class and its answers never reach a client; a
shadow that disagrees on a class fails the gate and every server goes back to the served version."""

from __future__ import annotations

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controller.desired_state import DesiredState, TrafficGate
from controller.fleet import FleetSpec
from controller.rollout import rollback, rollout
from controller.runner import ControllerThread
from controller.state_store import DiskStateStore
from exporter.pipeline import export_artifact
from gateway.config import RegionConfig, ServerConfig
from gateway.traffic import Traffic
from skewserve.triton_dist import PreparedTriton
from tests.controller.conftest import CFG, KEY, as_controlled, controlled_server, loaded
from tests.gateway.conftest import gateway_config, launch_gateway
from tests.waiting import wait_until

SHARE = 0.3
LENIENT = {"max_p99_ratio": 100.0, "max_error_rate": 0.05}  # a shared machine's latency is not the point


def _infer(http: str, rows: np.ndarray, client: str) -> dict[str, Any]:
    body = json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "shape": list(rows.shape),
                    "datatype": "FP32",
                    "data": rows.ravel().tolist(),
                }
            ]
        }
    ).encode()
    req = urllib.request.Request(
        f"http://{http}/v2/models/lt/infer",
        body,
        {"Content-Type": "application/json", "x-skewserve-client": client},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _direct(http: str, version: int, rows: np.ndarray) -> np.ndarray:
    """The version's own answers, asked of a server directly (not through the gateway)."""
    body = json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "shape": list(rows.shape),
                    "datatype": "FP32",
                    "data": rows.ravel().tolist(),
                }
            ]
        }
    ).encode()
    req = urllib.request.Request(
        f"http://{http}/v2/models/lt/versions/{version}/infer", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def _skewed_stream(
    http: str, data: Path, version: int, n_per_rank: list[int], seed: int
) -> list[tuple[np.ndarray, int]]:
    """Single-row requests of held-out rows whose stable answers follow a long tail: the most
    frequent predicted class gets n_per_rank[0] requests, the next n_per_rank[1], and so on."""
    import pandas as pd

    frame = pd.concat([pd.read_parquet(data / f"{split}.parquet") for split in ("val", "test")])
    pool = frame[[c for c in frame.columns if c != "label"]].to_numpy(np.float32)
    classes = np.concatenate(
        [_direct(http, version, pool[i : i + 64]).argmax(1) for i in range(0, len(pool), 64)]
    )
    by_class = sorted({int(c) for c in classes}, key=lambda c: -(classes == c).sum())
    assert len(by_class) >= len(n_per_rank), f"the model predicts only classes {by_class}"
    stream: list[tuple[np.ndarray, int]] = []
    for rank, cls in enumerate(by_class[: len(n_per_rank)]):
        rows = pool[classes == cls]
        stream += [(rows[i % len(rows)][None, :], cls) for i in range(n_per_rank[rank])]
    random.Random(seed).shuffle(stream)
    return stream


def _grpc_versions(address: str, rows: np.ndarray) -> tuple[str, str]:
    """The version answering an unversioned gRPC ModelInfer, and a ModelStreamInfer message."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(address)
    try:
        inp = grpcclient.InferInput("features", list(rows.shape), "FP32")
        inp.set_data_from_numpy(rows)
        unary = client.infer("lt", [inp]).get_response().model_version
        results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("lt", [inp])
        result, error = results.get(timeout=60)
        client.stop_stream()
        assert error is None, error
        return unary, result.get_response().model_version
    finally:
        client.close()


@pytest.mark.slow
def test_canary_share_shadow_traffic_and_the_traffic_gate(
    small_artifact: Path, small_data: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    from training.config import TrainConfig
    from training.launch import train

    repo, logs = tmp_path / "repo", tmp_path / "logs"
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    store = DiskStateStore(repo)
    servers = [controlled_server(repo, n, logs, prepared_triton) for n in ("a", "b")]
    thread = gw = None
    try:
        for s in servers:
            s.start()
        fleet = FleetSpec(
            [
                RegionConfig(
                    name="r",
                    servers=[
                        ServerConfig(name=s.spec.name, http=s.http_address, grpc=s.grpc_address)
                        for s in servers
                    ],
                )
            ]
        )
        thread = ControllerThread(fleet, store, KEY, CFG).start()
        port = thread.serve_demand("127.0.0.1", 0)
        assert thread.wait_first_pass(120)
        gw = launch_gateway(
            gateway_config(
                {"r": servers},
                home="r",
                cache={"models": []},
                traffic={
                    "controller_url": f"http://127.0.0.1:{port}",
                    "poll_s": 0.2,
                    "shadow_max_inflight": 64,
                },
            ),
            tmp_path / "gw",
        )
        wait_until(lambda: all(s["models"] for s in gw.admin()["servers"]), 60, "the gateway sees lt")

        def plan_followed(version: int) -> bool:
            plans = (gw.admin().get("traffic") or {}).get("models", {})
            listed = all(str(version) in s["models"].get("lt", []) for s in gw.admin()["servers"])
            return plans.get("lt", {}).get("canary") == str(version) and listed

        # -- a canary share, sticky per client key, then promoted by its gate --------------------
        export_artifact(small_artifact, repo, "lt", tensorrt="off")
        gate = TrafficGate(min_requests=100, min_per_class=1, max_wait_s=1, **LENIENT)
        result = rollout(store, "lt", 2, as_controlled(servers), KEY, CFG, share=SHARE, gate=gate)
        assert result.observing and result.state.served == [1]
        wait_until(lambda: plan_followed(2), 60, "the gateway follows the canary's plan")
        rows = np.full((1, 8), 0.25, dtype=np.float32)
        clients = [f"client-{i}" for i in range(120)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda c: (c, _infer(gw.http, rows, c)["model_version"]), clients * 2))
        seen: dict[str, set[str]] = {}
        for client, version in answers:
            seen.setdefault(client, set()).add(version)
        assert all(len(v) == 1 for v in seen.values()), "a client moved between versions"
        on_canary = {c for c, v in seen.items() if v == {"2"}}
        assert on_canary == {c for c in clients if Traffic.bucket("lt", c) < SHARE}
        assert 0.15 < len(on_canary) / len(clients) < 0.45

        def promoted() -> bool:
            for c in clients[:20]:
                _infer(gw.http, rows, c)
            state = store.current("lt")
            return state is not None and state.served == [2]

        wait_until(promoted, 120, "the canary promoted once its gate passed")
        assert store.current("lt").versions[1].state == "retired"  # type: ignore[union-attr]

        # -- shadow traffic, stratified by class; its answers never reach a client --------------
        export_artifact(small_artifact, repo, "lt", tensorrt="off")  # version 3: agrees with 2
        waiting = TrafficGate(min_requests=10**6, min_per_class=10**6, max_wait_s=10**6, **LENIENT)
        rollout(store, "lt", 3, as_controlled(servers), KEY, CFG, shadow=0.15, gate=waiting)
        wait_until(lambda: plan_followed(3), 60, "the gateway follows the shadow's plan")
        stream = _skewed_stream(servers[0].http_address, small_data, 2, [300, 60, 20, 8], seed=1)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda item: _infer(gw.http, item[0], "shadowed"), stream))
        assert {g["model_version"] for g in got} == {"2"}
        assert _grpc_versions(gw.grpc, stream[0][0]) == ("2", "2")  # unary and stream pinned too
        state = store.current("lt")
        assert state is not None and state.canary is not None
        tally = thread.controller.traffic.total("lt", 3, state.canary.started)

        def reported() -> bool:
            nonlocal tally
            tally = thread.controller.traffic.total("lt", 3, state.canary.started)  # type: ignore[union-attr]
            classified = sum(c.seen for c in tally.classes.values()) + tally.skipped
            return classified == len(stream) and sum(
                line.startswith("skewserve_gateway_shadow_answers_total{") and 'version="3"' in line
                for line in gw.metrics().splitlines()
            ) == 3 * len(tally.classes)

        try:
            wait_until(reported, 60, "every answer classified and reported to the controller")
        except AssertionError as exc:
            shadow_lines = [line for line in gw.metrics().splitlines() if "shadow" in line]
            raise AssertionError(f"{exc}: {len(stream)} requests, {tally}, {shadow_lines}") from exc
        rarest = min(tally.classes.values(), key=lambda c: c.seen)
        # uniform sampling at the same share mirrors 15% of each class; stratified, the rare ones whole
        assert rarest.mirrored >= 3 * 0.15 * rarest.seen, tally.classes
        assert all(c.disagree == 0 and c.error == 0 for c in tally.classes.values()), tally.classes
        mirrored = sum(c.mirrored for c in tally.classes.values())
        assert mirrored <= 0.15 * len(stream) * 1.6  # the share bounds the extra load
        rollback(store, "lt", 2, as_controlled(servers), KEY, CFG)
        wait_until(lambda: "lt" not in gw.admin()["traffic"]["models"], 30, "the shadow ends")

        # -- a shadow that disagrees fails its gate; clients only ever see the stable answers ----
        weak = tmp_path / "weak"
        train(TrainConfig(data_dir=small_data, out_dir=weak, epochs=1, width=2, seed=5, progress=False))
        export_artifact(weak, repo, "lt", tensorrt="off")
        version = max(store.current("lt").versions)  # type: ignore[union-attr]
        strict = TrafficGate(min_requests=10, min_per_class=5, agreement=0.99, max_wait_s=600, **LENIENT)
        rollout(store, "lt", version, as_controlled(servers), KEY, CFG, shadow=1.0, gate=strict)
        wait_until(lambda: plan_followed(version), 60, "the gateway follows the weak shadow's plan")
        stream = _skewed_stream(servers[0].http_address, small_data, 2, [60, 40, 30, 20], seed=2)
        want = {i: _direct(servers[0].http_address, 2, x) for i, (x, _) in enumerate(stream[:40])}

        def failed() -> bool:
            for i, (x, _) in enumerate(stream[:40]):
                answer = _infer(gw.http, x, "weak")
                assert answer["model_version"] == "2"
                assert np.allclose(np.asarray(answer["outputs"][0]["data"]), want[i].ravel())
            now: DesiredState | None = store.current("lt")
            return now is not None and now.versions[version].state == "failed"

        wait_until(failed, 120, "the disagreeing shadow failed its gate")
        final = store.current("lt")
        assert final is not None and final.served == [2] and final.canary is None
        assert "traffic gate: shadow agrees with the stable version on" in final.versions[version].reason
        wait_until(lambda: all(loaded(s) == {"lt": [2]} for s in servers), 60, "servers back on version 2")
    finally:
        if gw is not None:
            gw.stop()
        if thread is not None:
            thread.stop()
        for s in servers:
            s.stop()
