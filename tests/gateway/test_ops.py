"""The ops listener (admin, metrics), admin keys, request ids, taken ports, keys never in logs.

All against real gateway processes (and a real Triton fleet where a request must be served).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from gateway.state.auth import hash_key
from skewserve.ports import free_port
from tests.gateway.conftest import gateway_config

ADMIN_KEY = "sk-ops-admin-5d1e7b93c4"
USER_KEY = "sk-ops-user-8a2f60d1e7"
WRONG_KEY = "sk-ops-wrong-3c9b14f2a6"


def _get(url: str, **headers: str) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _auth() -> dict:
    return {
        "keys": [
            {"name": "ops", "sha256": hash_key(ADMIN_KEY), "admin": True},
            {"name": "user", "sha256": hash_key(USER_KEY), "models": ["lt_nocache"]},
        ]
    }


@pytest.fixture()
def secured(fleet, make_gateway):
    return make_gateway(gateway_config(fleet, auth=_auth()))


@pytest.mark.parametrize("path", ["/admin/upstreams", "/metrics"])
def test_admin_and_metrics_are_not_on_the_public_port(secured, path: str) -> None:
    for headers in ({}, {"authorization": f"Bearer {USER_KEY}"}):
        status, body = _get(f"http://{secured.http}{path}", **headers)
        assert status in (403, 404), (status, body)
        assert set(json.loads(body)) == {"error"}
    status, body = _get(f"http://{secured.http}{path}")
    assert status == 404
    assert json.loads(body)["error"] == (
        f"{path} is not served on the public port: read it on the ops listener (listen.ops_port) "
        "or send an admin API key (auth.keys[].admin)"
    )
    status, body = _get(f"http://{secured.http}{path}", authorization=f"Bearer {USER_KEY}")
    assert (status, json.loads(body)["error"]) == (
        403,
        "API key 'user' is not an admin key (auth.keys[].admin)",
    )
    status, body = _get(f"http://{secured.http}{path}", **{"x-api-key": WRONG_KEY})
    assert (status, json.loads(body)["error"]) == (401, "invalid API key")
    # An admin-scoped key may read them on the public port; anyone may on the ops listener.
    status, public = _get(f"http://{secured.http}{path}", authorization=f"Bearer {ADMIN_KEY}")
    assert status == 200
    status, ops = _get(f"http://{secured.ops}{path}")
    assert status == 200
    if path == "/admin/upstreams":
        assert json.loads(public)["home_region"] == json.loads(ops)["home_region"] == "us-east"
    else:
        assert b"skewserve_gateway_upstream_available" in public and b"skewserve_gateway_" in ops


def test_public_port_answers_404_for_admin_and_metrics_with_keys_configured(fleet, make_gateway) -> None:
    """Only settings that existed before the ops listener: keys on, and nobody reads the fleet view."""
    auth = {"keys": [{"name": "user", "sha256": hash_key(USER_KEY)}]}
    gw = make_gateway(gateway_config(fleet, auth=auth))
    for path in ("/admin/upstreams", "/metrics", "/v2/models/stats"):
        status, body = _get(f"http://{gw.http}{path}")
        assert status in (401, 404), (path, status, body[:200])
        assert set(json.loads(body)) == {"error"}


def test_ops_listener_uses_the_configured_host_and_port(fleet, make_gateway) -> None:
    port = free_port()
    gw = make_gateway(gateway_config(fleet, listen={"ops_port": port, "ops_host": "127.0.0.1"}))
    assert gw.ops == f"127.0.0.1:{port}"
    status, body = _get(f"http://127.0.0.1:{port}/admin/upstreams")
    assert status == 200 and len(json.loads(body)["servers"]) == 4
    status, _ = _get(f"http://127.0.0.1:{port}/v2/health/ready")
    assert status == 200
    # The ops listener serves nothing else: no inference, no Triton APIs.
    status, body = _get(f"http://127.0.0.1:{port}/v2/models/lt")
    assert status == 404 and "ops listener" in json.loads(body)["error"]


def _infer_request(request_id: str = "") -> bytes:
    req = pb.ModelInferRequest(model_name="lt_nocache", id=request_id)
    inp = req.inputs.add(name="features", datatype="FP32", shape=[1, 8])
    inp.contents.fp32_contents.extend([0.5] * 8)
    return req.SerializeToString()


def _infer_call(channel: grpc.Channel):
    return channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=None,
        response_deserializer=pb.ModelInferResponse.FromString,
    )


def test_invalid_grpc_request_id_metadata_is_invalid_argument_not_internal(shared_gateway) -> None:
    with grpc.insecure_channel(shared_gateway.grpc) as channel:
        call = _infer_call(channel)
        with pytest.raises(grpc.RpcError) as info:
            call(_infer_request(), metadata=(("x-request-id", "x" * 5000),), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(
            "x-request-id must be 1-128 printable ASCII characters, got 5000 characters starting 'xxxx"
        )
        resp = call(_infer_request(), metadata=(("x-request-id", "req-42"),), timeout=10)
        assert resp.model_name == "lt_nocache"


@pytest.mark.parametrize(
    "odd_id",
    ["x" * 5000, "tab\there", "line\nbreak", "caf\u00e9"],
    ids=["huge", "tab", "newline", "non-ascii"],
)
def test_odd_protobuf_request_id_is_served_and_echoed_not_internal(shared_gateway, odd_id: str) -> None:
    """Triton echoes whatever the request's own `id` holds; the gateway must not fail on it."""
    with grpc.insecure_channel(shared_gateway.grpc) as channel:
        resp = _infer_call(channel)(_infer_request(odd_id), timeout=10)
    assert resp.id == odd_id and resp.model_name == "lt_nocache"


