"""Issue 24, protocol parity: the same request sent directly to a real Triton and through the
gateway gets the same answer (status and body), so a Triton client works with only its URL changed."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, launch_gateway, start_fleet, stop_fleet

pytestmark = pytest.mark.slow
ROW = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)


@pytest.fixture(scope="module")
def gw(one_triton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayUnderTest]:
    g = launch_gateway(gateway_config(one_triton), tmp_path_factory.mktemp("parity_gw"))
    yield g
    g.stop()


def _send(
    address: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(address, timeout=30)
    try:
        conn.request(method, path, body if method == "POST" else None, headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _both(
    one_triton,
    gw: GatewayUnderTest,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[tuple[int, bytes], tuple[int, bytes]]:
    triton = one_triton["us-east"][0]
    return _send(triton.http_address, method, path, body, headers), _send(
        gw.http, method, path, body, headers
    )


@pytest.mark.parametrize("model", ["lt", "lt_nocache"])  # cached and uncached
def test_a_raw_binary_body_without_a_json_header_is_served_as_triton_serves_it(
    one_triton, gw, model: str
) -> None:
    """`Inference-Header-Content-Length: 0`: the whole body is the one input's tensor (Triton's
    raw binary request); the answer is Triton's, byte for byte."""
    headers = {"inference-header-content-length": "0", "content-type": "application/octet-stream"}
    direct, via = _both(one_triton, gw, "POST", f"/v2/models/{model}/infer", ROW.tobytes(), headers)
    assert via == direct, (direct[0], direct[1][:200], via[0], via[1][:200])


@pytest.mark.parametrize("version", ["x", "-1", "01", "1.0"])
def test_an_invalid_version_string_gets_tritons_status(one_triton, gw, version: str) -> None:
    body = json.dumps(
        {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": ROW.ravel().tolist()}]}
    ).encode()
    direct, via = _both(one_triton, gw, "POST", f"/v2/models/lt_nocache/versions/{version}/infer", body)
    assert via[0] == direct[0], (direct, via)  # "01" is version 1 (200); the others match no route (404)
    if direct[0] == 200:
        assert json.loads(via[1])["outputs"] == json.loads(direct[1])["outputs"]
    else:
        assert "is not a version" in json.loads(via[1])["error"]  # ours names the value


def test_a_method_the_gateway_does_not_serve_is_refused_at_once_by_name(gw) -> None:
    """A method refused by design (model control), its request held open as a stream client would
    hold it: UNIMPLEMENTED naming the method while the request is still open, not a wait for the
    body timer."""
    import asyncio

    import grpc.aio
    from tritonclient.grpc import service_pb2 as pb

    async def main() -> tuple[grpc.StatusCode, str]:
        release = asyncio.Event()
        req = pb.ModelInferRequest(model_name="lt_nocache")

        async def requests() -> object:
            # Headers only, the stream held open: the refusal must come from them. (A message written
            # after the refusal arrived would fail in grpcio itself, as "Internal error from Core",
            # hiding the status: seen under load.)
            await release.wait()
            yield req.SerializeToString()

        async with grpc.aio.insecure_channel(gw.grpc) as channel:
            call = channel.stream_stream("/inference.GRPCInferenceService/RepositoryModelLoad")(
                requests(), timeout=120
            )
            try:
                async for _ in call:
                    pass
                raise AssertionError("the stream was served")
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or ""
            finally:
                release.set()

    code, details = asyncio.run(asyncio.wait_for(main(), 60))
    assert (code, details) == (
        grpc.StatusCode.UNIMPLEMENTED,
        "Method not found: /inference.GRPCInferenceService/RepositoryModelLoad",
    )


# -- item 5: a client's own deadline is kept whole; slow models get their own ------------------------------
SLOW_S = 1.5  # the `slow` model's sleep: above the gateway's default deadline below


@pytest.fixture(scope="module")
def slow_triton(
    gateway_repo: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[dict[str, list[TritonServer]]]:
    from tests.gateway.test_hostile_health import hostile_repo

    repo = hostile_repo(gateway_repo, tmp_path_factory.mktemp("slow_repo"), slow_s=SLOW_S)
    f = start_fleet(repo, {"us-east": 1}, tmp_path_factory.mktemp("slow_logs"), prepared_triton)
    yield f
    stop_fleet(f)


def _slow_infer(
    address: str, headers: dict[str, str] | None = None, parameters: dict[str, object] | None = None
) -> int:
    body: dict[str, object] = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4}]
    }
    if parameters:
        body["parameters"] = parameters
    return _send(address, "POST", "/v2/models/slow/infer", json.dumps(body).encode(), headers)[0]


