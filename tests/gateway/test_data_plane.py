"""The HAProxy gRPC data plane (gateway/haproxy.py, gateway/grpc_bridge.py) against real clients:
what a client sends cannot pass for what HAProxy vouches for, compression and size bounds hold,
malformed transport headers are refused by name, and a dead HAProxy is replaced."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil
import pytest
from tritonclient.grpc import service_pb2 as pb

from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, wait_until
from tests.gateway.test_workers import ROW

INFER = "/inference.GRPCInferenceService/ModelInfer"


def infer_request(rows: int = 1) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="lt")
    req.inputs.add(name="features", datatype="FP32", shape=[rows, 8])
    req.raw_input_contents.append(ROW.tobytes() * rows)
    return req


def call(gw: GatewayUnderTest, req: pb.ModelInferRequest, **kwargs: object) -> pb.ModelInferResponse:
    with grpc.insecure_channel(f"{gw.host}:{gw.grpc_port}") as ch:
        stub = ch.unary_unary(
            INFER,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        return stub(req, timeout=10, **kwargs)  # type: ignore[arg-type]


def haproxy_of(gw: GatewayUnderTest) -> psutil.Process:
    return next(p for p in psutil.Process(gw.proc.pid).children() if p.name() == "haproxy")


def test_a_client_cannot_claim_another_address_past_per_client_limits(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(
        gateway_config(
            fleet, limits={"per_client_rate_per_s": 0.001, "per_client_burst": 3}, cache={"backend": "none"}
        )
    )
    codes = []
    for i in range(6):
        spoof = (("x-skewserve-peer", f"10.0.0.{i}"), ("x-forwarded-for", f"10.0.1.{i}"))
        try:
            call(gw, infer_request(), metadata=spoof)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)  # type: ignore[attr-defined]
    assert codes == ["OK"] * 3 + ["RESOURCE_EXHAUSTED"] * 3


def test_compressed_messages_are_served_and_their_bounds_hold(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(
        gateway_config(fleet, limits={"max_request_bytes": 64 * 1024}, cache={"backend": "none"})
    )
    plain = call(gw, infer_request())
    zipped = call(gw, infer_request(), compression=grpc.Compression.Gzip)
    assert zipped.raw_output_contents == plain.raw_output_contents
    # 4,000 rows of zeros compress to a few hundred bytes and inflate past max_request_bytes.
    big = pb.ModelInferRequest(model_name="lt")
    big.inputs.add(name="features", datatype="FP32", shape=[4000, 8])
    big.raw_input_contents.append(bytes(4000 * 8 * 4))
    with pytest.raises(grpc.RpcError) as caught:
        call(gw, big, compression=grpc.Compression.Gzip)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "limits.max_request_bytes" in caught.value.details()  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as caught:
        call(gw, big)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "limits.max_request_bytes" in caught.value.details()  # type: ignore[attr-defined]
    assert call(gw, infer_request()).raw_output_contents == plain.raw_output_contents


def test_a_malformed_grpc_timeout_is_refused_by_name(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest], tmp_path: Path
) -> None:
    gw = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
    message = infer_request().SerializeToString()
    body = tmp_path / "body.bin"
    body.write_bytes(b"\x00" + len(message).to_bytes(4, "big") + message)

    def raw_call(timeout: str) -> str:
        done = subprocess.run(
            [
                "nghttp", "-nv", "-H", "content-type: application/grpc", "-H", "te: trailers",
                "-H", f"grpc-timeout: {timeout}", "-d", str(body),
                f"http://{gw.host}:{gw.grpc_port}{INFER}",
            ],
            capture_output=True, timeout=30,
        )  # fmt: skip
        return done.stdout.decode(errors="replace")

    bad = raw_call("soon")
    assert "grpc-status: 3" in bad and "grpc-timeout" in bad
    assert "grpc-status: 0" in raw_call("5S")


def test_a_killed_haproxy_is_replaced(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
    first = call(gw, infer_request())
    victim = haproxy_of(gw)
    victim.kill()
    victim.wait(10)

    def answers() -> bool:
        try:
            return call(gw, infer_request()).raw_output_contents == first.raw_output_contents
        except grpc.RpcError:
            return False

    wait_until(answers, timeout=30, what="gRPC answered by a new HAProxy")
    assert haproxy_of(gw).pid != victim.pid


def test_the_grpcio_plane_still_serves(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, listen={"grpc_data_plane": "grpcio"}, cache={"backend": "none"}))
    assert call(gw, infer_request()).model_name == "lt"
    assert not [p for p in psutil.Process(gw.proc.pid).children() if p.name() == "haproxy"]


def test_ids_and_names_triton_would_echo_are_bounded(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
    long_id = infer_request()
    long_id.id = "i" * 9000
    long_name = infer_request()
    long_name.inputs[0].name = "n" * 20_000  # a 5000-byte id is served: test_ops
    for req, field in ((long_id, "id has 9000 bytes"), (long_name, "inputs[0].name")):
        with pytest.raises(grpc.RpcError) as caught:
            call(gw, req)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert field in caught.value.details()  # type: ignore[attr-defined]
    # The server that would have echoed them was never blamed.
    assert all(s["failures"] == 0 for s in gw.admin()["servers"])