def test_invalid_request_id_on_metadata_calls_is_invalid_argument(shared_gateway) -> None:
    client = grpcclient.InferenceServerClient(shared_gateway.grpc)
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("lt", headers={"x-request-id": "y" * 5000})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "x-request-id" in info.value.message()
    assert client.get_model_metadata("lt", headers={"x-request-id": "ok-1"}).name == "lt"


def _write_config(tmp_path: Path, listen: dict, **extra: object) -> Path:
    cfg = {
        "home_region": "r",
        "listen": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "ops_port": 0, **listen},
        "regions": [{"name": "r", "servers": [{"name": "s", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]}],
        **extra,
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    ("field", "command"),
    [
        ("http_port", ["-m", "gateway"]),
        ("grpc_port", ["-m", "gateway"]),
        ("ops_port", ["-m", "gateway"]),
        ("grpc_port", ["-m", "skewserve", "gateway"]),
    ],
)
def test_a_taken_port_fails_with_one_clear_line(tmp_path: Path, field: str, command: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = _write_config(tmp_path, {field: port}, log_json=False)
        res = subprocess.run(
            [sys.executable, *command, "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    out = (res.stdout + res.stderr).strip()
    assert res.returncode == 1, out
    assert "Traceback" not in out
    assert out.splitlines() == [
        f"error: listen.{field} 127.0.0.1:{port} is already in use; stop what holds it or choose another listen.{field}"
    ]


def test_log_level_reaches_the_logs(tmp_path: Path) -> None:
    """log_level: debug turns on DEBUG records (so the keys test below really runs with them)."""
    path = _write_config(tmp_path, {}, log_level="debug", log_json=True)
    ready = tmp_path / "ready.json"
    log = tmp_path / "gw.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--config", str(path), "--ready-file", str(ready)],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        from tests.gateway.conftest import wait_until

        wait_until(lambda: ready.exists() and bool(ready.read_text().strip()), 60, "the ready file")
        ports = json.loads(ready.read_text())
        assert {"http_port", "grpc_port", "ops_port"} <= set(ports) and ports["ops_port"] > 0
    finally:
        proc.send_signal(2)
        proc.wait(30)
    levels = {json.loads(line)["level"] for line in log.read_text().splitlines() if line.startswith("{")}
    assert "debug" in levels, log.read_text()[-2000:]


def test_keys_never_appear_in_debug_logs(fleet, make_gateway) -> None:
    gw = make_gateway(gateway_config(fleet, auth=_auth(), log_level="debug"))
    x = np.zeros((1, 8), np.float32)
    http = httpclient.InferenceServerClient(gw.http)
    h_inp = httpclient.InferInput("features", [1, 8], "FP32")
    h_inp.set_data_from_numpy(x)
    g = grpcclient.InferenceServerClient(gw.grpc)
    g_inp = grpcclient.InferInput("features", [1, 8], "FP32")
    g_inp.set_data_from_numpy(x)
    for key in (ADMIN_KEY, USER_KEY, WRONG_KEY):
        for headers in ({"authorization": f"Bearer {key}"}, {"x-api-key": key}):
            calls = (
                (http.infer, ("lt_nocache", [h_inp])),
                (http.infer, ("lt", [h_inp])),
                (http.get_model_metadata, ("lt",)),
                (http.get_inference_statistics, ("lt",)),
                (g.infer, ("lt_nocache", [g_inp])),
                (g.get_model_metadata, ("lt",)),
                (g.get_inference_statistics, ("lt",)),
            )
            for fn, args in calls:
                try:
                    fn(*args, headers=dict(headers))  # type: ignore[operator]  # http's client adds to it
                except InferenceServerException:
                    pass  # wrong keys and forbidden models fail; the log is what is checked
            _get(f"http://{gw.http}/metrics", **headers)
            _get(f"http://{gw.http}/admin/upstreams", **headers)
    gw.stop()
    log = gw.log_path.read_text()
    assert '"level": "debug"' in log  # the run really logged at DEBUG
    for secret in (ADMIN_KEY, USER_KEY, WRONG_KEY):
        assert secret not in log


@pytest.mark.parametrize("method", ["ModelMetadata", "ModelConfig", "ModelReady", "ModelStatistics"])
def test_malformed_grpc_request_messages_are_invalid_argument(shared_gateway, method: str) -> None:
    with grpc.insecure_channel(shared_gateway.grpc) as channel:
        call = channel.unary_unary(
            f"/inference.GRPCInferenceService/{method}", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"malformed {method}Request: ")


def test_listen_ports_must_differ_and_key_names_be_unique() -> None:
    from gateway.config import ConfigError, load_gateway_config

    regions = [{"name": "r", "servers": [{"name": "s", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]}]
    with pytest.raises(ConfigError, match="listen: listen ports must differ"):
        load_gateway_config(home_region="r", regions=regions, listen={"http_port": 9000, "ops_port": 9000})
    # 0 = a free port each: several zeros are fine.
    cfg = load_gateway_config(
        home_region="r", regions=regions, listen={"http_port": 0, "grpc_port": 0, "ops_port": 0}
    )
    assert cfg.listen.ops_port == 0 and cfg.listen.ops_host == "127.0.0.1"
    keys = [{"name": "a", "sha256": hash_key("k1")}, {"name": "a", "sha256": hash_key("k2"), "admin": True}]
    with pytest.raises(ConfigError, match=r"auth.keys: key names must be unique, got \['a', 'a'\]"):
        load_gateway_config(home_region="r", regions=regions, auth={"keys": keys})