def test_a_clients_own_deadline_is_kept_whole_and_slow_models_get_their_own(
    slow_triton, make_gateway
) -> None:
    """Default deadline 1 s, attempts cut at 0.5 s, a model that takes 1.5 s: directly it answers;
    through the gateway it answers whenever the client (or the model's configured deadline) allows
    that long, and times out only when nobody does."""
    triton = slow_triton["us-east"][0]
    assert _slow_infer(triton.http_address) == 200
    retries = {"default_timeout_s": 1.0, "attempt_timeout_s": 0.5, "max_attempts": 2}
    gw = make_gateway(gateway_config(slow_triton, cache={"backend": "none"}, retries=retries))
    assert _slow_infer(gw.http) == 504  # nobody allowed 1.5 s
    assert _slow_infer(gw.http, {"x-skewserve-timeout-ms": "20000"}) == 200  # the header's 20 s
    assert _slow_infer(gw.http, parameters={"timeout": 20_000_000}) == 200  # Triton's parameter, µs
    per_model = make_gateway(
        gateway_config(
            slow_triton, cache={"backend": "none"}, retries={**retries, "model_timeout_s": {"slow": 20.0}}
        )
    )
    assert _slow_infer(per_model.http) == 200


# -- item 4: headers forwarded to the model, as Triton's --http/grpc-header-forward-pattern do ---------------
ECHO_CONFIG = """
name: "echo_params"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
ECHO_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        # Triton adds forwarded headers to a request's parameters: answer with them.
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", np.array([r.parameters().encode()], dtype=np.object_))]
            )
            for r in requests
        ]
"""
PATTERN = ".*"  # Triton passes on every header: whatever reaches the model, the gateway let through


@pytest.fixture(scope="module")
def echo_triton(
    tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[dict[str, list[TritonServer]]]:
    repo = tmp_path_factory.mktemp("echo_repo")
    (repo / "echo_params" / "1").mkdir(parents=True)
    (repo / "echo_params" / "1" / "model.py").write_text(ECHO_PY)
    for config in (repo / "echo_params" / "config.pbtxt", repo / "echo_params" / "configs" / "local.pbtxt"):
        config.parent.mkdir(exist_ok=True)
        config.write_text(ECHO_CONFIG)
    forward = ("--http-header-forward-pattern", PATTERN, "--grpc-header-forward-pattern", PATTERN)
    f = start_fleet(
        repo, {"us-east": 1}, tmp_path_factory.mktemp("echo_logs"), prepared_triton, extra_args=forward
    )
    yield f
    stop_fleet(f)


def _echoed_http(address: str, headers: dict[str, str]) -> dict[str, object]:
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [0.0] * 4}]})
    status, answer = _send(address, "POST", "/v2/models/echo_params/infer", body.encode(), headers)
    assert status == 200, answer
    return json.loads(json.loads(answer)["outputs"][0]["data"][0])  # type: ignore[no-any-return]


def _echoed_grpc(address: str, metadata: tuple[tuple[str, str], ...]) -> dict[str, object]:
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name="echo_params")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[4]).contents.fp32_contents.extend([0.0] * 4)
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        answer = call(req, timeout=30, metadata=metadata)
    raw = answer.raw_output_contents[0]
    return json.loads(raw[4 : 4 + int.from_bytes(raw[:4], "little")])  # type: ignore[no-any-return]


def test_headers_matching_the_forward_pattern_reach_the_model_and_keys_never_do(
    echo_triton, make_gateway
) -> None:
    from gateway.state.auth import hash_key

    key = "sk-forward-test-key-0123456789"
    triton = echo_triton["us-east"][0]
    sent = {"x-tenant-id": "acme", "x-other": "kept", "authorization": f"Bearer {key}"}
    direct = _lowered(_echoed_http(triton.http_address, sent))
    # This Triton shows the model every header, keys too: only the gateway can keep them back.
    assert (direct.get("x-tenant-id"), direct.get("authorization")) == ("acme", f"Bearer {key}")
    keys = {"keys": [{"name": "k", "sha256": hash_key(key)}]}
    cache = {"backend": "memory", "models": ["echo_params"]}
    plain = make_gateway(gateway_config(echo_triton, cache=cache, auth=keys))
    assert not {"x-tenant-id", "x-other", "authorization"} & set(_lowered(_echoed_http(plain.http, sent)))
    everything = make_gateway(
        gateway_config(echo_triton, cache=cache, auth=keys, routing={"header_forward_pattern": ".*"})
    )
    via = _lowered(_echoed_http(everything.http, sent))
    assert (via.get("x-tenant-id"), via.get("x-other")) == ("acme", "kept")
    assert "authorization" not in via
    by_api_key = _lowered(_echoed_http(everything.http, {"x-tenant-id": "acme", "x-api-key": key}))
    assert "x-api-key" not in by_api_key and by_api_key.get("x-tenant-id") == "acme"
    # Another tenant's value is its own answer, never a cache hit of the first.
    assert _echoed_http(everything.http, {**sent, "x-tenant-id": "globex"}).get("x-tenant-id") == "globex"
    grpc_via = _echoed_grpc(everything.grpc, (("x-tenant-id", "acme"), ("authorization", f"Bearer {key}")))
    assert grpc_via.get("x-tenant-id") == "acme" and "authorization" not in grpc_via


def _lowered(echoed: dict[str, object]) -> dict[str, object]:
    return {k.lower(): v for k, v in echoed.items()}


# Hop-by-hop headers (RFC 9110 7.6.1) and the gateway's own: never the model's to see.
HOP_BY_HOP = {
    "expect": "100-continue",
    "keep-alive": "timeout=5",
    "te": "trailers",
    "trailer": "x-checksum",
    "proxy-authorization": "Basic c2VjcmV0OnNlY3JldA==",
    "proxy-connection": "keep-alive",
    "x-skewserve-peer": "10.9.9.9",
    "x-skewserve-target-ip": "127.0.0.1",
    "x-skewserve-target-port": "1",
    "x-skewserve-client": "someone-else",
    "x-skewserve-server": "us-east-0",
}


def test_hop_by_hop_and_the_gateways_own_headers_never_reach_the_model(echo_triton, make_gateway) -> None:
    gw = make_gateway(
        gateway_config(
            echo_triton,
            cache={"backend": "memory", "models": ["echo_params"]},
            routing={"header_forward_pattern": ".*"},
        )
    )
    seen = _lowered(_echoed_http(gw.http, {"x-tenant-id": "acme", **HOP_BY_HOP}))
    assert seen.get("x-tenant-id") == "acme"
    assert sorted(set(HOP_BY_HOP) & set(seen)) == []
    assert [k for k in seen if k.startswith("x-skewserve-")] == []
    # HTTP/2 itself refuses connection-specific fields (RFC 9113 8.2.2): only these can be metadata.
    metadata = tuple((k, v) for k, v in HOP_BY_HOP.items() if k.startswith(("x-", "proxy-auth")))
    seen_grpc = _lowered(_echoed_grpc(gw.grpc, (("x-tenant-id", "acme"), *metadata)))
    assert seen_grpc.get("x-tenant-id") == "acme"
    assert sorted(k for k in seen_grpc if k.startswith(("x-skewserve-", "proxy-"))) == []


def test_an_expect_header_never_hands_one_callers_answer_to_another(echo_triton, make_gateway) -> None:
    """Issue 40 item 1: `Expect: 100-continue` passed on made Triton answer `100 Continue` first;
    the gateway took it for the answer and left the real one on the pooled connection, where the
    next caller read it (and the cache kept it). Every caller must read its own answer."""
    gw = make_gateway(
        gateway_config(
            echo_triton,
            cache={"backend": "memory", "models": ["echo_params"]},
            routing={"header_forward_pattern": ".*"},
        )
    )
    for i in range(10):
        attacker = _echoed_http(gw.http, {"x-tenant-id": f"attacker-{i}", "expect": "100-continue"})
        assert attacker.get("x-tenant-id") == f"attacker-{i}"
        victim = _echoed_http(gw.http, {"x-tenant-id": f"victim-{i}"})
        assert victim.get("x-tenant-id") == f"victim-{i}", (i, victim)


def _grpc_code(address: str, metadata: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    import grpc

    try:
        _echoed_grpc(address, metadata)
        return "OK", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""  # type: ignore[attr-defined]


def test_forwarded_headers_triton_could_not_read_are_the_callers_error_never_a_servers(
    echo_triton, make_gateway
) -> None:
    """Issue 40, item 4: forwarded headers that HAProxy or Triton would refuse (more than 4 KiB of
    them) are the caller's INVALID_ARGUMENT / 400 naming the limit, and the server stays in rotation
    (a value that is not ASCII: tests/gateway/test_state_units.py, grpcio clients cannot send one)."""
    gw = make_gateway(
        gateway_config(
            echo_triton,
            cache={"backend": "memory", "models": ["echo_params"]},
            routing={"header_forward_pattern": ".*"},
            health={"interval_s": 0.2, "timeout_s": 1.0, "eject_after_failures": 1, "base_ejection_s": 60},
        )
    )
    many = {f"x-tenant-{i}": "v" * 250 for i in range(20)}
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [0.0] * 4}]})
    status, answer = _send(gw.http, "POST", "/v2/models/echo_params/infer", body.encode(), many)
    assert status == 400
    assert json.loads(answer)["error"].startswith("forwarded headers total 5")
    code, details = _grpc_code(gw.grpc, tuple(many.items()))
    assert (code, details[:25]) == ("INVALID_ARGUMENT", "forwarded headers total 5")
    for _ in range(3):  # the server was never counted as failing: still served, never ejected
        assert _echoed_grpc(gw.grpc, (("x-tenant-id", "acme"),)).get("x-tenant-id") == "acme"
    assert all(s["healthy"] and not s.get("ejected") for s in gw.admin()["servers"]), gw.admin()["servers"]


def test_a_keys_bound_headers_reach_the_model_and_no_client_can_forge_them(echo_triton, make_gateway) -> None:
    """Issue 40, item 6: `auth.keys[].headers` are set by the gateway on every request of that key;
    the name is never forwarded from a client, so a model can trust `x-tenant`."""
    from gateway.state.auth import hash_key

    acme, other = "sk-acme-" + "a" * 24, "sk-other-" + "o" * 24
    keys = [
        {"name": "acme", "sha256": hash_key(acme), "headers": {"X-Tenant": "acme"}},
        {"name": "other", "sha256": hash_key(other)},
    ]
    gw = make_gateway(
        gateway_config(
            echo_triton,
            cache={"backend": "memory", "models": ["echo_params"]},
            auth={"keys": keys},
            routing={"header_forward_pattern": ".*"},
        )
    )
    forged = {"x-tenant": "globex", "x-other": "kept"}
    seen = _lowered(_echoed_http(gw.http, {**forged, "x-api-key": acme}))
    assert (seen.get("x-tenant"), seen.get("x-other")) == ("acme", "kept")
    seen = _lowered(_echoed_http(gw.http, {**forged, "x-api-key": other}))
    assert "x-tenant" not in seen and seen.get("x-other") == "kept"
    seen = _lowered(_echoed_http(gw.http, {"x-api-key": acme}))
    assert seen.get("x-tenant") == "acme"
    seen = _lowered(_echoed_grpc(gw.grpc, (("x-tenant", "globex"), ("x-api-key", acme))))
    assert seen.get("x-tenant") == "acme"
    seen = _lowered(_echoed_grpc(gw.grpc, (("x-tenant", "acme"), ("x-api-key", other))))
    assert "x-tenant" not in seen
